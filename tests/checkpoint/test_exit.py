"""A finished job exits 0, and nothing of the library outlives ``destroy_process_group()``.

The ranks here end as a launched job's processes do (``torchrun``'s, ``shardopt train``'s):
through the interpreter's exit, with its exit handlers, module teardown and finalisation
(``run_distributed(..., interpreter_exit=True)``), not through ``os._exit`` as the other
tests' ranks do. A gloo group still running when the interpreter finalises can abort a
finished process (``terminate called without an active exception``, SIGABRT, see
docs/reliability.md, Shutdown), more often under CPU load. So many short jobs (load the
previous job's checkpoint at another DP size, train, save blocking and in the background,
``destroy_process_group()``, exit) run beside busy-loop processes, one per core, and every
exit status must be 0; each rank also reports the threads it still runs after
``destroy_process_group()``: a thread left there is what the abort needs, whether or not a
run's timing makes it happen.

``SHARDOPT_EXIT_JOBS`` sets how many jobs run (default 12, under a minute on 2 cores; the
longer check runs 200). A failed save's kept error must not keep a group running either.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch.distributed as dist

from helpers.dist import run_distributed
from helpers.models import build, train
from shardopt import checkpoint

JOBS = int(os.environ.get("SHARDOPT_EXIT_JOBS", "12"))
SIZES = (2, 3)  # consecutive jobs load each other's checkpoints: every load reshards

pytestmark = pytest.mark.skipif(sys.platform != "linux",
                                reason="threads are listed from /proc; the writer process "
                                       "needs memfd")


def job_rank(rank: int, world_size: int, root: str, previous: str | None) -> list[str]:
    model, opt = build(world_size)
    if previous is not None:
        checkpoint.load(previous, model, opt)
    train(model, opt, range(1), rank, world_size)
    checkpoint.save(root, model, opt, step=1)
    checkpoint.save(root, model, opt, step=2, blocking=False).wait()
    dist.destroy_process_group()
    return _threads_but_this_one()


def failed_save_rank(rank: int, world_size: int, root: str) -> dict[str, object]:
    """Rank 1's background write fails; the error is kept (its traceback passes through the
    save's frames, which held the group), and still no thread runs after
    destroy_process_group()."""
    save_module = importlib.import_module("shardopt.checkpoint.save")
    model, opt = build(0)
    train(model, opt, range(1), rank, world_size)

    def broken(path, *args, **kwargs):
        raise OSError(5, "I/O error (simulated)", path)

    error = None
    with mock.patch.object(save_module, "write_rank_files",
                           broken if rank == 1 else save_module.write_rank_files):
        handle = checkpoint.save(root, model, opt, step=1, blocking=False)
        try:
            handle.wait()
        except checkpoint.CheckpointError as e:
            error = e
    dist.destroy_process_group()
    return {"left": _threads_but_this_one(), "error": str(error)}


def _threads_but_this_one() -> list[str]:
    """The names of this process's other threads. A rank is forked from one thread, so any
    other was started while it ran."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != os.getpid():
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
    return sorted(names)


@pytest.fixture
def busy_cores():
    """One busy-loop process per core, for as long as the test runs."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(os.cpu_count() or 2)]
    yield
    for p in loops:
        p.kill()
        p.wait()


def test_jobs_under_cpu_load_exit_0_with_no_thread_left(tmp_path, busy_cores):
    previous = None
    for job in range(JOBS):
        n = SIZES[job % len(SIZES)]
        root = tmp_path / f"job{job}"
        # Raises if a rank's exit status is not 0 ("died with exit code -6" for SIGABRT).
        left = run_distributed(job_rank, n, str(root), previous, tmp_path=tmp_path / "runs",
                               interpreter_exit=True)
        assert left == [[]] * n, (
            f"job {job} (DP {n}): threads still running after destroy_process_group(), "
            f"by rank: {left}")
        assert checkpoint.latest(root) == str(root / "step_00000002")
        previous = str(root)


def test_the_kept_error_of_a_failed_save_leaves_no_thread(tmp_path):
    results = run_distributed(failed_save_rank, 2, str(tmp_path / "root"), tmp_path=tmp_path)
    for rank, r in enumerate(results):
        assert "I/O error (simulated)" in r["error"], (rank, r["error"])
        assert r["left"] == [], f"rank {rank}: threads after destroy_process_group(): {r['left']}"
