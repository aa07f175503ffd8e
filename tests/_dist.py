"""Run a function on several ranks, each in its own process, and bring the results back.

A deliberately small helper (no ``torch.testing._internal``)::

    def check(rank, world_size, n):            # module level, so it pickles
        ...
        return {"loss": loss, "params": params}

    results = run_distributed(check, 3, 10, tmp_path=tmp_path)   # one entry per rank

Each rank joins a process group rendezvoused through a ``FileStore`` under
``tmp_path``, runs ``fn(rank, world_size, *args)`` and writes the return value
with ``torch.save``; the parent loads them and returns them in rank order.
An exception in any rank fails the call with that rank's traceback; a rank
that never finishes is terminated after ``timeout`` seconds. Nothing can hang.

Processes start through a fork server that has already imported torch, so a
rank starts in tens of milliseconds instead of the seconds a fresh interpreter
needs to import torch (``start_method="spawn"`` is there for comparison or if
a platform misbehaves). The fork server never touches CUDA, so NCCL ranks may
initialise their devices after the fork.
"""

from __future__ import annotations

import datetime
import itertools
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 300.0
# After one rank fails, survivors usually fail soon too (closed connections);
# wait this long for their tracebacks before terminating them.
FAILURE_GRACE_S = 5.0
# torch._dynamo: torch.optim.Optimizer.__init__ imports it, which alone takes seconds.
_PRELOAD = ["torch", "torch.distributed", "torch.nn", "torch.optim", "torch._dynamo",
            "torch.distributed.checkpoint"]
_CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_run_ids = itertools.count()


class DistributedRunError(RuntimeError):
    """One or more ranks failed, crashed or timed out."""


def _start_method() -> str:
    return os.environ.get("SHARDOPT_TEST_START_METHOD", "forkserver")


def _context(start_method: str):
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    backend: str | None,
    run_dir: str,
    timeout_s: float,
) -> None:
    os.environ.update(_CHILD_ENV)
    torch.set_num_threads(1)
    run_path = Path(run_dir)
    try:
        if backend is not None:
            import torch.distributed as dist

            if backend == "nccl":
                torch.cuda.set_device(rank)
            store = dist.FileStore(str(run_path / "store"), world_size)
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        torch.save(fn(rank, world_size, *args), run_path / f"result_{rank}.pt")
    except BaseException:  # noqa: BLE001 - reported to the parent, then exit non-zero
        # Written before the process group goes down, so peers fail after this
        # timestamp and the parent can list the root cause first.
        stamp = time.monotonic_ns()
        (run_path / f"error_{rank}.txt").write_text(f"{stamp}\n{traceback.format_exc()}")
        raise SystemExit(1) from None
    if backend is not None:
        dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = "gloo",
    tmp_path: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return each rank's result.

    ``backend=None`` starts the processes without a process group (e.g. to check
    that world size 1 works with ``torch.distributed`` uninitialised). ``fn`` and
    ``args`` must be picklable; ``fn`` must be a module-level function.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"nccl with {world_size} ranks needs {world_size} GPUs, "
                         f"found {torch.cuda.device_count()}")
    base = Path(tmp_path) if tmp_path is not None else Path(tempfile.mkdtemp(prefix="shardopt-dist-"))
    run_dir = base / f"dist_run_{os.getpid()}_{next(_run_ids)}"
    run_dir.mkdir(parents=True)

    ctx = _context(start_method or _start_method())
    saved_env = {k: os.environ.get(k) for k in _CHILD_ENV}
    os.environ.update(_CHILD_ENV)  # seen by spawned children and by a fork server started now
    try:
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, rank, world_size, args, backend, str(run_dir), timeout),
                name=f"rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    _wait_all(procs, timeout)
    failures = _collect_failures(procs, run_dir, timeout)
    if failures:
        raise DistributedRunError("\n".join(failures))
    return [torch.load(run_dir / f"result_{rank}.pt", weights_only=False)
            for rank in range(world_size)]


def _wait_all(procs: list[Any], timeout: float) -> None:
    """Wait until every rank exits, one fails (plus a grace period), or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            return
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        limit = deadline if failed_at is None else min(deadline, failed_at + FAILURE_GRACE_S)
        remaining = limit - time.monotonic()
        if remaining <= 0:
            break
        wait([p.sentinel for p in alive], timeout=min(remaining, 1.0))
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(5.0)
        if p.exitcode is None:
            p.kill()
            p.join()


def _collect_failures(procs: list[Any], run_dir: Path, timeout: float) -> list[str]:
    """Why ranks failed: crashes first, then tracebacks earliest first, then stragglers.

    A rank that raises usually takes its peers down with connection errors a
    moment later, so the earliest traceback is the one to read.
    """
    errors: list[tuple[int, str]] = []
    stragglers: list[int] = []
    for rank, p in enumerate(procs):
        err = run_dir / f"error_{rank}.txt"
        if err.exists():
            stamp, _, text = err.read_text().partition("\n")
            errors.append((int(stamp), f"--- rank {rank} raised:\n{text}"))
        elif p.exitcode in (-signal.SIGTERM, -signal.SIGKILL):
            stragglers.append(rank)
        elif p.exitcode != 0:
            errors.append((-1, f"--- rank {rank} died with exit code {p.exitcode}"))
        elif not (run_dir / f"result_{rank}.pt").exists():
            errors.append((-1, f"--- rank {rank} exited without a result"))
    out = [msg for _, msg in sorted(errors, key=lambda e: e[0])]
    if stragglers:
        why = "after another rank failed" if errors else f"after the {timeout:.0f} s timeout"
        out.append(f"--- ranks {stragglers} were terminated {why}")
    return out


def device_for(backend: str | None, rank: int) -> torch.device:
    """The device a rank computes on: its own GPU under NCCL, else the CPU."""
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def require_world_size(backend: str, world_size: int) -> None:
    """Skip the calling test when ``backend`` cannot run ``world_size`` ranks here."""
    import pytest

    if backend == "nccl" and torch.cuda.device_count() < world_size:
        pytest.skip(f"nccl with {world_size} ranks needs {world_size} GPUs, "
                    f"found {torch.cuda.device_count()}")
