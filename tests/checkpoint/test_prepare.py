"""``checkpoint.prepare``: the host snapshot of asynchronous saves allocated ahead of the first
save, sized for the state after the first step, used by that save, allocated once, replaced
when the sizes change, and all or nothing when memory runs out."""

from __future__ import annotations

import gc
import logging
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.checks import (SHARED_SNAPSHOTS, checkpoint_bytes, new_snapshot_buffers,
                            snapshot_buffers, snapshot_bytes)
from helpers.dist import run_distributed
from helpers.models import MixedLM, build, make_config, param_groups, train
from shardopt import DistributedOptimizer, checkpoint, pinned
from shardopt.checkpoint import CheckpointError, background

MOMENTS = {"fp32": {}, "bf16-int8": {"exp_avg_dtype": torch.bfloat16,
                                     "exp_avg_sq_dtype": "int8"}}


def _fresh(moments: str = "fp32") -> tuple[MixedLM, DistributedOptimizer]:
    """The checkpoint tests' model and an optimizer that has not stepped (no moments yet)."""
    torch.manual_seed(0)
    model = MixedLM()
    return model, DistributedOptimizer(model, make_config(**MOMENTS[moments]),
                                       param_group_fn=param_groups)


def _both(root: Path, model, opt, step: int) -> None:
    """A blocking and an asynchronous save of the same state hold the same bytes."""
    sync = checkpoint.save(root / "sync", model, opt, step=step)
    handle = checkpoint.save(root / "async", model, opt, step=step, blocking=False)
    assert checkpoint_bytes(Path(handle.wait())) == checkpoint_bytes(Path(sync))


@SHARED_SNAPSHOTS
@pytest.mark.parametrize("moments", sorted(MOMENTS))
def test_prepare_before_the_first_step_holds_what_the_first_save_uses(moments, tmp_path):
    """Prepared before the moments exist, the buffers are those of the state after the first
    step: the first asynchronous save after it allocates nothing and writes the bytes of a
    blocking save, and so does the next."""
    model, opt = _fresh(moments)
    gc.collect()  # earlier tests' optimizers and their buffers
    known = snapshot_buffers()
    assert not opt.shard_state.has_moments
    checkpoint.prepare(model, opt)
    prepared = new_snapshot_buffers(known)
    assert prepared
    train(model, opt, range(2), 0, 1)
    if moments == "fp32":
        assert sum(prepared.values()) == snapshot_bytes(model, opt)
    _both(tmp_path, model, opt, 2)
    assert new_snapshot_buffers(known) == prepared  # the same buffers, nothing more
    train(model, opt, range(2, 3), 0, 1)
    _both(tmp_path, model, opt, 3)
    assert new_snapshot_buffers(known) == prepared


@pytest.mark.parametrize("moments", sorted(MOMENTS))
def test_prepare_after_a_step_plans_copies_that_later_steps_do_not_stale(moments, tmp_path):
    """Prepared after the first step (its copies planned from the state then), the saves
    after two more steps and after a frozen tensor changes hold the bytes of blocking saves
    of the state at their calls."""
    model, opt = _fresh(moments)
    train(model, opt, range(1), 0, 1)
    checkpoint.prepare(model, opt)
    train(model, opt, range(1, 3), 0, 1)
    _both(tmp_path, model, opt, 3)
    with torch.no_grad():
        for t in model.buffers():
            t.add_(1)
    train(model, opt, range(3, 4), 0, 1)
    _both(tmp_path, model, opt, 4)


def test_prepare_twice_allocates_once(tmp_path, monkeypatch):
    """A second prepare, and one after a save into the prepared buffers, allocate nothing."""
    made = []
    real = pinned.PinnedBuffer

    def counted(*args, **kwargs):
        made.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(pinned, "PinnedBuffer", counted)
    model, opt = _fresh()
    checkpoint.prepare(model, opt)
    first = len(made)
    assert first > 0
    checkpoint.prepare(model, opt)
    assert len(made) == first
    train(model, opt, range(1), 0, 1)
    checkpoint.save(tmp_path, model, opt, step=1, blocking=False).wait()
    checkpoint.prepare(model, opt)
    assert len(made) == first


@SHARED_SNAPSHOTS
def test_sizes_that_change_after_prepare_are_planned_anew_and_said_once(tmp_path, caplog):
    """A frozen tensor added after prepare: the save allocates a snapshot of the new size
    (logged once at INFO), frees the prepared one, and still writes the blocking save's
    bytes; the next save reuses the new snapshot without a word."""
    model, opt = _fresh()
    gc.collect()
    known = snapshot_buffers()
    checkpoint.prepare(model, opt)
    prepared = new_snapshot_buffers(known)
    train(model, opt, range(2), 0, 1)
    model.register_buffer("spare", torch.arange(7.0))
    with caplog.at_level(logging.INFO, logger="shardopt.checkpoint"):
        _both(tmp_path, model, opt, 2)
        replanned = new_snapshot_buffers(known)
        assert not replanned.keys() & prepared.keys()
        assert sum(replanned.values()) == sum(prepared.values()) + 7 * 4
        train(model, opt, range(2, 3), 0, 1)
        _both(tmp_path, model, opt, 3)
        assert new_snapshot_buffers(known) == replanned
    said = [r for r in caplog.records if "checkpoint.prepare" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO


@SHARED_SNAPSHOTS
def test_a_prepare_out_of_host_memory_fails_cleanly(tmp_path, monkeypatch):
    """The second buffer's allocation fails: a CheckpointError naming the rank and the bytes,
    no buffer left (the first one freed), and a later save works as without prepare."""
    made: list[weakref.ref] = []
    real = pinned.PinnedBuffer

    def failing(*args, **kwargs):
        if made:
            raise RuntimeError("cannot allocate memory (simulated)")
        buf = real(*args, **kwargs)
        made.append(weakref.ref(buf))
        return buf

    model, opt = _fresh()
    train(model, opt, range(1), 0, 1)
    gc.collect()
    known = snapshot_buffers()
    monkeypatch.setattr(pinned, "PinnedBuffer", failing)
    with pytest.raises(CheckpointError,
                       match=rf"\[dp rank 0\].* {snapshot_bytes(model, opt)} bytes .*simulated"):
        checkpoint.prepare(model, opt)
    assert made and (made[0]() is None or made[0]().fd is None)
    assert not new_snapshot_buffers(known)
    snap = background.of(opt).snapshot
    assert snap.host_nbytes() == 0 and not snap.host_buffers()
    monkeypatch.setattr(pinned, "PinnedBuffer", real)
    _both(tmp_path, model, opt, 1)


def prepare_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Each rank prepares its own snapshot (no collective) before the first step; the first
    save after it uses it."""
    model, opt = build(0)
    known = snapshot_buffers()
    checkpoint.prepare(model, opt)
    prepared = new_snapshot_buffers(known)
    train(model, opt, range(2), rank, world_size)
    sync = checkpoint.save(f"{root}/sync", model, opt, step=2)
    asyn = checkpoint.save(f"{root}/async", model, opt, step=2, blocking=False).wait()
    return {"sync": sync, "async": asyn, "expected": snapshot_bytes(model, opt),
            "prepared": sum(prepared.values()), "reused": new_snapshot_buffers(known) == prepared}


@SHARED_SNAPSHOTS
def test_each_rank_prepares_its_own_shard(tmp_path):
    results = run_distributed(prepare_rank, 2, str(tmp_path), tmp_path=tmp_path)
    for r in results:
        assert r["reused"] and r["prepared"] == r["expected"]
    r = results[0]
    assert checkpoint_bytes(Path(r["async"])) == checkpoint_bytes(Path(r["sync"]))


@pytest.mark.cuda
def test_a_prepared_snapshot_is_page_locked_and_the_save_locks_nothing(tmp_path, monkeypatch):
    """On a GPU, prepare page-locks the whole host copy the first save uses; that save
    registers no host memory."""
    model, opt = build(0, "cuda")
    checkpoint.prepare(model, opt)
    snap = background.of(opt).snapshot
    held = snap.host_buffers()
    assert held and all(b.pinned for b in held)
    train(model, opt, range(2), 0, 1)
    reference = checkpoint.save(tmp_path / "sync", model, opt, step=2)
    runtime, registered = torch.cuda.cudart(), []

    class Counting:  # torch's CUDA runtime, counting the calls that page-lock host memory
        def __getattr__(self, name):
            if name == "cudaHostRegister":
                return lambda *args: registered.append(args) or runtime.cudaHostRegister(*args)
            return getattr(runtime, name)

    monkeypatch.setattr(torch.cuda, "cudart", Counting)
    got = checkpoint.save(tmp_path / "async", model, opt, step=2, blocking=False).wait()
    assert not registered
    assert {id(b) for b in held} <= {id(b) for b in snap.host_buffers()}
    assert checkpoint_bytes(Path(got)) == checkpoint_bytes(Path(reference))
