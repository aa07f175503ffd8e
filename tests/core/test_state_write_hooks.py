"""The optimizer's state-write hooks (``DistributedOptimizer.register_state_write_hook``):
before anything writes or frees the state they run, with the state still as it was, and a
removed hook no longer runs. An asynchronous save's copies on a GPU are such a hook
(``shardopt.checkpoint.snapshot.SaveFence``) until the first write has waited for them or
they are done; a step right after such a save leaves its checkpoint intact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.checks import checkpoint_bytes
from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint
from shardopt import kernels as kernels_
from shardopt.checkpoint.snapshot import SaveFence


def _state(opt: DistributedOptimizer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in opt.shard_state.sources().items()}


class _Recorder:
    """A state-write hook: records each call's ``host`` and the state at that moment."""

    def __init__(self, opt: DistributedOptimizer) -> None:
        self.opt = opt
        self.calls: list[tuple[bool, dict[str, torch.Tensor]]] = []

    def __call__(self, host: bool) -> None:
        self.calls.append((host, _state(self.opt)))


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, t in a.items():
        assert torch.equal(t, b[name]), name


def _make(kernel: str = "torch", moments: str = "float32", **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 24).bfloat16())
    cfg = OptimizerConfig(lr=1e-2, bucket_numel=300, align_numel=4, step_kernel=kernel,
                          max_grad_norm=1.0, exp_avg_dtype=getattr(torch, moments),
                          exp_avg_sq_dtype=getattr(torch, moments), **kw)
    return model, DistributedOptimizer(model, cfg)


def _grads(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


@pytest.mark.parametrize("kernel,moments", [("torch", "float32"), ("triton", "float32"),
                                            ("triton", "int8")])
def test_the_step_runs_the_hooks_before_its_first_write(kernel, moments):
    """A step calls the hooks on the stream (``host=False``), first while every byte of the
    state (params, main params, moments, scales) is still as before the step (a re-seed of a
    written param is its first write here); a removed hook is not called."""
    if kernel == "triton" and not kernels_.available(torch.device("cpu")):
        pytest.skip("no Triton interpreter here")
    model, opt = _make(kernel, moments)
    _grads(model, 0)
    opt.step()  # the moments exist from here on
    hook = _Recorder(opt)
    handle = opt.register_state_write_hook(hook)
    with torch.no_grad():
        model[1].weight.mul_(0.5)  # re-seeded by the step: a write before the update
    before = _state(opt)
    _grads(model, 1)
    opt.step()
    assert hook.calls and not any(host for host, _ in hook.calls)
    _assert_same(hook.calls[0][1], before)
    after = _state(opt)
    assert all(not torch.equal(after[n], before[n]) for n in after if n.startswith(
        ("master_param", "exp_avg"))), "the step wrote the state"
    handle.remove()
    calls = len(hook.calls)
    _grads(model, 2)
    opt.step()
    assert len(hook.calls) == calls


def test_the_step_of_moments_a_low_memory_resume_staged_waits_on_the_host(tmp_path):
    """The host copies of staged moments are released after the step: its hook has
    ``host=True`` (the host must wait for readers of that memory first)."""
    model, opt = _make()
    _grads(model, 0)
    opt.step()
    path = checkpoint.save(tmp_path, model, opt, step=1)
    model2, opt2 = _make()
    checkpoint.load(path, model2, opt2, low_memory_resume=True)
    assert opt2.shard_state.held["exp_avg.0"].where == "staged"  # staged on the host
    hook = _Recorder(opt2)
    opt2.register_state_write_hook(hook)
    before = _state(opt2)
    _grads(model2, 1)
    opt2.step()
    assert [host for host, _ in hook.calls] == [True]
    _assert_same(hook.calls[0][1], before)


@pytest.mark.parametrize("call", ["offload", "reload_model_params", "load_state_dict",
                                  "state_dict_after_a_write"])
def test_writes_and_frees_outside_the_step_run_the_hooks_first(call):
    """``offload()``, ``reload_model_params()`` and ``load_state_dict()`` run the hooks on the
    host (they free the state or write it from the host), re-seeding a param written in place
    on the stream; each time before the state changes."""
    model, opt = _make()
    _grads(model, 0)
    opt.step()
    other_model, other = _make()  # its state dict is what load_state_dict takes
    _grads(other_model, 0)
    other.step()
    _grads(model, 1)
    opt.step()
    hook = _Recorder(opt)
    opt.register_state_write_hook(hook)
    with torch.no_grad():
        model[1].weight.add_(1.0)  # to re-seed
    before = _state(opt)
    if call == "offload":
        opt.offload()
        opt.onload()
    elif call == "reload_model_params":
        opt.reload_model_params()
    elif call == "load_state_dict":
        opt.load_state_dict(other.state_dict())
    else:
        opt.state_dict()
    assert hook.calls and hook.calls[0][0] == (call != "state_dict_after_a_write")
    _assert_same(hook.calls[0][1], before)
    if call != "offload":
        assert not torch.equal(_state(opt)["master_param.0"], before["master_param.0"])


class _Event:
    """Stands in for the CUDA event after a save's copies (this test runs on the CPU)."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def test_a_save_fence_is_waited_for_once_then_gone():
    """The first write after an asynchronous save's copies waits for them and removes the
    fence, so later writes do not wait; a fence the background writer finished (``finish``:
    the copies are done) is gone before any write."""
    model, opt = _make()
    _grads(model, 0)
    opt.step()
    done = _Event()
    SaveFence(done, torch.device("cpu")).attach(opt)
    opt.reload_model_params()  # host=True: no CUDA stream needed
    opt.reload_model_params()
    assert done.waits == 1
    done = _Event()
    fence = SaveFence(done, torch.device("cpu"))
    fence.attach(opt)
    fence.finish()
    opt.reload_model_params()
    assert done.waits == 1


@pytest.mark.cuda
@pytest.mark.parametrize("waits", [True, False], ids=["step_waits", "control_without_waits"])
def test_step_right_after_an_async_save_never_overwrites_what_it_still_copies(tmp_path,
                                                                                monkeypatch,
                                                                                waits):
    """A state of ~1 GB whose host copies take far longer than a step, saved asynchronously and
    stepped at once, twice: the checkpoint holds the state at the call. The control, with the
    fence's wait removed, shows the race is real: its checkpoint differs."""
    if not waits:
        monkeypatch.setattr(SaveFence, "_before_write", lambda self, host: None)
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
    same = checkpoint_bytes(Path(sync)) == checkpoint_bytes(Path(handle.wait()))
    assert same == waits
