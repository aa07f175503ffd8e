"""The optimizer's state-write hooks (``DistributedOptimizer.register_state_write_hook``):
before anything writes or frees the state they run, with the state still as it was, and a
removed hook no longer runs. An asynchronous save's drain (``shardopt.checkpoint.drain.Drain``)
is such a hook until the first write has taken what it had not copied yet, or until it is
done; a write while the drain is midway, with or without spare memory for the rest, leaves the
checkpoint the state at the call; and on a GPU the step's wait is what keeps the checkpoint
intact."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers.checks import checkpoint_bytes
from helpers.models import train
from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint
from shardopt import kernels as kernels_
from shardopt.checkpoint import drain as drain_module
from shardopt.checkpoint.drain import Copy, Drain


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


def test_the_first_write_takes_the_rest_of_the_copies_and_the_hook_goes(monkeypatch):
    """The first write after an asynchronous save's call copies what the drain has not
    read yet and removes the hook, so later writes pay nothing; the drain then finishes
    from that copy. A drain that finished before any write has removed its hook."""
    model, opt = _make()
    _grads(model, 0)
    opt.step()
    calls = []
    real = Drain._before_write
    monkeypatch.setattr(Drain, "_before_write",
                        lambda self, host: calls.append(host) or real(self, host))
    src, dst = torch.arange(1000.0), torch.zeros(1000)
    drain = Drain([Copy(dst.view(torch.uint8), src.view(torch.uint8))],
                  torch.device("cpu"), None, lambda: None, 4 << 20, 1)
    drain.attach(opt)
    opt.reload_model_params()  # host=True: no CUDA stream needed
    opt.reload_model_params()
    assert calls == [True]
    src.fill_(-1.0)  # what the write did
    drain.run()
    assert torch.equal(dst, torch.arange(1000.0))
    done = Drain([Copy(torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8))],
                 torch.device("cpu"), None, lambda: None, 4 << 20, 1)
    done.attach(opt)
    done.run()
    opt.reload_model_params()
    assert calls == [True]


SMALL_PIECES = checkpoint.CheckpointConfig(drain_piece_bytes=64)


def _gate_the_drain(monkeypatch, pieces: int) -> tuple[threading.Event, list]:
    """The drain (of a save with :data:`SMALL_PIECES`) stops before its ``pieces + 1``-th
    piece until the gate opens."""
    gate, issued = threading.Event(), []
    real = Drain._prepare

    def gated(self, into, end):
        if len(issued) == pieces and not gate.wait(60):
            raise AssertionError("the test never opened the gate")
        issued.append(end)
        real(self, into, end)

    monkeypatch.setattr(Drain, "_prepare", gated)
    return gate, issued


def _until(cond) -> None:
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


@pytest.mark.parametrize("hook", [True, False], ids=["hook", "control_without_hook"])
def test_steps_while_the_drain_is_midway_leave_the_state_at_the_call(trained_model, tmp_path,
                                                                     monkeypatch, hook):
    """Two steps while the background drain has copied 3 pieces of the snapshot: the hook
    copies the rest first, so the checkpoint is the synchronous save's at the call. The
    control, without the hook, shows the steps would otherwise reach the checkpoint."""
    model, opt = trained_model
    if not hook:
        monkeypatch.setattr(Drain, "_before_write", lambda self, host: None)
    sync = checkpoint.save(tmp_path / "sync", model, opt, step=2)
    gate, issued = _gate_the_drain(monkeypatch, 3)
    handle = checkpoint.save(tmp_path / "async", model, opt, step=2, blocking=False,
                             config=SMALL_PIECES)
    _until(lambda: len(issued) == 3)
    train(model, opt, range(2, 4), 0, 1)
    gate.set()
    same = checkpoint_bytes(Path(handle.wait())) == checkpoint_bytes(Path(sync))
    assert same == hook


def test_a_write_without_spare_memory_for_the_rest_waits_for_the_drain(trained_model, tmp_path,
                                                                        monkeypatch, caplog):
    """Where the rest of the snapshot cannot be copied to spare memory, the step waits on the
    host until the drain is done (said once at INFO), and the checkpoint is the state at the
    call."""
    model, opt = trained_model
    monkeypatch.setattr(drain_module, "_spare", lambda nbytes, device: None)
    caplog.set_level(logging.INFO, logger="shardopt.checkpoint")
    for step in (2, 3):
        sync = checkpoint.save(tmp_path / "sync", model, opt, step=step)
        gate, issued = _gate_the_drain(monkeypatch, 3)
        handle = checkpoint.save(tmp_path / "async", model, opt, step=step, blocking=False,
                                 config=SMALL_PIECES)
        _until(lambda: len(issued) == 3)
        threading.Timer(0.2, gate.set).start()
        train(model, opt, range(step, step + 1), 0, 1)
        assert gate.is_set() and len(issued) > 3  # the step waited for the rest of the drain
        assert checkpoint_bytes(Path(handle.wait())) == checkpoint_bytes(Path(sync))
    waits = [r for r in caplog.records if "no spare device memory" in r.getMessage()]
    assert len(waits) == 1 and waits[0].levelno == logging.INFO


@pytest.mark.cuda
@pytest.mark.parametrize("waits", [True, False], ids=["step_waits", "control_without_waits"])
def test_step_right_after_an_async_save_never_overwrites_what_it_still_copies(tmp_path,
                                                                                monkeypatch,
                                                                                waits):
    """A state of ~1 GB whose host copies take far longer than a step, saved asynchronously and
    stepped at once, twice: the checkpoint holds the state at the call. The control, with the
    drain's hook removed, shows the race is real: its checkpoint differs."""
    if not waits:
        monkeypatch.setattr(Drain, "_before_write", lambda self, host: None)
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


def test_a_write_to_opt_state_and_release_host_memory_run_the_hooks_first():
    """A framework moving state through ``opt.state[p][k] = t`` and ``release_host_memory()``
    (which frees the host copies an offloaded save may read) both change or free the state:
    the hooks run before, with the state still as it was."""
    model, opt = _make()
    _grads(model, 0)
    opt.step()
    rec = _Recorder(opt)
    opt.register_state_write_hook(rec)
    before = _state(opt)
    p = next(model.parameters())
    opt.state[p]["exp_avg"] = torch.ones_like(opt.state[p]["exp_avg"])
    assert [host for host, _ in rec.calls] == [True]
    _assert_same(rec.calls[0][1], before)
    assert torch.equal(opt.state[p]["exp_avg"], torch.ones_like(opt.state[p]["exp_avg"]))
    opt.offload()
    opt.onload()
    calls = len(rec.calls)
    opt.release_host_memory()
    assert len(rec.calls) == calls + 1 and rec.calls[-1][0] is True
