"""Run a function on several ranks, each in its own process, and bring the results back.

:func:`run_distributed` runs ``fn(rank, world_size, *args)`` on ranks that join a process
group rendezvoused through a ``FileStore`` under ``tmp_path`` and returns each rank's return
value (``torch.save`` d), in rank order. An exception in any rank fails the call with that
rank's traceback; a rank that never finishes is terminated after ``timeout`` seconds.
``fn`` must be a module-level function, so it pickles (no ``torch.testing._internal``).

Ranks start through a fork server that has imported torch, so a rank starts in tens of
milliseconds instead of the seconds a fresh interpreter needs (``start_method="spawn"`` for
comparison); the server never touches CUDA, so NCCL ranks may initialise their devices after
the fork. Such a rank ends as multiprocessing's do, with ``os._exit``. ``interpreter_exit=True``
ends each rank as a launched job's process ends instead (exit handlers, module teardown,
finalisation, then the exit status), forked from a server of its own (:func:`_serve`,
started once per test process), for tests of how a job exits.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import pytest
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
    if backend is not None and dist.is_initialized():  # fn may have ended it itself
        dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = "gloo",
    tmp_path: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    start_method: str | None = None,
    interpreter_exit: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return each rank's result.

    ``backend=None`` starts the processes without a process group (e.g. to check
    that world size 1 works with ``torch.distributed`` uninitialised). ``fn`` and
    ``args`` must be picklable; ``fn`` must be a module-level function.
    ``interpreter_exit``: each rank exits through the interpreter (see the module's
    docstring); a rank whose exit status is not 0 fails the call as a crash does.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"nccl with {world_size} ranks needs {world_size} GPUs, "
                         f"found {torch.cuda.device_count()}")
    base = Path(tmp_path) if tmp_path is not None else Path(tempfile.mkdtemp(prefix="shardopt-dist-"))
    run_dir = base / f"dist_run_{os.getpid()}_{next(_run_ids)}"
    run_dir.mkdir(parents=True)

    jobs = [(fn, rank, world_size, args, backend, str(run_dir), timeout)
             for rank in range(world_size)]
    saved_env = {k: os.environ.get(k) for k in _CHILD_ENV}
    os.environ.update(_CHILD_ENV)  # seen by spawned children and by a fork server started now
    try:
        if interpreter_exit:
            server = _exit_server()
            procs = [server.start(job) for job in jobs]
        else:
            ctx = _context(start_method or _start_method())
            procs = [ctx.Process(target=_worker, args=job, name=f"rank{job[1]}", daemon=True)
                     for job in jobs]
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
        # One sentinel may stand for several ranks (interpreter_exit: the server's replies).
        wait(list(dict.fromkeys(p.sentinel for p in alive)), timeout=min(remaining, 1.0))
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


# ------------------------------------------------- ranks that exit through the interpreter

def _serve(requests_fd: int, replies_fd: int) -> None:
    """The server of ``interpreter_exit`` ranks (its own interpreter): for each job it reads,
    fork a rank and answer its pid; answer each rank's exit status once it has ended. A rank
    runs :func:`_worker` and leaves this function by ``SystemExit``, so its interpreter exits
    as a script's does. Ends when the test process closes its end."""
    requests, replies = Connection(requests_fd, writable=False), Connection(replies_fd,
                                                                             readable=False)
    while True:
        if requests.poll(0.05):
            try:
                job = pickle.loads(requests.recv_bytes())
            except EOFError:
                return
            except Exception:  # noqa: BLE001 - an unpicklable job: said to the test process
                replies.send(("error", traceback.format_exc()))
                continue
            pid = os.fork()
            if pid == 0:
                requests.close()
                replies.close()
                _worker(*job)
                sys.exit(0)
            replies.send(("started", pid))
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            replies.send(("ended", pid, os.waitstatus_to_exitcode(status)))


class _ExitServer:
    """The test process's side of :func:`_serve`."""

    def __init__(self) -> None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        code = (f"import sys; sys.path[:] = {sys.path!r}; "
                f"[__import__(m) for m in {_PRELOAD!r}]; "
                f"from helpers import dist; dist._serve({req_r}, {rep_w})")
        self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(req_r, rep_w))
        os.close(req_r)
        os.close(rep_w)
        self._requests = Connection(req_w, readable=False)
        self.replies = Connection(rep_r, writable=False)
        self.ended: dict[int, int] = {}

    def start(self, job: tuple) -> _ServedRank:
        self._requests.send_bytes(pickle.dumps(job))
        while True:
            reply = self.replies.recv()
            if reply[0] == "started":
                return _ServedRank(self, reply[1])
            if reply[0] == "error":
                raise DistributedRunError(f"the rank server could not start a rank:\n{reply[1]}")
            self.ended[reply[1]] = reply[2]

    def poll(self) -> None:
        while self.replies.poll():
            _, pid, code = self.replies.recv()
            self.ended[pid] = code

    def close(self) -> None:
        self._requests.close()
        self._proc.wait()


class _ServedRank:
    """A rank forked by :func:`_serve`, with the parts of ``multiprocessing.Process`` that
    :func:`_wait_all` and :func:`_collect_failures` use."""

    def __init__(self, server: _ExitServer, pid: int) -> None:
        self._server, self.pid = server, pid
        self.sentinel = server.replies  # readable when some rank has ended

    @property
    def exitcode(self) -> int | None:
        self._server.poll()
        return self._server.ended.get(self.pid)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.exitcode is None:
            os.kill(self.pid, sig)

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None and (deadline is None or time.monotonic() < deadline):
            wait([self.sentinel], timeout=0.05)


_server: _ExitServer | None = None


def _exit_server() -> _ExitServer:
    global _server
    if _server is None:
        _server = _ExitServer()
        atexit.register(_server.close)
    return _server


def device_for(backend: str | None, rank: int) -> torch.device:
    """The device a rank computes on: its own GPU under NCCL, else the CPU."""
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def require_world_size(backend: str, world_size: int) -> None:
    """Skip the calling test when ``backend`` cannot run ``world_size`` ranks here."""
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        pytest.skip(f"nccl with {world_size} ranks needs {world_size} GPUs, "
                    f"found {torch.cuda.device_count()}")


def spawn_process(target: Callable[..., Any], *args: Any) -> mp.Process:
    """Start ``target(*args)`` in a process of its own (a fork server that has imported torch,
    shardopt's checkpoint and the fault injectors), for a test that kills or watches it."""
    ctx = mp.get_context("forkserver")
    # Takes effect only if no fork server runs yet (run_distributed preloads the same modules).
    ctx.set_forkserver_preload(_PRELOAD + ["shardopt.checkpoint", "faults.ranks"])
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    return p


# ----------------------------------------------------------------- the frameworks' runs

def launcher_env(rank: int, world_size: int) -> None:
    """What ``torchrun`` / ``accelerate launch`` set (the process group exists already)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")


def runs_at_two_sizes(job: Callable[..., Any], load_only: Callable[..., Any], tmp: Path,
                      saved_by: Callable[[int], str]) -> dict[int, list[Any]]:
    """``job(rank, world_size, tmp, other)`` at 2 processes, then at 1 with ``other`` what
    the 2 saved (``saved_by(2)``), then ``load_only(rank, 2, tmp, saved_by(1))``: results
    by world size, the last under 21. Forked ranks start with the framework imported."""
    def run(fn: Callable[..., Any], world_size: int, other: str | None) -> list[Any]:
        return run_distributed(fn, world_size, str(tmp), other, tmp_path=tmp, start_method="fork")

    two = run(job, 2, None)
    one = run(job, 1, saved_by(2))
    return {1: one, 2: two, 21: run(load_only, 2, saved_by(1))}
