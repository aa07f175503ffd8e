"""Asynchronous saves (``checkpoint.save(..., blocking=False)``): the same checkpoint as a
synchronous save at the call although training goes on, the handle, errors that are never
lost, one save in flight at a time, crash safety, and ``load`` waiting for the save."""

from __future__ import annotations

import gc
import importlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.checks import (SHARED_SNAPSHOTS, checkpoint_bytes, model_state,
                            new_snapshot_buffers, snapshot_buffers, snapshot_bytes)
from helpers.dist import device_for, require_world_size, run_distributed
from helpers.models import build, train
from shardopt import checkpoint, pinned
from shardopt.checkpoint import CheckpointError, SaveHandle, background
from shardopt.checkpoint.drain import Copy, Drain
from shardopt.checkpoint.snapshot import Snapshot
from shardopt.checkpoint.storage import Job, WriteEntry

SAVE_MODULE = "shardopt.checkpoint.save"
TESTS = Path(__file__).resolve().parents[1]
SRC = str(TESTS.parent / "src")


def async_vs_sync_rank(rank: int, world_size: int, backend: str, root: str) -> dict[str, Any]:
    device = device_for(backend, rank)
    model, opt = build(0, device, dropout=0.1)
    torch.manual_seed(1000 + rank)
    train(model, opt, range(3), rank, world_size)
    at_call = model_state(model)
    sync_path = checkpoint.save(f"{root}/sync", model, opt, step=3, extra={"k": 1})
    handle = checkpoint.save(f"{root}/async", model, opt, step=3, extra={"k": 1}, blocking=False)
    assert isinstance(handle, SaveHandle)
    for group in opt.param_groups:  # a scheduler's change after the call is not saved
        group["lr"] *= 0.5
    train(model, opt, range(3, 6), rank, world_size)  # changes every saved tensor meanwhile
    async_path = handle.wait()
    assert handle.done() and handle.wait() == async_path  # wait() again: the same answer
    assert checkpoint.latest(f"{root}/async") == async_path
    after = model_state(model)
    info = checkpoint.load(async_path, model, opt)
    return {"sync": sync_path, "async": async_path, "at_call": at_call, "after": after,
            "loaded": model_state(model), "step": info.step}


@pytest.mark.parametrize("world_size", [1, 2, 3], ids=["dp1", "dp2", "dp3"])
def test_async_save_equals_sync_save_at_the_call(backend, world_size, tmp_path):
    """bf16 and fp32 params, a frozen param and a buffer: the async checkpoint's files are
    byte for byte those of a synchronous save at the same step, although the run took
    three more steps (at another learning rate) before it was written, and it loads the state
    at the call."""
    require_world_size(backend, world_size)
    results = run_distributed(async_vs_sync_rank, world_size, backend, str(tmp_path),
                              backend=backend, tmp_path=tmp_path)
    r = results[0]
    sync, asyn = checkpoint_bytes(Path(r["sync"])), checkpoint_bytes(Path(r["async"]))
    assert sorted(sync) == sorted(asyn)
    for name in sync:
        assert sync[name] == asyn[name], f"{name} differs"
    for r in results:
        assert r["step"] == 3
        assert any(not torch.equal(r["after"][k], v) for k, v in r["at_call"].items())
        for k, v in r["at_call"].items():
            assert torch.equal(r["loaded"][k], v), k


def failing_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Rank 1's background write fails: every rank's wait() raises the same error, nothing
    is committed, and the next save (both ranks) works."""
    from unittest import mock
    save_module = importlib.import_module(SAVE_MODULE)
    model, opt = build(0)
    train(model, opt, range(2), rank, world_size)

    def broken(path, *args, **kwargs):
        raise OSError(5, "I/O error (simulated)", path)

    with mock.patch.object(save_module, "write_rank_files",
                           broken if rank == 1 else save_module.write_rank_files):
        handle = checkpoint.save(root, model, opt, step=2, blocking=False)
        train(model, opt, range(2, 3), rank, world_size)  # training collectives meanwhile
        try:
            handle.wait()
            error = None
        except CheckpointError as e:
            error = str(e)
    latest_after_failure = checkpoint.latest(root)
    path = checkpoint.save(root, model, opt, step=3, blocking=False).wait()
    return {"error": error, "latest": latest_after_failure, "path": path}


def test_a_failed_background_write_on_one_rank_fails_every_rank(tmp_path):
    results = run_distributed(failing_rank, 2, str(tmp_path / "root"), tmp_path=tmp_path)
    for r in results:
        assert r["error"] is not None and "[dp rank 1]" in r["error"]
        assert "I/O error (simulated)" in r["error"]
        assert r["latest"] is None
        assert r["path"] == str(tmp_path / "root" / "step_00000003")


# ------------------------------------------------------------- single process

def _gate_writes(monkeypatch, gate: threading.Event, fail: bool = False) -> None:
    """Block the writes of a rank's files (by the writer process or by threads) until
    ``gate`` is set (then fail them with ``fail``)."""
    save_module = importlib.import_module(SAVE_MODULE)  # the module, not the function
    real = save_module.write_rank_files

    def gated(tmp, *args, **kwargs):
        if not gate.wait(60):
            raise AssertionError("the test never released the write")
        if fail:
            raise OSError(28, "No space left on device (simulated)", str(tmp))
        return real(tmp, *args, **kwargs)

    monkeypatch.setattr(save_module, "write_rank_files", gated)


def test_handle_returns_at_once_and_commits_later(trained_model, tmp_path, monkeypatch):
    model, opt = trained_model
    gate = threading.Event()
    _gate_writes(monkeypatch, gate)
    handle = checkpoint.save(tmp_path, model, opt, step=2, blocking=False)
    assert not handle.done()
    assert checkpoint.latest(tmp_path) is None  # not committed: never latest
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.05)
    gate.set()
    assert handle.wait() == str(tmp_path / "step_00000002") == checkpoint.latest(tmp_path)
    assert handle.done()


def test_blocking_false_with_a_config_and_bad_values(trained_model, tmp_path):
    model, opt = trained_model
    handle = checkpoint.save(tmp_path, model, opt, step=2, blocking=False,
                             config=checkpoint.CheckpointConfig(if_busy="error"))
    assert handle.wait() == checkpoint.latest(tmp_path)
    with pytest.raises(CheckpointError, match="blocking must be a bool, got 'no'"):
        checkpoint.save(tmp_path, model, opt, step=3, blocking="no")
    assert checkpoint.latest(tmp_path) == handle.wait()
    for bad in ({"if_busy": "skip"}, {"snapshot": "disk"}):
        with pytest.raises(CheckpointError, match=next(iter(bad))):
            checkpoint.CheckpointConfig(**bad)


def test_failed_background_save_raises_at_wait(trained_model, tmp_path, monkeypatch):
    model, opt = trained_model
    checkpoint.save(tmp_path, model, opt, step=1)
    gate = threading.Event()
    gate.set()
    _gate_writes(monkeypatch, gate, fail=True)
    handle = checkpoint.save(tmp_path, model, opt, step=2, blocking=False)
    with pytest.raises(CheckpointError, match="No space left"):
        handle.wait()
    assert checkpoint.latest(tmp_path) == str(tmp_path / "step_00000001")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    monkeypatch.undo()
    assert checkpoint.save(tmp_path, model, opt, step=3) == checkpoint.latest(tmp_path)


def test_failed_background_save_fails_the_next_save_once(trained_model, tmp_path,
                                                         monkeypatch):
    model, opt = trained_model
    gate = threading.Event()
    gate.set()
    _gate_writes(monkeypatch, gate, fail=True)
    handle = checkpoint.save(tmp_path, model, opt, step=2, blocking=False)
    while not handle.done():  # nobody calls wait()
        time.sleep(0.01)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="saving step 2 .*No space left"):
        checkpoint.save(tmp_path, model, opt, step=3)
    assert checkpoint.latest(tmp_path) is None  # the failed save changed nothing
    assert checkpoint.save(tmp_path, model, opt, step=3) == checkpoint.latest(tmp_path)


def test_second_save_waits_or_errors_while_one_is_in_flight(trained_model, tmp_path,
                                                            monkeypatch):
    model, opt = trained_model
    gate = threading.Event()
    _gate_writes(monkeypatch, gate)
    first = checkpoint.save(tmp_path, model, opt, step=2, blocking=False)
    with pytest.raises(CheckpointError, match="still in flight"):
        checkpoint.save(tmp_path, model, opt, step=3,
                        config=checkpoint.CheckpointConfig(if_busy="error"))
    assert not first.done() and checkpoint.latest(tmp_path) is None
    threading.Timer(0.2, gate.set).start()
    second = checkpoint.save(tmp_path, model, opt, step=3, blocking=False)  # waits for first
    assert first.done()
    assert first.wait() == str(tmp_path / "step_00000002")
    assert second.wait() == checkpoint.latest(tmp_path) == str(tmp_path / "step_00000003")


def test_load_waits_for_the_save_in_flight(trained_model, tmp_path, monkeypatch):
    model, opt = trained_model
    gate = threading.Event()
    _gate_writes(monkeypatch, gate)
    saved = model_state(model)
    handle = checkpoint.save(tmp_path, model, opt, step=2, blocking=False)
    train(model, opt, range(2, 4), 0, 1)
    threading.Timer(0.2, gate.set).start()
    info = checkpoint.load(tmp_path, model, opt)  # latest exists only once the save is done
    assert handle.done() and info.step == 2
    for k, v in saved.items():
        assert torch.equal(model.state_dict()[k], v), k


def test_snapshot_is_a_copy_that_offload_cannot_touch(trained_model, tmp_path, monkeypatch):
    """offload() right after the call (on CPU it fills the live state with NaN) and a step
    after onload(): the background write still gets the state at the call."""
    model, opt = trained_model
    reference = checkpoint.save(tmp_path / "sync", model, opt, step=2)
    gate = threading.Event()
    _gate_writes(monkeypatch, gate)
    handle = checkpoint.save(tmp_path / "async", model, opt, step=2, blocking=False)
    opt.offload()
    opt.onload()
    train(model, opt, range(2, 3), 0, 1)
    gate.set()
    got, want = checkpoint_bytes(Path(handle.wait())), checkpoint_bytes(Path(reference))
    assert got == want


@SHARED_SNAPSHOTS
def test_one_snapshot_of_exactly_the_state_reused_across_saves(trained_model, tmp_path):
    model, opt = trained_model
    gc.collect()  # earlier tests' optimizers and their buffers
    known = snapshot_buffers()
    checkpoint.save(tmp_path, model, opt, step=2, blocking=False).wait()
    buffers = new_snapshot_buffers(known)
    assert sum(buffers.values()) == snapshot_bytes(model, opt)
    train(model, opt, range(2, 3), 0, 1)
    checkpoint.save(tmp_path, model, opt, step=3, blocking=False).wait()
    assert new_snapshot_buffers(known) == buffers  # the same buffers


@pytest.mark.cuda
def test_a_host_snapshot_is_page_locked_by_its_first_drain_and_reused(tmp_path):
    """On a GPU the first save's drain page-locks host buffers of exactly the snapshot's
    size, the next save reuses them, and its checkpoint is a blocking save's."""
    model, opt = build(0, "cuda")
    train(model, opt, range(2), 0, 1)
    snap = background.of(opt).snapshot
    checkpoint.save(tmp_path / "host", model, opt, step=2, blocking=False).wait()
    assert snap.host_nbytes() == snapshot_bytes(model, opt)
    host = {b.tensor.data_ptr() for b in snap.host_buffers()}
    assert all(b.pinned for b in snap.host_buffers())
    train(model, opt, range(2, 3), 0, 1)
    again = checkpoint.save(tmp_path / "host", model, opt, step=3, blocking=False).wait()
    assert {b.tensor.data_ptr() for b in snap.host_buffers()} == host
    reference = checkpoint.save(tmp_path / "sync", model, opt, step=3)
    assert checkpoint_bytes(Path(reference)) == checkpoint_bytes(Path(again))


@pytest.mark.cuda
def test_offload_during_a_background_save_leaves_nothing_of_it_on_the_gpu(tmp_path):
    """A step (which copies what the drain has not read into spare GPU memory) and
    ``offload()`` while a save drains in small pieces: after ``offload()`` the GPU holds what
    an offload without a save leaves, and the checkpoint is a blocking save's at the call."""
    model, opt = build(0, "cuda")
    train(model, opt, range(2), 0, 1)
    opt.offload()
    bare = torch.cuda.memory_allocated()
    opt.onload()
    reference = checkpoint.save(tmp_path / "sync", model, opt, step=2)
    handle = checkpoint.save(tmp_path / "async", model, opt, step=2, blocking=False,
                             config=checkpoint.CheckpointConfig(drain_piece_bytes=4096))
    train(model, opt, range(2, 3), 0, 1)
    opt.offload()
    assert torch.cuda.memory_allocated() == bare
    opt.onload()
    assert checkpoint_bytes(Path(handle.wait())) == checkpoint_bytes(Path(reference))


class _NormedLinear(torch.nn.Module):
    """A bf16 Linear big enough that its state's copies take milliseconds, then a BatchNorm
    whose running statistics every forward in training mode updates in place."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(n, n).to(torch.bfloat16)
        self.bn = torch.nn.BatchNorm1d(n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x).float()).square().mean()


@pytest.mark.cuda
def test_buffers_a_forward_updates_right_after_the_call_are_saved_as_at_the_call(tmp_path):
    """A forward right after an asynchronous save's call updates BatchNorm's running
    statistics in place while the state's copies still run on their side stream: the
    checkpoint must hold them as they were at the call (their copies go first, and the
    training stream waits for those only)."""
    from shardopt import DistributedOptimizer, OptimizerConfig
    torch.manual_seed(0)
    model = _NormedLinear(8192).cuda()
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-3))
    x = torch.randn(64, 8192, device="cuda", dtype=torch.bfloat16)
    for step in range(1, 4):
        model(x).backward()
        opt.step()
        opt.zero_grad()
        at_call = {k: v.clone() for k, v in model.bn.state_dict().items()}
        handle = checkpoint.save(tmp_path, model, opt, step=step, blocking=False)
        model(x).backward()  # updates the running statistics at once
        path = handle.wait()
        opt.zero_grad()
        assert not torch.equal(model.bn.running_mean, at_call["running_mean"])
        fresh = _NormedLinear(8192).cuda()
        checkpoint.load(path, fresh, DistributedOptimizer(fresh, OptimizerConfig(lr=1e-3)))
        for k, v in fresh.bn.state_dict().items():
            assert torch.equal(v, at_call[k]), (step, k)


@SHARED_SNAPSHOTS
def test_repeated_saves_reuse_the_snapshot_and_follow_the_state(trained_model, tmp_path):
    """After the first save, saves repeat its copies into the same host buffers from wherever
    the state lives now: after a step, while offloaded (host copies), after a load (new
    moment tensors); a frozen buffer more takes a new snapshot of the new size (a new
    plan). Each checkpoint equals a synchronous save of the same state."""
    model, opt = trained_model
    gc.collect()
    known = snapshot_buffers()

    def both(step):
        sync = checkpoint.save(tmp_path / "sync", model, opt, step=step)
        handle = checkpoint.save(tmp_path / "async", model, opt, step=step, blocking=False)
        assert checkpoint_bytes(Path(handle.wait())) == checkpoint_bytes(Path(sync))

    both(2)
    buffers = new_snapshot_buffers(known)
    assert buffers
    train(model, opt, range(2, 3), 0, 1)
    both(3)
    opt.offload()
    both(4)
    opt.onload()
    checkpoint.load(tmp_path / "sync", model, opt)  # moments replaced by loaded ones
    train(model, opt, range(4, 5), 0, 1)
    both(5)
    assert new_snapshot_buffers(known) == buffers  # one snapshot, its copies repeated
    model.register_buffer("spare", torch.arange(7.0))  # a frozen tensor more: a new plan
    both(6)
    replanned = new_snapshot_buffers(known)
    assert not replanned.keys() & buffers.keys()
    assert sum(replanned.values()) == sum(buffers.values()) + 7 * 4


def test_a_buffer_that_stops_sharing_storage_gets_a_new_plan(trained_model, tmp_path):
    """Two frozen buffers viewing one storage are copied once; when one of them is given a
    tensor of its own (same size), the next save must not copy it from the old storage."""
    model, opt = trained_model
    shared = torch.arange(6.0)
    model.register_buffer("mirror_a", shared)
    model.register_buffer("mirror_b", shared.view(2, 3))

    def both(step):
        sync = checkpoint.save(tmp_path / "sync", model, opt, step=step)
        handle = checkpoint.save(tmp_path / "async", model, opt, step=step, blocking=False)
        assert checkpoint_bytes(Path(handle.wait())) == checkpoint_bytes(Path(sync))

    both(2)
    model.mirror_b = torch.full((2, 3), 7.0)  # its own storage now, the same size
    both(3)


@SHARED_SNAPSHOTS
def test_snapshot_copies_runs_of_adjacent_elements_and_nothing_between(trained_model, tmp_path):
    """Frozen buffers that are adjacent and overlapping views of one storage are copied as
    one run; a gap is not copied and another storage is a run of its own; each buffer is
    saved as its own elements at the call, whatever is written into the storage after it."""
    model, opt = trained_model
    gc.collect()
    known = snapshot_buffers()
    k = 1024
    checkpoint.save(tmp_path / "first", model, opt, step=1, blocking=False).wait()
    before = sum(new_snapshot_buffers(known).values())
    base = torch.arange(40 * k, dtype=torch.float32)
    other = torch.arange(100 * k, 110 * k, dtype=torch.float32)
    views = [base[0:10 * k], base[10 * k:16 * k], base[12 * k:20 * k], base[30 * k:40 * k],
             other[2 * k:5 * k]]
    for i, v in enumerate(views):
        model.register_buffer(f"view{i}", v)
    sync = checkpoint.save(tmp_path / "sync", model, opt, step=2)
    handle = checkpoint.save(tmp_path / "async", model, opt, step=2, blocking=False)
    base.zero_()  # after the call: the checkpoint holds the elements as they were
    other.zero_()
    assert checkpoint_bytes(Path(handle.wait())) == checkpoint_bytes(Path(sync))
    grown = sum(new_snapshot_buffers(known).values()) - before
    assert grown == (20 + 10 + 3) * k * 4  # [0, 20), [30, 40) of base, 3 k of other; no gap


def _segmented_copies(monkeypatch) -> tuple[list[Copy], list[torch.Tensor]]:
    """Copies into a host buffer of 96-byte page-locking segments: two sources whose
    destinations start mid-segment and end mid-segment."""
    monkeypatch.setattr(pinned, "SEGMENT_BYTES", 96)
    into = pinned.PinnedBuffer(512, torch.uint8, lock=False)
    srcs = [torch.arange(50, dtype=torch.float32), torch.arange(30, dtype=torch.float64)]
    copies, at = [], 4
    for src in srcs:
        n = src.numel() * src.element_size()
        copies.append(Copy(into.tensor[at:at + n], src.view(torch.uint8), into))
        at += n + 4
    return copies, srcs


@pytest.mark.parametrize("limit", [40, None], ids=["paced", "at_once"])
def test_pieces_are_at_most_the_limit_and_never_cross_a_segment(monkeypatch, limit):
    """The drain's pieces (``drain_piece_bytes`` at a time) and those issued at once (the
    copies taken at the call without spare memory, the rest at ``offload()``): at most the
    limit, none across a page-locking segment of the host buffer, each byte once, in order;
    ``end`` is where the piece ends in the buffer."""
    copies, _ = _segmented_copies(monkeypatch)
    for c in copies:
        base, offset = c.dst.data_ptr() - c.into.tensor.data_ptr(), 0
        while offset < c.dst.numel():
            p = c.piece(offset, limit)
            at = base + offset
            assert 0 < p.nbytes <= (limit or p.nbytes) and p.end == at + p.nbytes
            assert at // 96 == (p.end - 1) // 96
            assert limit is not None or p.end % 96 == 0 or offset + p.nbytes == c.dst.numel()
            offset += p.nbytes


def test_the_drain_and_a_copy_issued_at_once_fill_the_snapshot(monkeypatch):
    """The drain in pieces of 40 bytes and ``issue_now`` fill every destination with its
    source's bytes."""
    for issue_now in (False, True):
        copies, srcs = _segmented_copies(monkeypatch)
        drain = Drain(copies, torch.device("cpu"), None, lambda: None, 40, 1)
        if issue_now:
            drain.issue_now(len(copies))
        drain.run()
        for c, src in zip(copies, srcs):
            assert torch.equal(c.dst.view(src.dtype), src)


def test_offload_during_the_drain_finishes_the_copy_first(trained_model):
    """``offload()`` while the drain has issued nothing (before and after a step took the
    rest into spare memory): the hook issues every copy into the snapshot before the state
    leaves (on CPU offload fills it with NaN) and removes itself; the snapshot is the state
    at the call, with the drain not yet run."""
    model, opt = trained_model
    for step_first in (False, True):
        sources = opt.shard_state.sources()
        at_call = {name: t.clone() for name, t in sources.items()}
        dst = {name: torch.empty_like(t) for name, t in sources.items()}
        drain = Drain([Copy(dst[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
                       for n, t in sources.items()], torch.device("cpu"), None, lambda: None,
                      64, 1)
        drain.attach(opt)
        if step_first:
            train(model, opt, range(2, 3), 0, 1)
        opt.offload()
        for name, t in at_call.items():
            assert torch.equal(dst[name], t), (step_first, name)
        opt.onload()
        drain.run()  # nothing left to copy from the state as it is now
        for name, t in at_call.items():
            assert torch.equal(dst[name], t), (step_first, name)


# ----------------------------------------------------------- other processes
_CHILD = textwrap.dedent("""
    import sys, time
    sys.path[:0] = [{tests!r}, {src!r}]
    from shardopt import checkpoint
    import importlib
    save_module = importlib.import_module("shardopt.checkpoint.save")
    from helpers.models import build, train
    model, opt = build(0)
    train(model, opt, range(2), 0, 1)
    checkpoint.save({root!r}, model, opt, step=1)
    background = importlib.import_module("shardopt.checkpoint.background")
    real = save_module.write_rank_files
    def write_files(tmp, *args, **kwargs):
        out = real(tmp, *args, **kwargs)
        pid = background.of(opt).writer.pid
        sys.stdout.write(f"wrote {{tmp}} writer {{pid}}\\n")
        sys.stdout.flush()
        {after_write}
        return out
    save_module.write_rank_files = write_files
    handle = checkpoint.save({root!r}, model, opt, step=2, blocking=False)
    train(model, opt, range(2, 4), 0, 1)
    sys.stdout.write(f"trained; save done: {{handle.done()}}\\n"); sys.stdout.flush()
""")


def _child(root: Path, after_write: str) -> subprocess.Popen:
    code = _CHILD.format(tests=str(TESTS), src=SRC, root=str(root),
                         after_write=after_write)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_kill9_during_background_write_keeps_latest(tmp_path):
    """The process is SIGKILLed while its background thread writes the data files: latest
    stays at the previous commit, which loads; the next save cleans the leftovers."""
    root = tmp_path / "root"
    p = _child(root, "time.sleep(600)")
    deadline = time.monotonic() + 120
    while "wrote" not in (line := p.stdout.readline()):
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()
    writer = line.split()[-1]
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    if writer != "None":  # the writer process dies with it
        assert _gone(int(writer), deadline=time.monotonic() + 10)
    assert checkpoint.latest(root) == str(root / "step_00000001")
    assert [n for n in os.listdir(root) if n.startswith(".tmp-step_00000002")]
    model, opt = build(1)
    assert checkpoint.load(root, model, opt).step == 1
    checkpoint.save(root, model, opt, step=2)
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]


def _gone(pid: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_failure_nobody_waited_for_is_logged_at_exit(tmp_path):
    root = tmp_path / "root"
    p = _child(root, "raise OSError(5, 'I/O error (simulated)')")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "asynchronous checkpoint save failed" in err and "I/O error (simulated)" in err
    assert checkpoint.latest(root) == str(root / "step_00000001")


def test_save_in_flight_when_the_script_ends_is_committed(tmp_path):
    """The script ends while its background write is still going (each file takes three
    seconds): the interpreter waits for it and it commits."""
    root = tmp_path / "root"
    p = _child(root, "time.sleep(3)")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "trained; save done: False" in out, out  # the script ended first
    assert "failed" not in err, err
    assert checkpoint.latest(root) == str(root / "step_00000002")
    model, opt = build(1)
    assert checkpoint.load(root, model, opt).step == 2


def test_copies_of_storages_a_forward_may_write_are_taken_at_the_call():
    """The copies of ``hot`` storages (module buffers, which a forward updates in place) are
    taken before the call returns; the state's are the drain's (the state-write hook keeps
    the state from changing before it has them)."""
    state, buffer = torch.arange(10.0), torch.arange(4.0)
    entries = [WriteEntry("state", torch.float32, 10, 0, state),
               WriteEntry("buffer", torch.float32, 2, 0, buffer[2:])]
    snap = Snapshot(torch.device("cpu"), False, lambda buf: None)
    taken = snap.take([Job("f", entries)], checkpoint.CheckpointConfig(),
                      hot={buffer.untyped_storage().data_ptr()})
    state.add_(100)  # no hook here: the drain copies what it finds
    buffer.add_(100)
    taken.drain.run()
    got = {e.key: e.source for e in taken.jobs[0].entries}
    assert torch.equal(got["buffer"], torch.tensor([2.0, 3.0]))
    assert torch.equal(got["state"], torch.arange(10.0) + 100)
