"""What offload() gives back and how onload() copies (GPU), and what is refused while the
state is offloaded, changing nothing.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.checks import assert_tensors_equal
from helpers.offload import batch, make, state_of, train
from shardopt import DistributedOptimizer, OptimizerConfig
from shardopt.errors import OffloadError
from shardopt.pinned import PinnedBuffer


# ----------------------------------------------------- device memory and copies (GPU)

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
    held = opt.shard_state.held
    params = [h.device for n, h in held.items() if n.startswith("params.")]
    base = torch.cuda.memory_reserved() - sum(  # the param, grad and main param buffers
        h.device.untyped_storage().nbytes() for n, h in held.items()
        if n.split(".")[0] in ("params", "grads", "master_param"))
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
        hosts = [h.host for h in opt.shard_state.held.values() if h.host is not None]
        addresses = sorted(t.data_ptr() for t in hosts)
        assert hosts and all(t.is_pinned() for t in hosts)
        if cycle:
            assert addresses == first  # noqa: F821 - the same host buffers every cycle
        first = addresses
        opt.onload()
        for p, r in zip(model.parameters(), ref):
            assert torch.equal(p.cpu(), r)
        segments = {s["address"]: s for s in torch.cuda.memory_snapshot()}
        for t in params:
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
    assert_tensors_equal(state_of(model, opt), before)


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
    assert opt.shard_state.offloaded == ()
    losses = []
    for i in (2, 3):  # as if nothing had been written
        x, y = batch(i)
        losses.append(F.mse_loss(model(x), y))
        losses[-1].backward()
        opt.step()
        opt.zero_grad()
    assert [loss.item() for loss in losses] == ref_losses[2:]
    assert_tensors_equal(state_of(model, opt), ref)

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
    assert_tensors_equal(state_of(model, opt), before)
    opt.offload(("moments", "main_params"))  # the params are on the device: fine
    for p in model.parameters():
        p.data.fill_(0.5)
    opt.reload_model_params()
    opt.onload()
    for s in opt.shard_state.shards:
        assert bool((opt.shard_state.view("master_param", s) == 0.5).all())


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
