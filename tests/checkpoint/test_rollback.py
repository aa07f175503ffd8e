"""Rolling back: saving step k after resuming from an older checkpoint while steps >= k exist.

The abandoned branch (committed steps >= k) is replaced when the new step k commits, never
before; a crash at any point leaves either the old branch untouched or the new step k
committed with ``latest`` on it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from pathlib import Path

import pytest

from faults import ranks
from faults.common import check_root, check_state, read_json, trained
from helpers.dist import spawn_process
from shardopt import checkpoint
from shardopt.checkpoint import commit


def _branch(root: Path, steps: range) -> dict[str, str]:
    """Save ``steps``; return each checkpoint's manifest checksum (its identity)."""
    for step in steps:
        checkpoint.save(root, *trained(step), step=step)
    return {p.name: read_json(p)["checksum"] for p in commit.complete_steps(root)}


def test_resume_from_an_older_step_and_save_on(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "root"
    _branch(root, range(1, 6))
    model, opt = trained(99)
    assert checkpoint.load(root / "step_00000002", model, opt).step == 2
    with caplog.at_level(logging.WARNING, logger="shardopt.checkpoint"):
        checkpoint.save(root, *trained(3), step=3, extra={"branch": "new"},
                        config=checkpoint.CheckpointConfig(rollback=True))
    assert [p.name for p in commit.complete_steps(root)] == ["step_00000001", "step_00000002",
                                                             "step_00000003"]
    assert checkpoint.latest(root) == str(root / "step_00000003")
    (root / "latest").unlink()  # the fallback finds no abandoned higher step either
    assert checkpoint.latest(root) == str(root / "step_00000003")
    check_state(str(root / "step_00000003"), 3)
    assert read_json(root / "step_00000003")["extra"] == {"branch": "new"}
    expected = [r.getMessage() for r in caplog.records]
    assert len(expected) == 1
    assert ("replaced step_00000003 and removed step_00000004, step_00000005 of the "
            "abandoned branch") in expected[0]
    checkpoint.save(root, *trained(4), step=4)  # and training goes on
    assert not any(n.startswith((".tmp-", ".trash-")) for n in os.listdir(root))
    check_root(root)


def test_a_run_that_did_not_resume_from_the_root_cannot_roll_it_back(tmp_path: Path) -> None:
    """A run started afresh into a root that holds a longer run's checkpoints is refused its
    first save, and nothing changes: it would replace every checkpoint from that step on.
    Resuming from the root at or before the step allows it, and so does ``rollback=True``."""
    root = tmp_path / "root"
    before = _branch(root, range(1, 5))
    model, opt = trained(2)
    for blocking in (True, False):
        with pytest.raises(checkpoint.CheckpointError,
                           match=r"holds committed checkpoints of steps 2, 3, 4 >= 2: saving "
                                 r"step 2 would replace them \(a rollback\), but this run did "
                                 r"not resume from it.*rollback=True"):
            handle = checkpoint.save(root, model, opt, step=2, blocking=blocking)
            handle.wait()
    assert {p.name: read_json(p)["checksum"] for p in commit.complete_steps(root)} == before
    assert opt.shard_state.loaded_from is None
    checkpoint.load(root / "step_00000003", model, opt)
    assert opt.shard_state.loaded_from == commit.Resumed(root.resolve(), 3)  # held by the optimizer
    with pytest.raises(checkpoint.CheckpointError, match="this run resumed from step 3 of it"):
        checkpoint.save(root, model, opt, step=2)
    checkpoint.save(root, model, opt, step=3)  # resumed at 3: 3 and 4 are the abandoned branch
    assert [p.name for p in commit.complete_steps(root)] == ["step_00000001", "step_00000002",
                                                             "step_00000003"]
    assert checkpoint.latest(root) == str(root / "step_00000003")


def test_rollback_replaces_step_k_content(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _branch(root, range(1, 4))
    model, opt = trained(2)
    checkpoint.save(root, model, opt, step=2, extra={"branch": "new"},
                    config=checkpoint.CheckpointConfig(rollback=True))
    check_state(str(root / "step_00000002"), 2)
    assert read_json(root / "step_00000002")["extra"] == {"branch": "new"}
    assert [p.name for p in commit.complete_steps(root)] == ["step_00000001", "step_00000002"]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_rollback_with_and_without_atomic_exchange(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          exchange: bool) -> None:
    root = tmp_path / "root"
    _branch(root, range(1, 4))
    used = []
    if exchange:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        if not commit.exchange(tmp_path / "a", tmp_path / "b"):
            pytest.skip("this file system has no RENAME_EXCHANGE")
        real = commit.exchange
        monkeypatch.setattr(commit, "exchange", lambda a, b: used.append(real(a, b)) or used[-1])
    else:
        monkeypatch.setattr(commit, "exchange", lambda a, b: False)
    checkpoint.save(root, *trained(2), step=2, extra={"branch": "new"},
                    config=checkpoint.CheckpointConfig(rollback=True))
    assert used == ([True] if exchange else [])
    assert read_json(root / "step_00000002")["extra"] == {"branch": "new"}
    assert checkpoint.latest(root) == str(root / "step_00000002")
    assert sorted(os.listdir(root)) == [".lock", "latest", "step_00000001", "step_00000002"]
    check_root(root)


def test_a_failed_rollback_save_changes_nothing(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    before = _branch(root, range(1, 4))
    monkeypatch.setattr(commit, "write_atomic", _fail)  # the manifest cannot be written
    with pytest.raises(checkpoint.CheckpointError, match="disk full"):
        checkpoint.save(root, *trained(2), step=2,
                        config=checkpoint.CheckpointConfig(rollback=True))
    monkeypatch.undo()
    assert {p.name: read_json(p)["checksum"] for p in commit.complete_steps(root)} == before
    assert checkpoint.latest(root) == str(root / "step_00000003")


def _fail(*args, **kwargs):
    raise OSError(28, "disk full")


def test_step_committed_by_another_job_during_the_save_is_refused(tmp_path: Path) -> None:
    """Only a step k that existed when the save began is replaced: one that another job
    committed meanwhile is kept, and this save fails."""
    root = tmp_path / "root"
    _branch(root, range(1, 2))
    staged = commit.begin(root, "step_00000002")
    try:
        other = _branch(root, range(2, 3))["step_00000002"]
        with pytest.raises(FileExistsError, match="already exists"):
            commit.commit(staged, "step_00000002", b"{}", None)
    finally:
        commit.abort(staged)
    assert read_json(root / "step_00000002")["checksum"] == other
    assert not any(n.startswith(".tmp-") for n in os.listdir(root))


def test_kill9_during_a_rollback_save(tmp_path: Path) -> None:
    """A rollback save of step 2 over steps 1-4 killed before each file-system call leaves
    one of: the old branch untouched (``latest`` on step 4); the new step 2 committed but
    the marker not yet moved (the old steps 3 and 4 still there); the new step 2 committed
    with ``latest`` on it, and once the abandoned steps are gone the fallback agrees."""
    pristine = tmp_path / "pristine"
    old = _branch(pristine, range(1, 5))
    kill_at, outcomes = 1, set()
    while True:
        root = tmp_path / f"root-{kill_at}"
        shutil.copytree(pristine, root)
        p = spawn_process(ranks.crash_at, str(root), 2, kill_at, True, True)
        p.join(60)
        assert p.exitcode in (0, -signal.SIGKILL), p.exitcode
        steps = {q.name: read_json(q)["checksum"] for q in check_root(root)}
        latest = checkpoint.latest(root)
        others = {k: v for k, v in steps.items() if k != "step_00000002"}
        if steps == old:
            assert latest == str(root / "step_00000004")
            outcomes.add("old branch")
        else:
            assert "step_00000002" in steps and others.items() <= old.items()
            check_state(str(root / "step_00000002"), 2)
            if latest == str(root / "step_00000004"):
                assert others == {k: v for k, v in old.items() if k != "step_00000002"}
                outcomes.add("new step, marker not moved")
            else:
                assert latest == str(root / "step_00000002")
                outcomes.add("new step")
                if others.keys() == {"step_00000001"}:
                    (root / "latest").unlink()
                    assert checkpoint.latest(root) == latest
        if p.exitcode == 0:
            break
        kill_at += 1
        shutil.rmtree(root)
        assert kill_at < 1000
    assert others == {"step_00000001": old["step_00000001"]}
    assert "old branch" in outcomes and "new step" in outcomes, outcomes
    print(f"\nkill points: {kill_at - 1} (+1 clean run), outcomes: {sorted(outcomes)}")
