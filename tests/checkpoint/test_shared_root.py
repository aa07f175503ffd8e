"""Several jobs on one checkpoint root: a job's ranks load one checkpoint whatever another job
commits meanwhile, a save never removes a checkpoint another job committed while it ran, and a
rank that dies while its job's first asynchronous save sets up does not strand the others
(what holds: docs/reliability.md, "Several jobs on one root")."""

from __future__ import annotations

import datetime
import json
import os
import random
import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from helpers.dist import DistributedRunError, run_distributed
from faults.common import (Net, check_root, check_state, config, differences, snapshot,
                           train_step, trained)
from shardopt import DistributedOptimizer, checkpoint
from shardopt.checkpoint import commit


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.005)


def _steps(root: Path) -> list[int]:
    return [commit.step_of(p) for p in commit.complete_steps(root)]


# ------------------------------------------------- a save and another job's commit
def _older_step_commits_last(rank: int, world_size: int, root: str) -> str:
    """Two single-process jobs. Job 0 saves step 5 into an empty root (no resume, no
    rollback); job 1 saves step 6 once job 0's save has begun, and commits it before job 0
    commits (job 0 waits for that just before writing its manifest)."""
    root_p = Path(root)
    if rank == 1:
        _wait_for(lambda: root_p.is_dir() and any(n.startswith(".tmp-step_00000005")
                                                  for n in os.listdir(root_p)),
                  "job 0's save to begin")
        return checkpoint.save(root, *trained(6), step=6)
    real = commit.write_atomic

    def write_atomic(path: Path, data: bytes) -> None:
        if path.name == "manifest.json":
            _wait_for(lambda: commit.is_complete(root_p / "step_00000006"), "job 1's commit")
        real(path, data)

    with mock.patch.object(commit, "write_atomic", write_atomic):
        return checkpoint.save(root, *trained(5), step=5)


def test_a_checkpoint_committed_during_a_save_is_kept(tmp_path: Path) -> None:
    """Step 5 commits after step 6, which another job committed while step 5 was being
    saved: both stay, and ``latest`` names the newer step 6."""
    root = tmp_path / "root"
    paths = run_distributed(_older_step_commits_last, 2, str(root), backend=None,
                            tmp_path=tmp_path, timeout=120)
    assert paths == [str(root / "step_00000005"), str(root / "step_00000006")]
    assert _steps(root) == [5, 6]
    assert checkpoint.latest(root) == str(root / "step_00000006")
    assert (root / "latest").read_text() == "step_00000006\n"
    check_root(root)
    check_state(paths[0], 5)
    check_state(paths[1], 6)
    assert [n for n in os.listdir(root) if n.startswith(".")] == [".lock"]


def _interleaved_saves(rank: int, world_size: int, root: str, num_saves: int
                       ) -> dict[str, Any]:
    """A single-process job saving steps rank+1, rank+3, ... (plain saves: no resume, no
    rollback, no retention) next to another one saving the steps in between. A save of a
    step below one already committed is refused at its start; every other one commits."""
    committed, refused = [], []
    for i in range(num_saves):
        step = 2 * i + 1 + rank
        model, opt = trained(step)
        try:
            checkpoint.save(root, model, opt, step=step)
            committed.append(step)
        except checkpoint.CheckpointError as e:
            assert "would replace them (a rollback)" in str(e), str(e)
            refused.append(step)
    return {"committed": committed, "refused": refused}


RACE_SAVES = 25


def test_interleaved_saves_of_two_jobs_lose_nothing(tmp_path: Path) -> None:
    """Two jobs saving interleaved steps into one root (bounded race: 2 x 25 saves): every
    checkpoint either job committed is still there, whole and with its state, and
    ``latest`` names the highest step."""
    root = tmp_path / "root"
    out = run_distributed(_interleaved_saves, 2, str(root), RACE_SAVES, backend=None,
                          tmp_path=tmp_path, timeout=120)
    committed = sorted(s for r in out for s in r["committed"])
    print(f"\ninterleaved saves: {len(committed)} committed, "
          f"{sum(len(r['refused']) for r in out)} refused at their start")
    assert _steps(root) == committed
    assert checkpoint.latest(root) == str(root / f"step_{committed[-1]:08d}")
    for p in check_root(root):
        check_state(str(p), commit.step_of(p))
    assert [n for n in os.listdir(root) if n.startswith(".")] == [".lock"]


# --------------------------------------------------------- the ranks of one load
def _ranks_given_different_checkpoints(rank: int, world_size: int, root: str
                                       ) -> dict[str, Any]:
    """Rank 0 loads step 1 and rank 1 step 2 (what resolving ``latest`` on each rank can
    give while another job commits); then rank 0 the root and rank 1 an older step by
    path; then the root and its latest checkpoint by path, which is the same one."""
    root_p = Path(root)
    for step in (1, 2):
        checkpoint.save(root, *trained(step), step=step)
    model, opt = trained(3)
    before = snapshot(model, opt)
    errors = []
    for given in ([root_p / "step_00000001", root_p / "step_00000002"],
                  [root_p, root_p / "step_00000001"]):
        try:
            checkpoint.load(given[rank], model, opt)
            errors.append(None)
        except checkpoint.CheckpointError as e:
            errors.append(str(e))
    changed = differences(before, snapshot(model, opt))
    info = checkpoint.load([root_p, root_p / "step_00000002"][rank], model, opt)
    return {"errors": errors, "changed": changed, "loaded": info.path}


def test_ranks_given_different_checkpoints_all_refuse(tmp_path: Path) -> None:
    root = tmp_path / "root"
    out = run_distributed(_ranks_given_different_checkpoints, 2, str(root), tmp_path=tmp_path,
                          timeout=120)
    for r in out:  # the same error on every rank (after "loading <what it was given>")
        assert [e.partition(" failed: ")[2] for e in r["errors"]] == \
            [e.partition(" failed: ")[2] for e in out[0]["errors"]]
        assert r["changed"] == []
        assert r["loaded"] == str(root / "step_00000002")
    first, second = out[0]["errors"]
    assert first is not None and "the ranks were given different checkpoints" in first
    assert str(root / "step_00000001") in first and str(root / "step_00000002") in first
    assert second is not None and str(root / "step_00000001") in second \
        and str(root / "step_00000002") in second


LOADS = 120


def _load_while_another_job_saves(rank: int, world_size: int, root: str, num_loads: int
                                  ) -> dict[str, Any]:
    """Ranks 0 and 1 are one job (its own DP group) loading ``root`` over and over; rank 2
    is another job (a DP group of its own) committing a new step into it meanwhile."""
    loaders, saver = dist.new_group([0, 1]), dist.new_group([2])
    root_p, stop = Path(root), Path(root + ".stop")
    if rank == 2:
        step = 1
        while not stop.exists():
            torch.manual_seed(step)
            model = Net()
            opt = DistributedOptimizer(model, config(), process_group=saver)
            train_step(model, opt, step)
            checkpoint.save(root, model, opt, step=step)
            step += 1
        dist.barrier()
        return {"saved": step - 1}
    _wait_for(lambda: checkpoint.latest(root_p) is not None, "the first checkpoint")
    torch.manual_seed(0)
    model = Net()
    opt = DistributedOptimizer(model, config(), process_group=loaders)
    mixed, steps, jitter = 0, set(), random.Random(rank)
    for _ in range(num_loads):
        time.sleep(jitter.uniform(0, 0.02))  # ranks of a job reach a load at other moments
        info = checkpoint.load(root, model, opt)
        seen: list[Any] = [None, None]
        dist.all_gather_object(seen, (info.path, info.step, opt.param_steps), group=loaders)
        mixed += seen[0] != seen[1]
        steps.add(info.step)
    if rank == 0:
        stop.touch()
    dist.barrier()
    return {"mixed": mixed, "steps": sorted(steps)}


def test_one_job_loads_one_checkpoint_while_another_commits(tmp_path: Path) -> None:
    """Bounded race: 120 loads of the root by a job of 2 ranks, each rank starting each load
    up to 20 ms apart, while another job commits step after step into it. Every load puts
    both ranks on the same checkpoint."""
    root = tmp_path / "root"
    out = run_distributed(_load_while_another_job_saves, 3, str(root), LOADS,
                          tmp_path=tmp_path, timeout=240)
    print(f"\nloads while saving: {out[2]['saved']} steps committed, the loads saw "
          f"{len(out[0]['steps'])} different steps")
    assert out[0]["mixed"] == out[1]["mixed"] == 0
    assert len(out[0]["steps"]) > 1  # the loads did race the commits


# ------------------------------------------- a rank dying in the first async save
GROUP_TIMEOUT_S = 5


def _dies_while_the_first_async_save_sets_up(rank: int, world_size: int, root: str,
                                             store: str, out: str) -> None:
    """A job whose process group times out after 5 s. Rank 1 dies (exits) when its first
    asynchronous save creates a process group; rank 0 writes what happened to ``out``."""
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    model, opt = trained(1)
    if rank == 1:
        mock.patch.object(dist, "new_group", lambda *a, **k: os._exit(0)).start()
    start = time.monotonic()
    try:
        checkpoint.save(root, model, opt, step=1, blocking=False).wait()
        outcome = "saved"
    except Exception as e:  # noqa: BLE001 - what the survivor raised is the result
        outcome = f"{type(e).__name__}: {e}"
    Path(out).write_text(json.dumps({"seconds": time.monotonic() - start, "raised": outcome}))
    os._exit(0)  # the process group has a dead peer: leave without tearing it down


def test_a_rank_dying_in_the_first_async_save_does_not_strand_the_others(tmp_path: Path
                                                                         ) -> None:
    """The survivor raises within the job's process-group timeout (5 s here; gloo's default
    for a new group is 30 minutes), naming the step and its rank; nothing is committed."""
    root, out = tmp_path / "root", tmp_path / "survivor.json"
    with pytest.raises(DistributedRunError, match="rank 1 exited without a result"):
        run_distributed(_dies_while_the_first_async_save_sets_up, 2, str(root),
                        str(tmp_path / "store"), str(out), backend=None, tmp_path=tmp_path,
                        timeout=90)
    assert out.exists(), "the surviving rank never came back from the save"
    survivor = json.loads(out.read_text())
    print(f"\nthe survivor raised after {survivor['seconds']:.1f} s: {survivor['raised'][:300]}")
    assert survivor["raised"].startswith("CheckpointError: saving step 1"), survivor
    assert "[dp rank 0]" in survivor["raised"]
    assert survivor["seconds"] < GROUP_TIMEOUT_S + 20, survivor
    assert checkpoint.latest(root) is None
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]
