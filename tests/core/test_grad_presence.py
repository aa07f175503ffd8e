"""Gradients as PyTorch code leaves them, against ``torch.optim.AdamW``.

* Grads assigned by hand (before or after backward) are stepped with as torch does; one
  assigned after its bucket was reduced, or a param frozen at construction and unfrozen
  later, is a clear error.
* A param with no gradient on any rank (unused, frozen later) is not updated: weights,
  moments and its own step count stay, as ``torch.optim.AdamW`` does with ``grad=None``;
  one unused on some ranks only is averaged with zero. Per-param step counts survive a
  checkpoint; ``zero_grad(set_to_none=False)`` steps params as torch does.

The reference (``helpers.models.MlpReference``) is ``torch.optim.AdamW`` on fp32 master
copies of a full replica, written back to the bf16/fp16/fp32 params after every step.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers.checks import bits, param_copies
from helpers.dist import run_distributed
from helpers.models import (MLP_TOL, MixedMLP, MlpReference, mlp_config, mlp_loss,
                            mlp_train_step)
from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint, kernels
from shardopt.errors import GradientOrderError

TRITON = pytest.mark.skipif(not kernels.available(torch.device("cpu")),
                            reason="Triton is not installed")


# ------------------------------------------------------------ grads assigned by hand

def assigned_grad(step: int, rank: int, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return torch.randn(p.shape, generator=g).to(p.dtype)


def assigned_seed(step: int, rank: int, same_on_ranks: bool) -> int:
    return 100 * step + (0 if same_on_ranks else rank)


def assigned_grads_rank(rank: int, world_size: int, after_backward: bool,
                        grad_mode: str) -> dict[str, Any]:
    """``after_backward``: each step first runs a backward (of a loss that leaves out
    ``c``), whose grads the assignments then replace, as in torch. With grad_mode='torch'
    the backward has averaged p.grad already and an assignment replaces the average as it
    is (as with DDP), so every rank assigns the same grads there."""
    torch.manual_seed(0)
    model = MixedMLP()
    cfg = dataclasses.replace(mlp_config("torch", grad_mode=grad_mode),
                              overlap_grad_reduce=not after_backward)
    opt = DistributedOptimizer(model, cfg)
    after_step = []
    for step in range(3):
        if after_backward:
            mlp_loss(model, step, rank, 0, frozenset("c")).backward()
        same = after_backward and grad_mode == "torch"
        g = torch.Generator().manual_seed(assigned_seed(step, rank, same))
        for p in model.parameters():
            if not (step == 1 and p is model.c.weight):  # no grad anywhere: left alone
                p.grad = assigned_grad(step, rank, p, g)
            elif after_backward and grad_mode == "torch":
                p.grad = None  # the backward left one: dropped, as in torch
        opt.step()
        after_step.append({f: None if p.grad is None else p.grad.detach().clone()
                           for f, p in model.named_parameters()})
        opt.zero_grad()
    return {"params": param_copies(model), "after_step": after_step}


@pytest.mark.parametrize("after_backward,grad_mode", [
    (False, "torch"), (True, "torch"), (False, "buffer"), (True, "buffer")])
def test_grads_assigned_by_hand_are_stepped_with_as_torch_does(after_backward, grad_mode,
                                                               tmp_path):
    """``p.grad = g`` (grads from ``torch.autograd.grad`` or ``torch.func``, gradient
    surgery) is what ``step()`` takes: set where no backward averaged since the last step,
    averaged over the ranks as a backward's would be; set after a backward, it replaces
    its grads (it is not added to them). With grad_mode='torch' p.grad still holds what
    the step used afterwards, the same on every rank, as torch keeps it until zero_grad();
    with grad_mode='buffer' the step took it (None)."""
    results = run_distributed(assigned_grads_rank, 2, after_backward, grad_mode,
                              tmp_path=tmp_path)
    torch.manual_seed(0)
    model = MixedMLP()
    params = dict(model.named_parameters())
    masters = {f: p.detach().float().clone().requires_grad_(True) for f, p in params.items()}
    ref = torch.optim.AdamW(list(masters.values()), lr=2e-2, betas=(0.9, 0.95),
                            weight_decay=0.1)
    same = after_backward and grad_mode == "torch"
    used = []
    for step in range(3):
        grads: dict[str, torch.Tensor] = {}
        for rank in range(2):
            g = torch.Generator().manual_seed(assigned_seed(step, rank, same))
            for f, p in params.items():
                if not (step == 1 and p is model.c.weight):
                    one = assigned_grad(step, rank, p, g).float()
                    grads[f] = grads.get(f, 0) + one / 2
        for f, m in masters.items():
            m.grad = grads.get(f)
        used.append(grads)
        ref.step()
        with torch.no_grad():
            for f, p in params.items():
                p.copy_(masters[f])
    for res in results:
        for f, p in params.items():
            torch.testing.assert_close(res["params"][f], p.detach(), **MLP_TOL)
        for step, grads in enumerate(res["after_step"]):
            if grad_mode == "buffer":
                assert all(g is None for g in grads.values())
                continue
            assert grads.keys() == params.keys()
            for f, g in grads.items():
                assert (g is None) == (f not in used[step]), (f, step)
                if g is not None:
                    assert g.dtype == params[f].dtype
                    torch.testing.assert_close(g.float(), used[step][f], rtol=1e-2, atol=1e-3)
                    assert torch.equal(bits(g), bits(results[0]["after_step"][step][f]))


def assigned_after_reduction_rank(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MixedMLP()
    opt = DistributedOptimizer(model, mlp_config("torch", grad_mode="buffer"))
    mlp_loss(model, 0, rank, 0, frozenset()).backward()
    model.a.weight.grad = torch.ones_like(model.a.weight)
    before = param_copies(model)
    try:
        opt.step()
        error = None
    except GradientOrderError as e:
        error = str(e)
    unchanged = all(torch.equal(p, before[f]) for f, p in param_copies(model).items())
    model.a.weight.grad = None
    opt.step()
    return {"error": error, "unchanged": unchanged,
            "stepped": not torch.equal(model.a.weight, before["a.weight"])}


def test_grad_assigned_after_its_bucket_was_reduced_is_a_clear_error(tmp_path):
    """grad_mode='buffer' at DP 2: with reductions overlapping backward, a grad set by hand
    after the backward that reduced its bucket cannot replace the reduced one: step() says
    so and changes nothing (the same step then runs once the assignment is gone). At one
    rank nothing was reduced, and the assignment replaces the backward's gradient."""
    for res in run_distributed(assigned_after_reduction_rank, 2, tmp_path=tmp_path):
        assert res["error"] is not None and "'a.weight' was set by hand after a" in res["error"]
        assert "overlap_grad_reduce" not in res["error"]  # under DDP that trained on ~0 grads
        assert res["unchanged"] and res["stepped"]


def test_param_frozen_at_construction_then_unfrozen_is_a_clear_error():
    """``torch.optim.AdamW(model.parameters())`` trains a param unfrozen later; this optimizer
    laid out only the params trainable at construction and would silently never train it
    (its grad piling up in ``param.grad``). ``step()`` raises naming it, changing nothing."""
    torch.manual_seed(0)
    model = MixedMLP()
    model.b.weight.requires_grad_(False)
    opt = DistributedOptimizer(model, mlp_config("torch"))
    mlp_train_step(model, opt, 0, 0, [frozenset()])
    model.b.weight.requires_grad_(True)
    params = [h.device for h in opt.shard_state.held.values() if h.kind == "params"]
    held = [t.clone() for t in params]
    steps = dict(opt.param_steps)
    mlp_loss(model, 1, 0, 0, frozenset()).backward()
    with pytest.raises(ValueError, match=r"param 'b\.weight' was frozen .* built"):
        opt.step()
    assert opt.param_steps == steps
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(held, params))
    model.b.weight.requires_grad_(False)  # frozen again: fine
    model.b.weight.grad = None
    opt.step()
    assert all(n == 2 for f, n in opt.param_steps.items())
    # Unfrozen for an optimizer of its own: not this one's to train.
    for p in model.parameters():
        p.requires_grad_(p is model.b.weight)
    other = DistributedOptimizer(model, mlp_config("torch"))
    for p in model.parameters():
        p.requires_grad_(True)
    mlp_loss(model, 2, 0, 0, frozenset()).backward()
    opt.step()
    other.step()
    assert other.param_steps == {"b.weight": 1}


# ---------------------------------------------------------- params without grads

STEPS = 5


def skips_for(step: int, world_size: int, micro_batches: int) -> list[list[frozenset[str]]]:
    """Per rank and micro-batch, the modules left out of forward.

    step 1: ``b`` unused on every rank; step 2: ``c`` unused on rank 0 only (so it is
    averaged with zero when there are more ranks); step 3: ``b`` used only in rank 1's
    first micro-batch, under ``no_sync`` (it counts)."""
    out = [[frozenset()] * micro_batches for _ in range(world_size)]
    if step == 1:
        out = [[frozenset({"b"})] * micro_batches for _ in range(world_size)]
    elif step == 2:
        out[0] = [frozenset({"c"})] * micro_batches
    elif step == 3:
        out = [[frozenset({"b"})] * micro_batches for _ in range(world_size)]
        out[min(1, world_size - 1)][0] = frozenset()
    return out


def no_grad_rank(rank: int, world_size: int, kernel: str, clip: float | None,
                 micro_batches: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MixedMLP()
    opt = DistributedOptimizer(model, mlp_config(kernel, clip))
    history, moments, steps = [], [], []
    for step in range(STEPS):
        if step == 3:
            model.norm.requires_grad_(False)  # frozen after construction: never updated again
        mlp_train_step(model, opt, step, rank, skips_for(step, world_size, micro_batches)[rank])
        history.append(param_copies(model))
        moments.append({f"{s.fqn}@{s.range_param.start}": (opt.shard_state.view("exp_avg", s).clone(),
                                                             opt.shard_state.view("exp_avg_sq", s).clone())
                        for s in opt.shard_state.shards})
        steps.append(dict(opt.param_steps))
    return {"history": history, "moments": moments, "steps": steps}


@pytest.mark.parametrize("world_size,kernel,clip,micro", [
    (1, "torch", 0.5, 1), (2, "torch", 0.5, 2), (3, "torch", None, 1), (2, "triton", None, 2),
    (3, "triton", 0.5, 1), (1, "triton", None, 1)])
def test_param_without_grad_on_every_rank_is_left_alone(world_size, kernel, clip, micro,
                                                        tmp_path):
    if kernel == "triton" and not kernels.available(torch.device("cpu")):
        pytest.skip("no Triton for the CPU here (its interpreter needs TRITON_INTERPRET=1)")
    results = run_distributed(no_grad_rank, world_size, kernel, clip, micro, tmp_path=tmp_path)
    ref = MlpReference(mlp_config(kernel, clip))
    for step in range(STEPS):
        if step == 3:
            ref.model.norm.requires_grad_(False)
        ref.step(step, world_size, micro, skips_for(step, world_size, micro))
        for res in results:
            assert res["steps"][step] == ref.steps(), f"step counts after step {step}"
            for fqn, p in ref.params.items():
                torch.testing.assert_close(res["history"][step][fqn], p.detach(), **MLP_TOL,
                                           msg=lambda m, f=fqn, s=step: f"{f} after {s}: {m}")
    untouched = {1: ("b.weight", "b.bias"), 3: ("norm.weight", "norm.bias"),
                 4: ("norm.weight", "norm.bias")}
    for res in results:
        for step, fqns in untouched.items():
            for fqn in fqns:  # bit for bit: weights and this rank's moments
                assert torch.equal(bits(res["history"][step][fqn]),
                                   bits(res["history"][step - 1][fqn])), f"{fqn} at step {step}"
                for key, (m, v) in res["moments"][step].items():
                    if key.startswith(fqn + "@"):
                        old_m, old_v = res["moments"][step - 1][key]
                        assert torch.equal(m, old_m) and torch.equal(v, old_v), (fqn, step)
        assert res["steps"][-1]["b.weight"] == STEPS - 1
        assert res["steps"][-1]["norm.weight"] == 3
        assert res["steps"][-1]["c.weight"] == STEPS - (world_size == 1)  # rank 0 is all ranks
        for step in range(STEPS):
            for fqn, t in res["history"][step].items():
                assert torch.equal(bits(t), bits(results[0]["history"][step][fqn]))


def count_step_all_reduces(rank: int, world_size: int, kernel: str,
                           clip: float | None) -> list[int]:
    """``dist.all_reduce`` calls inside ``step()`` once the grads are reduced, per step."""
    torch.manual_seed(0)
    model = MixedMLP()
    opt = DistributedOptimizer(model, mlp_config(kernel, clip))
    calls = {"n": 0}
    original = dist.all_reduce

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    out = []
    for step in range(3):
        skip = frozenset({"b"}) if step == 1 and rank == 0 else frozenset()
        mlp_loss(model, step, rank, 0, skip).backward()  # reduces the grads as it ends
        dist.all_reduce = counted
        calls["n"] = 0
        try:
            opt.step()
        finally:
            dist.all_reduce = original
        opt.zero_grad()
        out.append(calls["n"])
    return out


@pytest.mark.parametrize("kernel,clip,expected", [("torch", 1.0, 1), ("torch", None, 1),
                                                  ("triton", None, 2)])
def test_grad_presence_rides_on_the_norm_all_reduce(kernel, clip, expected, tmp_path):
    """With the norm computed before the update, one all-reduce carries it and the flags;
    the Triton step without clipping sums the norm in the update, so the flags go first."""
    if kernel == "triton" and not kernels.available(torch.device("cpu")):
        pytest.skip("no Triton for the CPU here (its interpreter needs TRITON_INTERPRET=1)")
    for res in run_distributed(count_step_all_reduces, 2, kernel, clip, tmp_path=tmp_path):
        assert res == [expected] * 3


# ------------------------------------------------- per-param step counts, zero_grad

def resume_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Per-param step counts differ (a skipped step) when saved; resume is bit-identical."""
    def build() -> tuple[MixedMLP, DistributedOptimizer]:
        torch.manual_seed(0)
        model = MixedMLP()
        return model, DistributedOptimizer(model, mlp_config("torch", 0.5))

    def skips(step: int) -> list[frozenset[str]]:
        return skips_for(step, world_size, 1)[rank]

    model, opt = build()
    for step in range(3):
        mlp_train_step(model, opt, step, rank, skips(step))
    saved_steps = dict(opt.param_steps)
    checkpoint.save(root, model, opt, step=3)
    for step in range(3, 5):
        mlp_train_step(model, opt, step, rank, skips(step))
    model2, opt2 = build()
    with torch.no_grad():  # written before the load: the loaded weights win
        model2.a.weight.zero_()
    checkpoint.load(root, model2, opt2)
    loaded_steps = dict(opt2.param_steps)
    for step in range(3, 5):
        mlp_train_step(model2, opt2, step, rank, skips(step))
    return {"saved": saved_steps, "loaded": loaded_steps, "a": param_copies(model),
            "b": param_copies(model2), "steps": (dict(opt.param_steps), dict(opt2.param_steps))}


def test_checkpoint_round_trip_keeps_per_param_steps(tmp_path):
    root = tmp_path / "ckpt"
    results = run_distributed(resume_rank, 2, str(root), tmp_path=tmp_path)
    for res in results:
        assert res["saved"]["b.weight"] == 2 and res["saved"]["a.weight"] == 3
        assert res["loaded"] == res["saved"]
        assert res["steps"][0] == res["steps"][1]
        for fqn, t in res["a"].items():
            assert torch.equal(bits(t), bits(res["b"][fqn])), fqn
    params = json.loads((Path(checkpoint.latest(root)) / "manifest.json").read_text())["params"]
    assert {f: params[f]["step"] for f in results[0]["saved"]} == results[0]["saved"]


@TRITON
def test_every_param_with_a_grad_keeps_one_launch_per_buffer_and_group(monkeypatch):
    """The fast path stays the common case; a skipped param splits its group by step count
    (one launch per count), and the split tables are built once: later steps launch the
    very tables the first split step launched."""
    torch.manual_seed(0)
    model = MixedMLP()
    opt = DistributedOptimizer(model, mlp_config("triton"))
    launches: list[tuple[int, Any]] = []  # (step count, launch table) of each kernel launch
    real = kernels.adamw_

    def counted(table, *args, **kwargs):
        launches.append((kwargs["step"], table))
        return real(table, *args, **kwargs)

    def step(n: int, skip: frozenset[str] = frozenset()) -> tuple[list[int], dict[int, Any]]:
        launches.clear()
        mlp_train_step(model, opt, n, 0, [skip])
        return sorted(c for c, _ in launches), {id(t): t for _, t in launches}

    monkeypatch.setattr(kernels, "adamw_", counted)
    counts, tables = step(0)
    assert counts == [1, 1, 1] and len(tables) == 3  # one table each: bf16, fp32, fp16 buffers
    counts, split = step(1, frozenset({"b"}))  # b (bf16) has no gradient anywhere
    assert counts == [2, 2, 2] and len(split) == 3
    counts, tables = step(2)
    assert counts == [2, 3, 3, 3]  # b, then the rest
    assert split.keys() <= tables.keys() and len(tables) == 4  # step 1's three, and b's own
    counts, again = step(3)
    assert counts == [3, 4, 4, 4] and again.keys() == tables.keys()  # nothing built again
    assert opt.param_steps["b.weight"] == 3 and opt.param_steps["a.weight"] == 4


def _zero_grad_run(opt_of, set_to_none: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    opt = opt_of(model)
    for step in range(4):
        opt.zero_grad(set_to_none=set_to_none)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        y = model["a"](x) + (model["b"](x) if step == 0 else 0)  # b: a gradient once
        y.square().sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_set_to_none_false_steps_params_without_a_gradient_as_torch_does(set_to_none):
    """With zero_grad(set_to_none=False) torch keeps zero grads for params that had one, so
    AdamW keeps decaying and moving them by their moments; with None it leaves them alone."""
    cfg = dict(lr=1e-2, weight_decay=0.1)
    ours = _zero_grad_run(lambda m: DistributedOptimizer(m, OptimizerConfig(**cfg)), set_to_none)
    ref = _zero_grad_run(lambda m: torch.optim.AdamW(m.parameters(), **cfg), set_to_none)
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
