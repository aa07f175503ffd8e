"""offload() / onload() round trips, saves and loads while offloaded, release_host_memory()
and iter_param_buckets().

The reference for every continuation is the same training run without any offload: params,
moments and losses must match bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.checks import assert_tensors_equal
from helpers.dist import run_distributed
from helpers.offload import CUDA, batch, make, state_of, train
from shardopt import checkpoint
from shardopt.checkpoint import CheckpointError
from shardopt.errors import OffloadError
from shardopt.pinned import PinnedBuffer


def check_refusals(model, opt):
    """While offloaded: forward and step raise, state still readable from host copies."""
    with pytest.raises(OffloadError, match=r"forward of module '<root>'.*onload\(\)"):
        model(torch.zeros(2, 8, device=opt.shard_state.device))
    with pytest.raises(OffloadError, match=r"step\(\).*offloaded"):
        opt.step()
    with pytest.raises(OffloadError, match="already offloaded"):
        opt.offload()
    with pytest.raises(OffloadError, match="release_host_memory"):
        opt.release_host_memory()
    with pytest.raises(OffloadError, match="iter_param_buckets"):
        opt.iter_param_buckets()


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("offload_at", [(0, 3), (2, 3, 4)], ids=["before-first-step", "later"])
@pytest.mark.parametrize("copy", [None, "kernel", "copy_engine"])
def test_round_trips_continue_bitwise(device, offload_at, copy):
    model, opt = make(device)
    ref_losses = train(model, opt, 6)
    ref = state_of(model, opt)
    model, opt = make(device)
    losses = train(model, opt, 6, offload_at, cycle=check_refusals, copy=copy)
    assert losses == ref_losses
    assert_tensors_equal(state_of(model, opt), ref)


def test_onload_refuses_an_unknown_way_to_copy_and_stays_offloaded():
    model, opt = make()
    train(model, opt, 1)
    opt.offload()
    with pytest.raises(OffloadError, match=r"onload\(copy='dma'\): choose from"):
        opt.onload(copy="dma")
    assert opt.shard_state.offloaded  # nothing moved
    opt.onload(copy="copy_engine")
    assert not opt.shard_state.offloaded


def test_pending_accumulated_grads_survive_a_round_trip():
    model, opt = make()
    ref_losses = train(model, opt, 4, accumulate=True)
    ref = state_of(model, opt)
    model, opt = make()
    assert train(model, opt, 4, (1, 2), accumulate=True) == ref_losses
    assert_tensors_equal(state_of(model, opt), ref)


def test_state_reads_come_from_host_copies_and_params_are_unusable_meanwhile():
    model, opt = make()
    train(model, opt, 2)
    before = state_of(model, opt)
    opt.offload()
    assert opt.shard_state.offloaded == ("moments", "main_params", "grads", "params")
    # on CPU the live tensors are poisoned, so nothing can read them by accident
    assert all(torch.isnan(p).all() for p in model.parameters())
    assert_tensors_equal({k: v for k, v in before.items() if not k.startswith("p.")},
                {k: v for k, v in state_of(model, opt).items() if not k.startswith("p.")})
    opt.onload()
    assert opt.shard_state.offloaded == ()
    assert_tensors_equal(state_of(model, opt), before)
    opt.onload()  # nothing offloaded: a no-op


def test_partial_offload_keeps_forward_and_refuses_step_only():
    model, opt = make()
    train(model, opt, 1)
    opt.offload(("moments", "main_params"))
    x, y = batch(5)
    F.mse_loss(model(x), y).backward()  # params and grads are on the device
    with pytest.raises(OffloadError, match="moments, main_params"):
        opt.step()
    opt.onload()
    opt.step()
    with pytest.raises(OffloadError, match=r"cannot offload \['weights'\]"):
        opt.offload(("weights",))
    with pytest.raises(OffloadError, match="nothing"):
        opt.offload(())
    with pytest.raises(OffloadError, match=r"offload\(what=None\): give kinds"):
        opt.offload(None)
    assert opt.shard_state.offloaded == ()


def test_a_failed_offload_changes_nothing(monkeypatch):
    model, opt = make()
    train(model, opt, 2)
    before = state_of(model, opt)
    params = [h.device for n, h in opt.shard_state.held.items() if n.startswith("params.")]
    real = torch.empty_like

    def fail_on_params(t, *args, **kwargs):  # the host copies of the params cannot be made
        if any(t is p for p in params):
            raise MemoryError("host memory exhausted")
        return real(t, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty_like", fail_on_params)
        with pytest.raises(MemoryError):
            opt.offload()
    assert opt.shard_state.offloaded == ()
    assert_tensors_equal(state_of(model, opt), before)
    model(torch.zeros(2, 8))  # no guard left behind
    opt.offload(("grads",))
    with pytest.raises(OffloadError, match=r"module 'up' while the optimizer's grads"):
        model.up(torch.zeros(2, 8, dtype=torch.bfloat16))  # a child called on its own
    opt.onload()


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_weights_written_before_offload_are_what_a_save_while_offloaded_holds(tmp_path, device):
    """Weights loaded after a step and then offloaded: the host copies (and so a save taken
    while offloaded) hold them, as a save without the offload does."""
    exported = []
    for offload in (False, True):
        model, opt = make(device)
        train(model, opt, 2)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)  # e.g. model.load_state_dict(pretrained)
        if offload:
            opt.offload()
        path = checkpoint.save(tmp_path / str(offload), model, opt, step=2)
        if offload:
            opt.onload()
        out = tmp_path / f"export-{offload}"
        checkpoint.export(path, out)
        exported.append({f.name: f.read_bytes() for f in sorted(out.iterdir())})
    assert exported[0] == exported[1]


def test_a_write_while_main_params_are_offloaded_is_refused_at_save(tmp_path):
    model, opt = make()
    train(model, opt, 2)
    opt.offload(("main_params", "moments"))
    with torch.no_grad():
        next(model.parameters()).mul_(0.5)
    with pytest.raises(CheckpointError, match="main_params.*offloaded.*onload"):
        checkpoint.save(tmp_path, model, opt, step=2)
    opt.onload()
    checkpoint.save(tmp_path, model, opt, step=2)  # re-seeded now


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_checkpoint_save_while_offloaded_writes_the_same_state(tmp_path, device):
    model, opt = make(device)
    train(model, opt, 3)
    on = checkpoint.save(tmp_path / "on", model, opt, step=3)
    opt.offload()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        allocated = torch.cuda.memory_allocated()
    off = checkpoint.save(tmp_path / "off", model, opt, step=3)
    if device == "cuda":  # written from the host copies: nothing came back to the GPU
        assert torch.cuda.max_memory_allocated() == allocated
    model2, opt2 = make(device)
    train(model2, opt2, 1)
    before = state_of(model2, opt2)
    opt2.offload()
    with pytest.raises(CheckpointError, match=r"checkpoint.load.*offloaded.*onload"):
        checkpoint.load(off, model2, opt2)
    opt2.onload()
    assert_tensors_equal(state_of(model2, opt2), before)  # the refused load changed nothing
    opt.onload()
    exported = []
    for path in (on, off):
        out = tmp_path / f"export-{len(exported)}"
        checkpoint.export(path, out)
        exported.append({f.name: f.read_bytes() for f in sorted(out.iterdir())})
    assert exported[0] == exported[1]
    checkpoint.load(off, model2, opt2)
    assert_tensors_equal(state_of(model2, opt2), state_of(model, opt))


def test_low_memory_resume_then_offload_continues_bitwise(tmp_path):
    model, opt = make()
    train(model, opt, 2)
    checkpoint.save(tmp_path, model, opt, step=2)
    ref_losses = train(model, opt, 3)
    model2, opt2 = make()
    checkpoint.load(tmp_path, model2, opt2, low_memory_resume=True)
    assert opt2.shard_state.held["exp_avg.0"].where == "staged"
    opt2.offload()
    # Saved while offloaded with the moments still staged by the load: the same state.
    exports = []
    for path in (tmp_path / "step_00000002",
                 checkpoint.save(tmp_path / "again", model2, opt2, step=2)):
        out = tmp_path / f"export-{len(exports)}"
        checkpoint.export(path, out)
        exports.append({f.name: f.read_bytes() for f in sorted(out.iterdir())})
    assert exports[0] == exports[1]
    opt2.onload()
    assert train(model2, opt2, 3, offload_at=(1,)) == ref_losses
    assert_tensors_equal(state_of(model2, opt2), state_of(model, opt))


@pytest.mark.parametrize("moments", [torch.float32, "int8"])
def test_iter_param_buckets_concatenate_to_every_param(moments):
    """Back to back, also where 8-bit moments start every param on a 64-element block
    (gaps in the buffer): there the bucket comes packed, a copy instead of a view."""
    model, opt = make(exp_avg_dtype=moments)
    train(model, opt, 1)
    seen = {}
    for fqns, flat in opt.iter_param_buckets():
        assert flat.dtype in (torch.bfloat16, torch.float32)
        offset = 0
        for fqn in fqns:
            p = dict(model.named_parameters())[fqn]
            assert p.dtype == flat.dtype
            if moments != "int8":  # the params lie back to back: views
                assert flat.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
            seen[fqn] = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        assert offset == flat.numel()
    params = dict(model.named_parameters())
    assert seen.keys() == params.keys()
    for fqn, p in params.items():
        assert torch.equal(seen[fqn], p), fqn


def test_release_host_memory_reallocates_on_the_next_offload():
    model, opt = make()
    train(model, opt, 1)
    opt.offload()
    opt.onload()
    def host_bytes() -> int:
        return sum(h.host.numel() * h.host.element_size()
                   for h in opt.shard_state.held.values() if h.host is not None)

    assert host_bytes() == sum(h.device.numel() * h.device.element_size()
                               for h in opt.shard_state.held.values()
                               if h.kind != "grads")  # grads were not pending
    opt.release_host_memory()
    assert host_bytes() == 0
    ref_model, ref_opt = make()
    train(ref_model, ref_opt, 1)
    assert train(model, opt, 2, offload_at=(1,)) == train(ref_model, ref_opt, 2)
    assert_tensors_equal(state_of(model, opt), state_of(ref_model, ref_opt))


def test_pinned_buffer_release_reports_a_failed_unregister(monkeypatch):
    class FakeCudart:
        class cudaError:  # noqa: N801 - mirrors torch.cuda.cudart()
            success = 0

        @staticmethod
        def cudaHostRegister(ptr, nbytes, flags):  # noqa: N802
            return 0

        @staticmethod
        def cudaHostUnregister(ptr):  # noqa: N802
            return 17

        @staticmethod
        def cudaGetErrorString(err):  # noqa: N802
            return "invalid host pointer"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart)
    buf = PinnedBuffer(16, torch.float32)  # registered (as the fake runtime says)
    assert buf.pinned
    with pytest.warns(ResourceWarning, match=r"64 bytes .*invalid host pointer"):
        buf.release()
    assert not buf.pinned


def test_pinned_buffer_locks_segment_by_segment_and_unlocks_each(monkeypatch):
    """``lock=False`` then ``lock_to``: each call registers the segments (of
    ``SEGMENT_BYTES`` from the start) through the byte asked for, once each; ``pinned``
    once all are; ``release`` unregisters every one."""
    from shardopt import pinned

    calls = []

    class FakeCudart:
        class cudaError:  # noqa: N801 - mirrors torch.cuda.cudart()
            success = 0

        @staticmethod
        def cudaHostRegister(ptr, nbytes, flags):  # noqa: N802
            calls.append(("register", ptr, nbytes))
            return 0

        @staticmethod
        def cudaHostUnregister(ptr):  # noqa: N802
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(pinned, "SEGMENT_BYTES", 256)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart)
    buf = PinnedBuffer(250, torch.float32, lock=False)  # 1,000 bytes
    base = buf.tensor.data_ptr()
    assert not calls and not buf.pinned
    buf.lock_to(10)
    buf.lock_to(200)
    assert calls == [("register", base, 256)] and buf.locked_bytes == 256
    buf.lock_to(600)
    assert calls[1:] == [("register", base + 256, 256), ("register", base + 512, 256)]
    assert not buf.pinned
    buf.lock_to(5000)
    assert calls[3:] == [("register", base + 768, 232)] and buf.pinned
    buf.release()
    assert calls[4:] == [("unregister", base + k * 256) for k in range(4)]
    assert not buf.pinned


def dp2_rank(rank, world_size, overlap):
    model, opt = make(overlap_param_gather=overlap)
    ref_losses = train(model, opt, 5, rank=rank)
    ref = state_of(model, opt)
    model, opt = make(overlap_param_gather=overlap)
    losses = train(model, opt, 5, offload_at=(0, 2, 3), rank=rank)
    # after step() with overlap_param_gather the all-gathers may still be in flight
    buckets = {fqns: flat.clone() for fqns, flat in opt.iter_param_buckets()}
    got = state_of(model, opt)
    model, opt = make(overlap_param_gather=overlap)
    assert train(model, opt, 5, offload_at=(1, 2), rank=rank, after_backward=True) == ref_losses
    assert_tensors_equal(state_of(model, opt), ref)
    return ref_losses, losses, ref, got, buckets


@pytest.mark.parametrize("overlap", [False, True], ids=["gather", "overlap-gather"])
def test_round_trips_continue_bitwise_at_dp2(tmp_path, overlap):
    results = run_distributed(dp2_rank, 2, overlap, tmp_path=tmp_path)
    for ref_losses, losses, ref, got, _ in results:
        assert losses == ref_losses
        assert_tensors_equal(got, ref)
    assert results[0][4].keys() == results[1][4].keys()
    for fqns, flat in results[0][4].items():
        assert torch.equal(flat, results[1][4][fqns])
        offset = 0
        for fqn in fqns:
            p = results[0][3][f"p.{fqn}"]
            assert torch.equal(flat[offset:offset + p.numel()].view(p.shape), p)
            offset += p.numel()
