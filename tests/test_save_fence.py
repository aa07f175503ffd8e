"""The step after an asynchronous save waits for the save's copies bucket by bucket
(``shardopt.checkpoint.snapshot.SaveFence``): what it waits for, in which order, that the
cut step is the uncut one bit for bit, and on a GPU that the waits are what keeps the
checkpoint intact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardopt import checkpoint
from test_async_save import _checkpoint_bytes


class _RecordingFence:
    """Stands in for an asynchronous save's :class:`~shardopt.checkpoint.snapshot.SaveFence`:
    records the regions ``step()`` says it is about to write, never done."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[int, int, int]]] = []
        self.waited_all = 0

    def wait_for(self, regions) -> None:
        self.calls.append([(t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size(),
                            (t.storage_offset() + t.numel()) * t.element_size()) for t in regions])

    def wait_all(self, host: bool) -> None:
        self.waited_all += 1

    def finished(self) -> bool:
        return self.done

    waited = False
    done = False


def _fenced_against_plain(make, drop=None):
    """Three Triton steps of ``make()``'s (model, optimizer) twice, the last with a
    :class:`_RecordingFence` set in the second run (and ``drop(model)`` before it in both);
    asserts both end bit for bit alike; returns the second run's model, optimizer, fence."""
    runs = []
    for fenced in (False, True):
        model, opt = make()
        fence = _RecordingFence()
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            if step == 2:
                if drop is not None:
                    drop(model)
                if fenced:
                    opt.set_save_fence(fence)
            opt.step()
        runs.append((model, opt, fence))
    (model_a, opt_a, _), (model_b, opt_b, fence) = runs
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
    state_a, state_b = opt_a.state_sources(), opt_b.state_sources()
    assert state_a.keys() == state_b.keys()
    for name, t in state_a.items():
        assert torch.equal(t, state_b[name]), name
    return model_b, opt_b, fence


def test_a_step_that_updates_part_of_a_group_waits_bucket_by_bucket_too():
    """A param without a gradient splits its group into subset launches; with a save's
    copies pending those are cut per bucket as well, waits in bucket order, and the result
    is bit for bit that of the same step without the fence."""
    from shardopt import kernels as kernels_
    if not kernels_.available(torch.device("cpu")):
        pytest.skip("no Triton interpreter here")
    from shardopt import DistributedOptimizer, OptimizerConfig

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 24))
        return model, DistributedOptimizer(model, OptimizerConfig(
            lr=1e-2, bucket_numel=300, align_numel=4, step_kernel="triton"))

    def drop(model):
        model[0].bias.grad = None  # not updated this step: the group is split

    _, opt_b, fence = _fenced_against_plain(make, drop)
    assert fence.waited_all == 0 and len(fence.calls) > 1
    layout = opt_b.layout
    order = [(bi, b) for bi, buf in enumerate(layout.buffers) for b in range(len(buf.buckets))]
    waited = [next(k for k in order if call == [
        (t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size(),
         (t.storage_offset() + t.numel()) * t.element_size())
        for t in opt_b._update._bucket_state(*k)]) for call in fence.calls]
    assert waited == sorted(waited) and len(set(waited)) == len(waited)


@pytest.mark.parametrize("moments", ["float32", "int8"])
def test_step_after_async_save_waits_bucket_by_bucket_for_what_it_writes(moments):
    """With a save's copies pending, the Triton step is cut into one launch per bucket, each
    preceded by a wait for exactly that bucket's state (param shard, main params, moments and
    their scales), in bucket order; the result is bit for bit that of an uncut step."""
    from shardopt import kernels as kernels_
    if not kernels_.available(torch.device("cpu")):
        pytest.skip("no Triton interpreter here")
    from shardopt import DistributedOptimizer, OptimizerConfig

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 24).bfloat16())
        cfg = OptimizerConfig(lr=1e-2, bucket_numel=300, align_numel=4, step_kernel="triton",
                              max_grad_norm=1.0, exp_avg_dtype=getattr(torch, moments),
                              exp_avg_sq_dtype=getattr(torch, moments))
        return model, DistributedOptimizer(model, cfg)

    model_b, opt_b, fence = _fenced_against_plain(make)
    assert fence.waited_all == 0
    layout, rank = opt_b.layout, opt_b.dp.rank
    buckets = [(bi, b) for bi, buf in enumerate(layout.buffers) for b in range(len(buf.buckets))]
    assert len(buckets) > 3 and len(fence.calls) == len(buckets)
    for (bi, b), call in zip(buckets, fence.calls):
        buf = layout.buffers[bi]
        want = [opt_b._update._bucket_state(bi, b)]
        assert call == [(t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size(),
                         (t.storage_offset() + t.numel()) * t.element_size()) for t in want[0]]
        size = buf.buckets[b].shard_numel * torch.tensor([], dtype=buf.dtype).element_size()
        assert call[0][2] - call[0][1] == size  # the bucket's own shard of the param buffer
    # Copies that have run cost the next step nothing: no waits, one launch per group, and
    # the fence is forgotten.
    fence.done, calls = True, len(fence.calls)
    opt_b.set_save_fence(fence)
    assert not opt_b.save_copies_pending and opt_b._save_fence is None
    for p in model_b.parameters():
        p.grad = torch.ones_like(p)
    opt_b.step()
    assert len(fence.calls) == calls
    # Together the waits cover every byte of state the step writes.
    state = opt_b.state_sources()
    for name, t in state.items():
        if name.startswith("params."):
            continue  # the other ranks' shards: none at DP 1
        ptr, lo = t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size()
        hi = lo + t.numel() * t.element_size()
        spans = sorted((a, z) for call in fence.calls for p, a, z in call if p == ptr)
        at = lo
        for a, z in spans:
            assert a <= at, name
            at = max(at, z)
        assert at >= hi, name


@pytest.mark.cuda
@pytest.mark.parametrize("waits", [True, False], ids=["bucket_waits", "control_without_waits"])
def test_step_right_after_an_async_save_never_overwrites_what_it_still_copies(tmp_path,
                                                                                monkeypatch,
                                                                                waits):
    """A state of ~1 GB whose host copies take far longer than a step, saved asynchronously in
    4 MiB pieces and stepped at once, twice: the checkpoint holds the state at the call. The
    control, with the step's waits removed, shows the race is real: its checkpoint differs."""
    from shardopt import DistributedOptimizer, OptimizerConfig
    from shardopt.checkpoint import snapshot as snapshot_module
    monkeypatch.setattr(snapshot_module, "FENCE_PIECE_BYTES", 4 << 20)
    if not waits:
        monkeypatch.setattr(snapshot_module.SaveFence, "wait_for", lambda self, regions: None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(20)]
                                ).cuda()
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-2, bucket_numel=8 << 20))

    def grads():
        for p in model.parameters():
            p.grad = torch.randn_like(p)

    grads()
    opt.step()
    sync = checkpoint.save(tmp_path / "sync", model, opt, step=1)
    handle = checkpoint.save(tmp_path / "async", model, opt, step=1, blocking=False)
    for _ in range(2):
        grads()
        opt.step()
    same = _checkpoint_bytes(Path(sync)) == _checkpoint_bytes(Path(handle.wait()))
    assert same == waits


def test_save_copies_are_cut_into_pieces_in_bucket_order(monkeypatch):
    """The pieces an asynchronous save copies: at most FENCE_PIECE_BYTES each, every element
    once, ordered by position in their storage (the first bucket of every state tensor
    first); a region waits for the last piece that reads any of its bytes."""
    from shardopt.checkpoint import snapshot as snap
    monkeypatch.setattr(snap, "FENCE_PIECE_BYTES", 400)
    big, small = torch.arange(1000, dtype=torch.float32), torch.arange(300, dtype=torch.bfloat16)
    pairs = [(torch.empty(600), big[200:800]), (torch.empty(300, dtype=torch.bfloat16), small)]
    pieces = snap._pieces(pairs + [(torch.empty(0), big[:0])])  # an empty run: no piece
    for dst, src, (ptr, a, b) in pieces:
        assert dst.numel() == src.numel() and b - a == src.numel() * src.element_size() <= 400
        assert (ptr, a) == (src.untyped_storage().data_ptr(),
                            src.storage_offset() * src.element_size())
    starts = [a / src.untyped_storage().nbytes() for _, src, (_, a, _) in pieces]
    assert starts == sorted(starts)
    assert [p[2][0] for p in pieces[:2]] == [small.untyped_storage().data_ptr(),
                                           big.untyped_storage().data_ptr()]
    for dst, src, _ in pieces:
        dst.copy_(src)
    assert torch.equal(pairs[0][0], big[200:800]) and torch.equal(pairs[1][0], small)
    fence = snap.SaveFence([(*where, None) for *_, where in pieces], None, torch.device("cpu"))
    assert fence.last_reading([big[:200]]) == -1  # not copied
    last = fence.last_reading([big[700:701], small[:1]])
    assert pieces[last][2][0] == big.untyped_storage().data_ptr()
    assert pieces[last][2][1] <= 700 * 4 < pieces[last][2][2]
    assert pieces[fence.last_reading([small[-1:]])][2] == (small.untyped_storage().data_ptr(),
                                                          400, 600)
