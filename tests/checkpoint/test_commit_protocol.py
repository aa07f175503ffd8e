"""Fault injection for the commit protocol: stale and live temporary directories, the root
lock, retention, ``latest``, two jobs sharing a root, and SIGKILL at random moments and before
every file-system call of a save (what each shows: docs/reliability.md)."""

from __future__ import annotations

import collections
import fcntl
import os
import random
import signal
import time
from pathlib import Path

import pytest

from helpers.dist import run_distributed, spawn_process
from faults import ranks
from faults.common import check_root, check_state, trained
from shardopt import checkpoint
from shardopt.checkpoint import commit

def _step_of(path: str) -> int:
    return int(Path(path).name.removeprefix("step_"))

# ---------------------------------------------------------- commit protocol and locks
def test_stale_temporary_dirs_are_cleaned_live_ones_kept(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model, opt = trained(1)
    checkpoint.save(root, model, opt, step=1)
    stale = root / ".tmp-step_00000002-deadbeef"
    stale.mkdir()
    (stale / "model-00000.safetensors").write_bytes(b"half")
    (root / ".trash-step_00000000-1234").mkdir()
    (root / ".latest.abcd.tmp").write_text("step_00000002")
    live = root / ".tmp-step_00000003-cafe"  # another job's save in progress
    live.mkdir()
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert checkpoint.latest(root) == str(root / "step_00000001")
        checkpoint.save(root, model, opt, step=4)
        names = os.listdir(root)
        assert live.name in names
        assert not {stale.name, ".trash-step_00000000-1234", ".latest.abcd.tmp"} & set(names)
    finally:
        os.close(fd)
    checkpoint.save(root, model, opt, step=5)  # now nobody holds it: stale
    assert not any(n.startswith((".tmp-", ".trash-")) for n in os.listdir(root))


def test_held_root_lock_times_out_with_a_clear_error(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    model, opt = trained(1)
    checkpoint.save(root, model, opt, step=1)
    monkeypatch.setattr(commit, "LOCK_TIMEOUT_S", 0.3)
    with commit.RootLock(root):
        with pytest.raises(checkpoint.CheckpointError, match=r"\.lock has been held"):
            checkpoint.save(root, model, opt, step=2)
    assert not any(n.startswith(".tmp-") for n in os.listdir(root))


def test_a_directory_in_the_way_of_a_step_is_never_overwritten(tmp_path: Path) -> None:
    """Only committed checkpoints are replaced (by a rollback, test_rollback.py): a
    ``step_*`` directory without a manifest is someone else's and stays as it is."""
    root = tmp_path / "root"
    (root / "step_00000001").mkdir(parents=True)
    (root / "step_00000001" / "notes.txt").write_text("mine")
    with pytest.raises(checkpoint.CheckpointError, match="not a committed checkpoint"):
        checkpoint.save(root, *trained(1), step=1)
    assert os.listdir(root / "step_00000001") == ["notes.txt"]


def test_retention_never_deletes_the_newest_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for step in range(1, 6):
        checkpoint.save(root, *trained(step), step=step, keep_last=2)
    assert [p.name for p in commit.complete_steps(root)] == ["step_00000004", "step_00000005"]
    checkpoint.save(root, *trained(3), step=3, keep_last=5,
                    config=checkpoint.CheckpointConfig(rollback=True))  # 4, 5 abandoned
    assert [p.name for p in commit.complete_steps(root)] == ["step_00000003"]
    checkpoint.save(root, *trained(4), step=4, keep_last=1)
    assert [p.name for p in commit.complete_steps(root)] == ["step_00000004"]
    assert checkpoint.latest(root) == str(root / "step_00000004")


def test_latest_ignores_incomplete_and_garbage(tmp_path: Path) -> None:
    root = tmp_path / "root"
    checkpoint.save(root, *trained(1), step=1)
    (root / "step_00000009").mkdir()  # no manifest: not committed
    (root / ".tmp-step_00000010-x").mkdir()
    assert checkpoint.latest(root) == str(root / "step_00000001")
    for marker in ("step_00000009", "../../etc", "\x00\xff" * 500, ""):
        (root / "latest").write_text(marker, errors="surrogateescape")
        assert checkpoint.latest(root) == str(root / "step_00000001")
    (root / "latest").unlink()
    assert checkpoint.latest(root) == str(root / "step_00000001")


def test_two_jobs_saving_into_one_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    out = run_distributed(ranks.concurrent_job, 2, str(root), 6, backend=None,
                          tmp_path=tmp_path, timeout=120)
    winners = [r for r in out if 1000 in r["committed"]]
    losers = [r for r in out if r["refused"]]
    # Saves of the shared step that overlap: the later commit is refused; one that began
    # after the other committed replaces it (a rollback).
    assert len(winners) + len(losers) == 2 and len(winners) >= 1
    assert all("already exists" in r["refused"][0] for r in losers)
    assert [n for n in os.listdir(root) if n.startswith(".")] == [".lock"]
    steps = check_root(root)
    assert steps[-1].name == "step_00001000"
    for p in steps[:-1]:
        check_state(str(p), _step_of(str(p)))


# ---------------------------------------------------------------------------- kill -9
KILL_TRIALS = 30


def _wait_for_line(log: Path, word: str, procs: list, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and word in log.read_text():
            return
        if any(p.exitcode is not None for p in procs):
            raise AssertionError(f"a saver exited early with {[p.exitcode for p in procs]}")
        time.sleep(0.01)
    raise AssertionError(f"no {word!r} in {log} after {timeout} s")


@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
def test_kill9_at_random_moments(tmp_path: Path, blocking: bool) -> None:
    """2 ranks save in a loop (keep_last=2) and are SIGKILLed at a random moment (both ranks,
    or one rank in every third trial). After every trial the newest checkpoint is complete,
    verifies, and loads (at DP size 1) into exactly the state saved at that step. Async saves
    train a step while the save is written (fewer trials: the protocol is the same)."""
    rng = random.Random(20240611)
    root, width = tmp_path / "root", 256
    checkpoint.save(root, *trained(0, width=width), step=0,
                    config=checkpoint.CheckpointConfig(block_bytes=64 << 10))
    previous, first_step = 0, 1
    stats: collections.Counter[str] = collections.Counter()
    for trial in range(KILL_TRIALS if blocking else KILL_TRIALS // 2):
        log = tmp_path / f"log-{trial}"
        procs = [spawn_process(ranks.saver_loop, r, 2, str(root), str(tmp_path / f"store-{trial}"),
                        first_step, str(log), width, blocking) for r in range(2)]
        _wait_for_line(log, "begin", procs)
        time.sleep(rng.uniform(0.0, 0.4))
        if trial % 3 == 2:
            victim = rng.randrange(2)
            os.kill(procs[victim].pid, signal.SIGKILL)
            survivor = procs[1 - victim]
            # A survivor that waits for its dead peer without a socket to notice it raises at
            # the process group's 60 s timeout.
            survivor.join(90)
            assert survivor.exitcode == ranks.SAVER_RAISED, "the surviving rank did not raise"
            stats["one rank killed, survivor raised"] += 1
        else:
            for p in procs:
                os.kill(p.pid, signal.SIGKILL)
            stats["all ranks killed"] += 1
        for p in procs:
            p.join()
        lines = log.read_text().split("\n")
        begun = [int(x.split()[2]) for x in lines if " begin " in x]
        ended = {int(x.split()[2]) for x in lines if " end " in x}
        stats["killed mid-save" if begun[-1] not in ended else "killed between saves"] += 1
        stats["saves completed"] += len(ended)

        path = checkpoint.latest(root)
        assert path is not None
        step = _step_of(path)
        assert step >= previous
        stats["latest advanced"] += step > previous
        check_root(root)
        check_state(path, step, width)
        previous, first_step = step, max(begun) + 1
        # Each save cleans the stale directories of earlier killed saves: at most the last one.
        left = sum(n.startswith(".tmp-") for n in os.listdir(root))
        assert left <= 1, os.listdir(root)
        stats["left a temporary dir"] += left
    checkpoint.save(root, *trained(first_step, width=width), step=first_step)
    assert not any(n.startswith((".tmp-", ".trash-")) for n in os.listdir(root))
    print(f"\nkill -9 trials: {KILL_TRIALS}, {dict(stats)}")


@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
def test_kill9_before_every_file_system_call(tmp_path: Path, blocking: bool) -> None:
    """One process saves (keep_last=2) and SIGKILLs itself just before its k-th file-system
    call, for every k until a save runs to the end: every crash point of the protocol
    (async: those of the background thread too, while the process trains)."""
    root = tmp_path / "root"
    for step in (0, 1):
        checkpoint.save(root, *trained(step), step=step, keep_last=2,
                        config=checkpoint.CheckpointConfig(block_bytes=4096))
    previous, step, kill_at = 1, 2, 1
    stats: collections.Counter[str] = collections.Counter()
    while True:
        p = spawn_process(ranks.crash_at, str(root), step, kill_at, blocking)
        p.join(60)
        assert p.exitcode in (0, -signal.SIGKILL), p.exitcode
        path = checkpoint.latest(root)
        assert path is not None and _step_of(path) >= previous
        check_root(root)
        check_state(path, _step_of(path))
        stats["committed" if _step_of(path) == step else "previous kept"] += 1
        previous = _step_of(path)
        if p.exitcode == 0:
            break
        kill_at += 1
        step += 1
        assert kill_at < 1000
    assert not any(n.startswith((".tmp-", ".trash-")) for n in os.listdir(root))
    print(f"\nkill points: {kill_at - 1} (+1 clean run), {dict(stats)}")
