"""Misuse gets a clear error naming what to do or which param, never a deep TypeError,
IndexError or a hang: torch.optim-style construction, two optimizers over one model,
``add_param_group``, ranks that built different models, and checkpoint calls with a
model the optimizer does not own; a second backward at one rank is accumulation."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch
from torch import nn

from helpers.checks import model_state
from helpers.dist import run_distributed
from helpers.models import MixedLM, build, train
from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint
from shardopt.errors import UsageError


@pytest.mark.parametrize("args, kwargs", [
    (lambda m: (m.parameters(),), {}),
    (lambda m: (list(m.parameters()),), {}),
    (lambda m: ([{"params": list(m.parameters()), "lr": 1e-3}],), {}),
    (lambda m: (m,), {"lr": 1e-3, "weight_decay": 0.1}),
    (lambda m: (m, 1e-3), {}),
])
def test_torch_style_construction_says_what_to_pass(args, kwargs):
    model = nn.Linear(3, 2)
    with pytest.raises(UsageError, match=r"OptimizerConfig\(lr=") as info:
        DistributedOptimizer(*args(model), **kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)
    DistributedOptimizer(model)  # nothing was claimed by the failed attempts


def test_second_optimizer_over_the_same_params_is_refused():
    model, opt = build(0)
    data_ptr = model.up.weight.data_ptr()
    with pytest.raises(UsageError, match="param 'emb.weight' already belongs to another"):
        DistributedOptimizer(model, OptimizerConfig())
    # The first optimizer still owns and trains the params.
    assert model.up.weight.data_ptr() == data_ptr
    before = model_state(model)
    train(model, opt, range(1), 0, 1)
    assert not torch.equal(model_state(model)["up.weight"], before["up.weight"])
    # Once it is gone the first one has let go: its hooks went with it.
    del opt
    gc.collect()
    DistributedOptimizer(model, OptimizerConfig())


@pytest.mark.parametrize("override, shown", [
    ({"lr": -1e-3}, "lr=-0.001"), ({"eps": float("nan")}, "eps=nan"),
    ({"weight_decay": True}, "weight_decay=True"), ({"betas": (0.9, 1.5)}, r"betas=\(0.9, 1.5\)"),
    ({"betas": (0.9,)}, r"betas=\(0.9,\)"),
])
def test_param_group_fn_values_adamw_cannot_take_are_refused(override, shown):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    fn = lambda fqn, p: override if fqn == "1.bias" else {}  # noqa: E731
    with pytest.raises(ValueError, match=f"{shown}.*'1.bias'"):
        DistributedOptimizer(model, OptimizerConfig(), param_group_fn=fn)
    DistributedOptimizer(model, OptimizerConfig(), param_group_fn=lambda f, p: {
        "lr": 0, "betas": [0, 0.5], "weight_decay": 0})  # the edges are fine


def test_add_param_group_points_to_param_group_fn():
    model, opt = build(0)
    with pytest.raises(NotImplementedError, match="param_group_fn"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


@pytest.mark.parametrize("grad_mode", ["torch", "buffer"])
def test_a_second_backward_at_one_rank_accumulates(grad_mode):
    """At one rank nothing is reduced, so a second backward before step() (a framework's
    gradient accumulation, which cannot call no_sync()) adds to the first in every mode:
    the step equals torch.optim.AdamW's after the same two backward passes. (At DP > 1,
    grad_mode='buffer' refuses it: tests/core/test_grads.py.)"""
    def run(make_opt):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        opt = make_opt(model)
        for step in range(2):
            for micro in range(2):
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + micro))
                model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    ours = run(lambda m: DistributedOptimizer(m, OptimizerConfig(lr=1e-2, grad_mode=grad_mode)))
    ref = run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_checkpoint_with_a_model_the_optimizer_does_not_own(tmp_path):
    model, opt = build(0)
    other, _ = build(0)
    with pytest.raises(ValueError, match="param 'emb.weight' of the model passed in is not one"):
        opt.shard_state.check_model(other)
    with pytest.raises(checkpoint.CheckpointError, match="'emb.weight' of the model passed in"):
        checkpoint.save(tmp_path, other, opt, step=1)
    assert checkpoint.latest(tmp_path) is None and not os.listdir(tmp_path)
    path = checkpoint.save(tmp_path, model, opt, step=1)
    before = model_state(other)
    with pytest.raises(checkpoint.CheckpointError, match="'emb.weight' of the model passed in"):
        checkpoint.load(path, other, opt)
    assert model_state(other).keys() == before.keys()
    model.up.weight.requires_grad_(False)  # frozen since construction: still the optimizer's
    opt.shard_state.check_model(model)
    with pytest.raises(ValueError, match="the optimizer's param 'up.weight' is not in the mod"):
        opt.shard_state.check_model(nn.ModuleDict({"emb": model.emb}))
    renamed = nn.ModuleDict({"embedding": model.emb})
    with pytest.raises(ValueError, match="'embedding.weight' .* is the optimizer's 'emb.weight'"):
        opt.shard_state.check_model(renamed)
    # A save checks the params its one walk of the model's state dict finds, alike.
    for blocking in (True, False):
        for wrong, match in ((nn.ModuleDict({"emb": model.emb}), "param 'up.weight' is not in"),
                             (renamed, "'embedding.weight' .* is the optimizer's 'emb.weight'"),
                             (other, "'emb.weight' of the model passed in is not one")):
            with pytest.raises(checkpoint.CheckpointError, match=match):
                checkpoint.save(tmp_path, wrong, opt, step=2, blocking=blocking)
    assert checkpoint.latest(tmp_path) == path


def misuse_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def expect(case: str, error: type, fn) -> None:
        try:
            fn()
            out[case] = None
        except error as e:
            out[case] = str(e)

    torch.manual_seed(0)
    kwargs = [{}, {"extra_layer": True}, {"experts": 4}, {"fp32": ("norm",)}]
    for i, other in enumerate(kwargs[1:], start=1):
        model = MixedLM(**(other if rank == 1 else {}))
        expect(f"models{i}", UsageError, lambda: DistributedOptimizer(model))
    # Same model, other moment and grad dtypes on rank 1: other layouts and collectives.
    model = MixedLM()
    expect("settings", UsageError, lambda: DistributedOptimizer(model, OptimizerConfig(
        **({"exp_avg_dtype": "int8", "grad_dtype": torch.bfloat16} if rank == 1 else {}))))
    model, opt = build(0)
    # Rank 0 alone reuses a model: every rank raises instead of hanging in a collective.
    if rank == 1:
        model = MixedLM()
    expect("owned", UsageError, lambda: DistributedOptimizer(model))
    # Rank 1 alone passes the wrong model to save.
    model, opt = build(1)
    other, _ = build(2)
    expect("save", checkpoint.CheckpointError,
           lambda: checkpoint.save(root, other if rank == 1 else model, opt, step=1))
    return out


def test_misuse_across_ranks_raises_on_every_rank(tmp_path):
    results = run_distributed(misuse_rank, 2, str(tmp_path / "ckpt"), tmp_path=tmp_path)
    needles = {
        "models1": "param 'extra.weight' exists on dp rank 1 but not on dp rank 0",
        "models2": "param 'router.weight' has shape (3, 14) on dp rank 0 but (4, 14) on dp rank 1",
        "models3": "param 'router.weight' has dtype torch.float32 on dp rank 0 but "
                   "torch.bfloat16 on dp rank 1",
        "settings": "optimizer settings (bucket_numel, align_numel, param_align), grad_dtype are "
                    "((40000000, 64, 1), 'torch.float32') on dp rank 0 but ((40000000, 64, 64), "
                    "'torch.bfloat16') on dp rank 1",
        "owned": "[dp rank 0] param 'emb.weight' already belongs to another",
        "save": "[dp rank 1] param 'emb.weight' of the model passed in",
    }
    for rank, r in enumerate(results):
        for case, needle in needles.items():
            assert r[case] is not None, f"{case} did not fail on rank {rank}"
            assert needle in r[case], f"rank {rank} {case}: {r[case]}"
    assert checkpoint.latest(tmp_path / "ckpt") is None


def test_a_dropped_optimizer_and_its_model_are_freed():
    # Grad hooks live on the params, where the garbage collector cannot see them: a hook that
    # held the optimizer kept the optimizer, and through it the model, alive for good.
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2).to(torch.bfloat16))
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-2))
    model[1](model[0](torch.randn(3, 4)).to(torch.bfloat16)).float().sum().backward()
    opt.step()
    refs = weakref.ref(opt), weakref.ref(model)
    del opt, model
    gc.collect()
    assert refs[0]() is None and refs[1]() is None


@pytest.mark.parametrize("key, value", [("maximize", True), ("amsgrad", True),
                                        ("decoupled_weight_decay", False)])
def test_adamw_group_options_this_optimizer_lacks_are_refused_not_ignored(key, value):
    # torch.optim.AdamW honours these when set in param_groups after construction; ignoring
    # them would train silently otherwise than asked.
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-2),
                               param_group_fn=lambda f, p: {"weight_decay": 0.0}
                               if f.endswith("bias") else {})
    model(torch.randn(4, 3)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[-1][key] = value
    first = opt.shard_state.fqn_of[opt.param_groups[-1]["params"][0]]
    with pytest.raises(UsageError, match=rf"param_groups\[1\]\['{key}'\]={value}.*'{first}'"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.param_groups[-1][key] = not value  # torch's default: accepted
    opt.step()
    assert opt.param_steps["0.weight"] == 1


def test_every_error_is_in_one_module_exported_and_a_value_or_runtime_error():
    import inspect as pyinspect

    import shardopt
    from shardopt import errors
    classes = [c for _, c in pyinspect.getmembers(errors, pyinspect.isclass)
               if issubclass(c, Exception) and c.__module__ == errors.__name__]
    assert len(classes) >= 12
    for c in classes:
        assert issubclass(c, (ValueError, RuntimeError)), c
        assert getattr(shardopt, c.__name__) is c and c.__name__ in shardopt.__all__
    import importlib
    import pkgutil
    defined_elsewhere = []
    for info in pkgutil.walk_packages(shardopt.__path__, "shardopt."):
        if info.name.startswith(("shardopt.recipes", "shardopt.cli",
                                 "shardopt.checkpoint._writer_main", "shardopt.__main__")):
            continue
        m = importlib.import_module(info.name)
        defined_elsewhere += [f"{info.name}.{n}" for n, c in vars(m).items()
                              if pyinspect.isclass(c) and issubclass(c, Exception)
                              and c.__module__ == info.name != errors.__name__
                              and not n.startswith("_")]  # private: caught where raised
    assert defined_elsewhere == []
