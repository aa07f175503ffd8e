"""Start the ranks of a training job: reuse a torchrun environment, or spawn with PyTorch's launcher.

Under ``torchrun`` (``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set) this process is one rank of a job
that already exists, possibly across nodes, so it runs the job directly. Otherwise it starts ``nproc``
local ranks with ``torch.distributed.launcher.api.elastic_launch`` (the launcher behind ``torchrun
--standalone``: c10d rendezvous on a free local port, no restarts); with ``nproc == 1`` the
single rank runs in this process without a process group.

A rank that fails writes its message (a user error: a ``ValueError`` such as a checkpoint that does
not fit the model) or its traceback (anything else) to a per-launch directory and exits. When one rank
fails on a user error, its peers usually fail too, on the broken connections; so a user error from
any rank wins: the launcher raises it as one :class:`LaunchError` (the lowest rank's) and drops the
peers' tracebacks. Otherwise it prints the tracebacks and raises :class:`WorkerFailed`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

# How often the agent polls the ranks: a failed or finished job is seen this late at most.
MONITOR_INTERVAL_S = 0.05
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


class LaunchError(ValueError):
    """A rank stopped on a user error; the message is that rank's."""


class WorkerFailed(RuntimeError):
    """A rank crashed or was killed; tracebacks, if any, are printed before this is raised."""


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def launch(fn: Callable[..., Any], *args: Any, nproc: int) -> Any:
    """Run ``fn(*args)`` on every rank; returns this rank's result under torchrun, else rank 0's.

    Raises :class:`LaunchError` or :class:`WorkerFailed` if a spawned rank fails, and
    ``KeyboardInterrupt`` when the launcher is stopped by SIGINT/SIGTERM (the ranks are stopped too).
    """
    if under_torchrun() or nproc == 1:
        try:
            result = fn(*args)
            _finish_together()
            return result
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        run_id=f"shardopt-{uuid.uuid4().hex[:8]}",
        max_restarts=0,
        monitor_interval=MONITOR_INTERVAL_S,
        start_method="spawn",
    )
    # The agent and torch.multiprocessing log worker starts, stops and failures (with a second copy of
    # the traceback); ranks report their own failures instead, see _worker.
    # Elastic's loggers set their own levels, so each is quietened by name.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="shardopt-launch-") as error_dir:
        try:
            results = elastic_launch(config, _worker)(fn, error_dir, *args)
        except ChildFailedError as exc:
            messages = _by_rank(error_dir, "error")
            if messages:
                raise LaunchError(messages[0].read_text().strip()) from None
            traces = _by_rank(error_dir, "traceback")
            for trace in traces:
                sys.stderr.write(trace.read_text())
            failed = ", ".join(f"rank {r} {_how(f.exitcode)}" for r, f in sorted(exc.failures.items()))
            raise WorkerFailed(failed + (" (tracebacks above)" if traces else "")) from None
        except SignalException:
            raise KeyboardInterrupt from None
    return results[0]


def _by_rank(error_dir: str, kind: str) -> list[Path]:
    return sorted(Path(error_dir).glob(f"rank*.{kind}"), key=lambda p: int(p.name[4:].split(".")[0]))


def _how(exitcode: int) -> str:
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _finish_together() -> None:
    """Collective. After a rank's work succeeded: wait for every rank before the process group
    is torn down, so that no rank closes its connections while a peer still uses them."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _worker(fn: Callable[..., Any], error_dir: str, *args: Any) -> Any:
    try:
        result = fn(*args)
        _finish_together()
        return result
    except USER_ERRORS as exc:
        _report(error_dir, "error", str(exc))
        sys.exit(2)
    except Exception:
        _report(error_dir, "traceback", f"[rank {os.environ.get('RANK', '0')}] {traceback.format_exc()}")
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _report(error_dir: str, kind: str, text: str) -> None:
    """Write this rank's failure where the launcher looks, whole or not at all (the launcher may
    stop this process as soon as a peer's failure is seen)."""
    path = Path(error_dir, f"rank{os.environ.get('RANK', '0')}.{kind}")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
