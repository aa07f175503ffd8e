"""offload() / onload() / release_host_memory() / iter_param_buckets().

The reference for every continuation is the same training run without any
offload: params, moments and losses must match bit for bit.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _dist import run_distributed
from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint
from shardopt.checkpoint import CheckpointError
from shardopt.host_state import OffloadError
from shardopt.pinned import PinnedBuffer

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)


class Mixed(nn.Module):
    """bf16 linears around an fp32 norm: two flat buffers, several buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 24).to(torch.bfloat16)
        self.norm = nn.LayerNorm(24)
        self.down = nn.Linear(24, 4).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.up(x.bfloat16()).float()))
        return self.down(h.bfloat16()).float()


def make(device="cpu", **cfg):
    torch.manual_seed(0)
    model = Mixed().to(device)
    config = OptimizerConfig(lr=1e-2, bucket_numel=64, max_grad_norm=1.0, **cfg)
    return model, DistributedOptimizer(model, config)


def batch(i: int, rank: int = 0, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * i + rank)
    return torch.randn(6, 8, generator=g).to(device), torch.randn(6, 4, generator=g).to(device)


def train(model, opt, steps, offload_at=(), rank=0, accumulate=False, cycle=None,
          after_backward=False, copy=None):
    """Losses of ``steps`` iterations; before each step in ``offload_at`` the whole state
    makes a round trip (``cycle(model, opt)`` between offload and onload): before the
    forward, or with ``after_backward`` between backward (its reductions maybe still in
    flight) and ``step()``."""
    device = opt.device
    losses = []
    for i in range(steps):
        if i in offload_at and not (accumulate or after_backward):
            opt.offload()
            if cycle is not None:
                cycle(model, opt)
            opt.onload(copy)
        x, y = batch(i, rank, device)
        if accumulate:  # the first half under no_sync; the round trip keeps its grads
            with opt.no_sync():
                F.mse_loss(model(x[:3]), y[:3]).backward()
            if i in offload_at:
                opt.offload()
                opt.onload()
            x, y = x[3:], y[3:]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if i in offload_at and after_backward:
            opt.offload()
            opt.onload()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def state_of(model, opt):
    opt.finish_param_sync()
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for s in opt.shards:
        for name in ("master_param", "exp_avg", "exp_avg_sq"):
            out[f"{s.fqn}.{name}"] = opt.state_view(name, s).clone()
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def check_refusals(model, opt):
    """While offloaded: forward and step raise, state still readable from host copies."""
    with pytest.raises(OffloadError, match=r"forward of module '<root>'.*onload\(\)"):
        model(torch.zeros(2, 8, device=opt.device))
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
    assert_same(state_of(model, opt), ref)


def test_onload_refuses_an_unknown_way_to_copy_and_stays_offloaded():
    model, opt = make()
    train(model, opt, 1)
    opt.offload()
    with pytest.raises(OffloadError, match=r"onload\(copy='dma'\): choose from"):
        opt.onload(copy="dma")
    assert opt.offloaded  # nothing moved
    opt.onload(copy="copy_engine")
    assert not opt.offloaded


def test_pending_accumulated_grads_survive_a_round_trip():
    model, opt = make()
    ref_losses = train(model, opt, 4, accumulate=True)
    ref = state_of(model, opt)
    model, opt = make()
    assert train(model, opt, 4, (1, 2), accumulate=True) == ref_losses
    assert_same(state_of(model, opt), ref)


def test_state_reads_come_from_host_copies_and_params_are_unusable_meanwhile():
    model, opt = make()
    train(model, opt, 2)
    before = state_of(model, opt)
    opt.offload()
    assert opt.offloaded == ("moments", "main_params", "grads", "params")
    # on CPU the live tensors are poisoned, so nothing can read them by accident
    assert all(torch.isnan(p).all() for p in model.parameters())
    assert_same({k: v for k, v in before.items() if not k.startswith("p.")},
                {k: v for k, v in state_of(model, opt).items() if not k.startswith("p.")})
    opt.onload()
    assert opt.offloaded == ()
    assert_same(state_of(model, opt), before)
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
    assert opt.offloaded == ()


def test_a_failed_offload_changes_nothing(monkeypatch):
    model, opt = make()
    train(model, opt, 2)
    before = state_of(model, opt)
    real = opt._host._host_copies

    def fail_on_params(kind, live):
        if kind == "params":
            raise MemoryError("host memory exhausted")
        return real(kind, live)

    monkeypatch.setattr(opt._host, "_host_copies", fail_on_params)
    with pytest.raises(MemoryError):
        opt.offload()
    assert opt.offloaded == ()
    assert_same(state_of(model, opt), before)
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
    assert_same(state_of(model2, opt2), before)  # the refused load changed nothing
    opt.onload()
    exported = []
    for path in (on, off):
        out = tmp_path / f"export-{len(exported)}"
        checkpoint.export(path, out)
        exported.append({f.name: f.read_bytes() for f in sorted(out.iterdir())})
    assert exported[0] == exported[1]
    checkpoint.load(off, model2, opt2)
    assert_same(state_of(model2, opt2), state_of(model, opt))


def test_low_memory_resume_then_offload_continues_bitwise(tmp_path):
    model, opt = make()
    train(model, opt, 2)
    checkpoint.save(tmp_path, model, opt, step=2)
    ref_losses = train(model, opt, 3)
    model2, opt2 = make()
    checkpoint.load(tmp_path, model2, opt2, low_memory_resume=True)
    assert opt2._host.staged is not None
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
    assert_same(state_of(model2, opt2), state_of(model, opt))


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
    kept = opt._host.host_bytes()
    assert kept == sum(t.numel() * t.element_size() for t in
                       opt.buffers.param_buffers + [m for m in opt.main_params if m is not None]
                       + opt.moments.tensors())  # grads were not pending
    opt.release_host_memory()
    assert opt._host.host_bytes() == 0
    ref_model, ref_opt = make()
    train(ref_model, ref_opt, 1)
    assert train(model, opt, 2, offload_at=(1,)) == train(ref_model, ref_opt, 2)
    assert_same(state_of(model, opt), state_of(ref_model, ref_opt))


def test_pinned_buffer_release_reports_a_failed_unregister(monkeypatch):
    class FakeCudart:
        class cudaError:  # noqa: N801 - mirrors torch.cuda.cudart()
            success = 0

        @staticmethod
        def cudaHostUnregister(ptr):  # noqa: N802
            return 17

        @staticmethod
        def cudaGetErrorString(err):  # noqa: N802
            return "invalid host pointer"

    buf = PinnedBuffer(16, torch.float32)
    buf.release()
    buf._registered = [(buf.tensor.data_ptr(), 64)]  # as if registered
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart)
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
    assert_same(state_of(model, opt), ref)
    return ref_losses, losses, ref, got, buckets


@pytest.mark.parametrize("overlap", [False, True], ids=["gather", "overlap-gather"])
def test_round_trips_continue_bitwise_at_dp2(tmp_path, overlap):
    results = run_distributed(dp2_rank, 2, overlap, tmp_path=tmp_path)
    for ref_losses, losses, ref, got, _ in results:
        assert losses == ref_losses
        assert_same(got, ref)
    assert results[0][4].keys() == results[1][4].keys()
    for fqns, flat in results[0][4].items():
        assert torch.equal(flat, results[1][4][fqns])
        offset = 0
        for fqn in fqns:
            p = results[0][3][f"p.{fqn}"]
            assert torch.equal(flat[offset:offset + p.numel()].view(p.shape), p)
            offset += p.numel()


# ------------------------------------------------------------------------ CUDA
def _big(device="cuda"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024)).to(device)
    model[0].to(torch.bfloat16)
    model[1].to(torch.bfloat16)
    return model, DistributedOptimizer(model, OptimizerConfig(lr=1e-3))


@pytest.fixture(params=[False, True], ids=["cudamalloc", "expandable"])
def allocator_expandable(request, monkeypatch):
    """The CUDA allocator set to make expandable segments (switched at run time, and said in
    the environment, which is all torch 2.11 lets host_state see) or not."""
    from shardopt import host_state
    # Earlier tests' optimizers left to the cycle collector hold cudaMalloc segments; freed in
    # the middle of this test, one of the size of its param buffer was reused by onload.
    gc.collect()
    torch.cuda.empty_cache()
    if request.param:
        if not hasattr(torch._C, "_accelerator_setAllocatorSettings"):
            pytest.skip("this torch cannot switch expandable segments at run time")
        torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        assert host_state.allocator_expandable() == request.param
        yield request.param
    finally:
        if request.param:
            torch.cuda.empty_cache()
            torch._C._accelerator_setAllocatorSettings("expandable_segments:False")


@pytest.mark.cuda
def test_offload_returns_device_memory_and_reuses_pinned_host_buffers(allocator_expandable):
    """With expandable segments offload frees each storage as its copy ends, otherwise all
    after the copies: either way the memory goes back, and the values come back."""
    model, opt = _big()
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    # cuBLAS keeps its workspace through empty_cache(): allocate it before the baseline
    (x @ x.T).sum().item()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved() - sum(
        t.untyped_storage().nbytes() for t in opt.buffers.param_buffers + opt.buffers.grad_buffers
        + [m for m in opt.main_params if m is not None])
    for cycle in range(3):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref = [p.detach().clone().cpu() for p in model.parameters()]
        held = torch.cuda.memory_reserved()
        opt.offload()
        torch.cuda.synchronize()
        # only small device tensors (the input, chunk tables, norms) may remain; a
        # fresh process with just a CUDA context reserves nothing at all
        assert torch.cuda.memory_reserved() - base <= 16 << 20
        assert held - torch.cuda.memory_reserved() >= 8 * sum(p.numel() for p in ref)
        addresses = sorted(t.data_ptr() for ts in opt._host._copies.values() for t in ts
                           if t is not None)
        assert all(t.is_pinned() for ts in opt._host._copies.values() for t in ts
                   if t is not None)
        if cycle:
            assert addresses == first  # noqa: F821 - the same host buffers every cycle
        first = addresses
        opt.onload()
        for p, r in zip(model.parameters(), ref):
            assert torch.equal(p.cpu(), r)
        segments = {s["address"]: s for s in torch.cuda.memory_snapshot()}
        for t in opt.buffers.param_buffers:
            seg = max((a for a in segments if a <= t.data_ptr()), default=None)
            assert seg is not None and t.data_ptr() < seg + segments[seg]["total_size"]
            assert segments[seg].get("is_expandable", False) == allocator_expandable, \
                (cycle, t.untyped_storage().nbytes(), segments[seg])
    opt.release_host_memory()


def test_load_state_dict_while_offloaded_is_refused_and_changes_nothing():
    # It would write moments the onload then overwrites with the host copies (and, on a GPU,
    # write into storage the offload gave back).
    model, opt = make()
    train(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())  # the state after 2 steps, not views of the live one
    train(model, opt, 1)
    before = state_of(model, opt)
    opt.offload()
    with pytest.raises(OffloadError, match="load_state_dict"):
        opt.load_state_dict(sd)
    opt.onload()
    assert_same(state_of(model, opt), before)


def test_weights_written_while_params_are_offloaded_are_an_error_not_lost():
    """A write to a param while the params are offloaded lands in storage that onload()
    overwrites (on a GPU there is no storage at all): onload() restores the params as
    offload() found them and raises naming the param, and training goes on exactly as
    without the write. With the params on the device the write is kept."""
    model, opt = make()
    ref_losses = train(model, opt, 4)
    ref = state_of(model, opt)
    model, opt = make()
    train(model, opt, 2)
    written = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    opt.offload()
    model.load_state_dict(written)
    with pytest.raises(OffloadError, match=r"'up.weight'.*written.*offloaded"):
        opt.onload()
    assert opt.offloaded == ()
    losses = []
    for i in (2, 3):  # as if nothing had been written
        x, y = batch(i)
        losses.append(F.mse_loss(model(x), y))
        losses[-1].backward()
        opt.step()
        opt.zero_grad()
    assert [loss.item() for loss in losses] == ref_losses[2:]
    assert_same(state_of(model, opt), ref)

    opt.offload(("moments", "main_params"))
    model.load_state_dict(written)
    opt.onload()
    assert all(bool((p == 0.5).all()) for p in model.parameters())


def test_reload_model_params_while_params_are_offloaded_is_refused():
    """It would re-seed the main params from the host copies, not from weights written
    through ``p.data`` meanwhile (which onload() overwrites): refused, changing nothing."""
    model, opt = make()
    train(model, opt, 2)
    before = state_of(model, opt)
    opt.offload()
    for p in model.parameters():
        p.data.fill_(0.5)
    with pytest.raises(OffloadError, match=r"reload_model_params\(\).*params"):
        opt.reload_model_params()
    opt.onload()
    assert_same(state_of(model, opt), before)
    opt.offload(("moments", "main_params"))  # the params are on the device: fine
    for p in model.parameters():
        p.data.fill_(0.5)
    opt.reload_model_params()
    opt.onload()
    for s in opt.shards:
        assert bool((opt.state_view("master_param", s) == 0.5).all())


def test_onload_copies_by_kernel_unless_the_allocator_has_expandable_segments(monkeypatch):
    from shardopt import host_state
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    if hasattr(torch._C, "_accelerator_getAllocatorSettings"):  # nothing set at run time
        monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "")
    assert host_state.h2d_by_kernel()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64, expandable_segments:True")
    assert not host_state.h2d_by_kernel()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert host_state.h2d_by_kernel()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert not host_state.h2d_by_kernel()
    monkeypatch.setattr(host_state, "H2D_BY_KERNEL", True)
    assert host_state.h2d_by_kernel()
    monkeypatch.setattr(host_state, "H2D_BY_KERNEL", None)
    if hasattr(torch._C, "_accelerator_getAllocatorSettings"):  # set at run time: it wins
        monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings",
                            lambda: "expandable_segments:False")
        assert host_state.h2d_by_kernel()


@pytest.mark.cuda
@pytest.mark.parametrize("by_kernel", [True, False], ids=["kernel", "copy_engine"])
def test_onload_copies_are_exact_by_kernel_and_by_copy_engine(by_kernel):
    """Every element arrives, in every dtype and at odd sizes, into storage re-allocated
    just before its copy."""
    from shardopt import host_state
    torch.manual_seed(0)
    specs = [(3 * 4096, torch.bfloat16), (5000, torch.float32), (777, torch.int8),
             (12345, torch.float32)]
    hosts = [PinnedBuffer(n, dtype) for n, dtype in specs]
    for h in hosts:
        h.tensor.copy_(torch.randint(-100, 100, (h.tensor.numel(),)).to(h.tensor.dtype))
    devs = [torch.zeros(n, dtype=dtype, device="cuda") for n, dtype in specs]
    sizes = [d.untyped_storage().nbytes() for d in devs]
    for d in devs:
        d.untyped_storage().resize_(0)
    pairs = [(d, h.tensor) for d, h in zip(devs, hosts)]
    event = host_state.queue_h2d(pairs, torch.cuda.Stream(), sizes, by_kernel=by_kernel)
    event.synchronize()
    for d, h in zip(devs, hosts):
        assert torch.equal(d.cpu(), h.tensor)
        h.release()


# ------------------------------------------------------------- misuse while offloaded
def test_a_backward_while_grads_or_params_are_offloaded_is_refused():
    """A graph built before offload() and backpropagated while the grads (or params) are out
    would write into storage onload() replaces or zeroes: the step after would silently run
    on zero grads. It raises instead; with only the moments and main params out it runs."""
    for what, refused in ((("grads",), True), (("params",), True),
                          (("moments", "main_params"), False)):
        model, opt = make()
        train(model, opt, 1)
        x, y = batch(1)
        loss = F.mse_loss(model(x), y)
        opt.offload(what)
        if refused:
            with pytest.raises(OffloadError, match=r"a backward needs the optimizer's"):
                loss.backward()
        else:
            loss.backward()
        opt.onload()


def test_a_param_moved_while_offloaded_is_still_found():
    """``p.data = ...`` (or ``model.to(...)``) while offloaded leaves a param outside the
    buffer. onload() must not take its new address as the buffer's, which would hide the
    move and silently stop the param's training: the next step raises ParamMovedError."""
    from shardopt import ParamMovedError
    for what in (("moments",), ("params", "grads")):
        model, opt = make()
        train(model, opt, 1)
        opt.offload(what)
        model.up.weight.data = model.up.weight.data.clone()
        opt.onload()
        with pytest.raises(ParamMovedError, match="up.weight"):
            train(model, opt, 1)


def test_weights_set_before_the_first_step_survive_state_dict_and_offload():
    """Until the first step every param counts as written, however often the main params
    are re-seeded before it (state_dict(), an offload): weights written where no version
    counter sees them (``p.data``) after those are still what the first step starts from."""
    for before in ("state_dict", "offload"):
        model, opt = make()
        if before == "state_dict":
            opt.state_dict()
        else:
            opt.offload()
            opt.onload()
        with torch.no_grad():
            for p in model.parameters():
                p.data.fill_(0.5)
        for g in opt.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        train(model, opt, 1)
        assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in model.parameters()), before


def test_copying_pickling_or_listing_the_model_while_offloaded_is_refused():
    """``copy.deepcopy(model)`` or ``torch.save(model)`` while the params are offloaded would
    copy empty or poisoned storage: they raise, and after onload() work (the copy trains);
    buckets listed before an offload and read after it raise at the next bucket."""
    import io
    model, opt = make()
    train(model, opt, 1)
    buckets = opt.iter_param_buckets()
    opt.offload()
    for do in (copy.deepcopy, lambda m: torch.save(m, io.BytesIO())):
        with pytest.raises(OffloadError, match="pickling or copying module '<root>'"):
            do(model)
    with pytest.raises(OffloadError, match="iter_param_buckets"):
        next(buckets)
    opt.onload()
    twin = copy.deepcopy(model)
    torch.save(model, io.BytesIO())
    x, _ = batch(0)
    assert torch.equal(twin(x), model(x))
