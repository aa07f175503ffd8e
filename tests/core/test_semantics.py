"""DistributedOptimizer in ordinary PyTorch use, against ``torch.optim.AdamW``.

* Weights written after construction (``load_state_dict``, ``zero_``, ``nn.init``, EMA
  copy-back; ``p.data.copy_`` with ``reload_model_params()``) are kept: a step at lr=0
  leaves them bit for bit, and training continues from them with the moments kept.
* Casting or moving the model after construction is a clear error naming the param.
* A param with no gradient on any rank (unused, frozen later) is not updated: weights,
  moments and its own step count stay, as ``torch.optim.AdamW`` does with ``grad=None``;
  one unused on some ranks only is averaged with zero.

The reference is ``torch.optim.AdamW`` on fp32 master copies of a full replica that sees
the whole global batch (each rank's loss / world size), written back to the
bf16/fp16/fp32 params after every step.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers.checks import bits
from helpers.dist import run_distributed
from shardopt import DistributedOptimizer, OptimizerConfig, ParamMovedError, checkpoint, kernels
from shardopt.sync import GradientOrderError

TRITON = pytest.mark.skipif(not kernels.available(torch.device("cpu")),
                            reason="Triton is not installed")
# bf16 params: a last-bit difference in the fp32 sums flips a bf16 rounding now and then.
TOL = dict(rtol=2e-2, atol=2e-3)


class Net(nn.Module):
    """bf16 and fp16 Linears, fp32 LayerNorm and Linear; ``skip`` leaves modules out."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8).to(torch.bfloat16)
        self.norm = nn.LayerNorm(8)
        self.b = nn.Linear(8, 8).to(torch.bfloat16)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 1).to(torch.float16)

    def forward(self, x: torch.Tensor, skip: frozenset[str] = frozenset()) -> torch.Tensor:
        h = self.norm(self.a(x.to(self.a.weight.dtype)).to(self.norm.weight.dtype))
        if "b" not in skip:
            h = h + self.b(h.to(self.b.weight.dtype)).to(h.dtype)
        if "c" not in skip:
            h = torch.tanh(self.c(h.to(self.c.weight.dtype)))
        return self.d(h.to(self.d.weight.dtype)).float().squeeze(-1)


def batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(5, 6, generator=g)
    return x, torch.sin(x.sum(-1))


def loss_of(model: Net, step: int, rank: int, micro: int, skip: frozenset[str]) -> torch.Tensor:
    x, y = batch(step, rank, micro)
    return F.mse_loss(model(x, skip), y)


def config(kernel: str, clip: float | None = None, overlap: bool = False,
           grad_mode: str = "torch") -> OptimizerConfig:
    return OptimizerConfig(lr=2e-2, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=clip,
                           bucket_numel=90, align_numel=4, step_kernel=kernel,
                           overlap_param_gather=overlap, grad_mode=grad_mode)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {fqn: p.detach().clone() for fqn, p in model.named_parameters()}


class Reference:
    """torch.optim.AdamW on fp32 masters of a full replica; ``skips[step][rank]`` as the ranks."""

    def __init__(self, cfg: OptimizerConfig) -> None:
        torch.manual_seed(0)
        self.model = Net()
        self.params = dict(self.model.named_parameters())
        self.masters = {f: p.detach().float().clone().requires_grad_(True)
                        for f, p in self.params.items()}
        self.cfg = cfg
        self.opt = torch.optim.AdamW(list(self.masters.values()), lr=cfg.lr, betas=cfg.betas,
                                     eps=cfg.eps, weight_decay=cfg.weight_decay)

    def step(self, step: int, world_size: int, micro_batches: int,
             skips: list[list[frozenset[str]]]) -> None:
        grads: dict[str, torch.Tensor] = {}
        for rank in range(world_size):
            for micro in range(micro_batches):
                for p in self.params.values():
                    p.grad = None
                loss = loss_of(self.model, step, rank, micro, skips[rank][micro])
                (loss / micro_batches).backward()
                for f, p in self.params.items():
                    if p.grad is not None:
                        grads[f] = grads.get(f, 0) + p.grad.float() / world_size
        for f, m in self.masters.items():
            m.grad = grads.get(f)  # None on every rank: torch leaves the param alone
        if self.cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(list(self.masters.values()), self.cfg.max_grad_norm)
        self.opt.step()
        self.copy_back()

    def copy_back(self) -> None:
        with torch.no_grad():
            for f, p in self.params.items():
                p.copy_(self.masters[f])

    def steps(self) -> dict[str, int]:
        return {f: int(self.opt.state[m]["step"]) if m in self.opt.state else 0
                for f, m in self.masters.items()}


def train_step(model: Net, opt: DistributedOptimizer, step: int, rank: int,
               skips: list[frozenset[str]]) -> None:
    """One step; micro-batches but the last run under ``no_sync``."""
    for micro, skip in enumerate(skips):
        loss = loss_of(model, step, rank, micro, skip) / len(skips)
        if micro < len(skips) - 1:
            with opt.no_sync():
                loss.backward()
        else:
            loss.backward()
    opt.step()
    opt.zero_grad()


# ------------------------------------------------------------- written weights

def write_weights(model: Net, how: str, opt: DistributedOptimizer) -> None:
    """Set new weights the ways users do (the same on every rank)."""
    torch.manual_seed(123)
    fresh = Net()
    if how == "data":  # invisible to version counters: needs reload_model_params()
        for p, q in zip(model.parameters(), fresh.parameters()):
            p.data.copy_(q.data)
        opt.reload_model_params()
        return
    model.load_state_dict(fresh.state_dict())
    assert not opt.param_sync.handles  # it waited for gathers still in flight before writing
    ema = {f: p.detach() * 0.5 + 0.25 for f, p in model.c.named_parameters()}
    with torch.no_grad():
        model.a.weight.zero_()
        nn.init.normal_(model.b.weight, std=0.3)
        model.d.bias.fill_(0.75)
        for f, p in model.c.named_parameters():
            p.copy_(ema[f])  # EMA copy-back


def written_weights_rank(rank: int, world_size: int, kernel: str, how: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    opt = DistributedOptimizer(model, config(kernel, overlap=how == "overlap"))
    no_skip = [frozenset()]
    for step in range(2):  # main params now hold more than the bf16 weights do
        train_step(model, opt, step, rank, no_skip)
    write_weights(model, how, opt)
    written = snapshot(model)
    for g in opt.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    train_step(model, opt, 2, rank, no_skip)
    opt.finish_param_sync()
    kept = snapshot(model)
    for g in opt.param_groups:
        g["lr"], g["weight_decay"] = 2e-2, 0.1
    history = []
    for step in range(3, 6):
        train_step(model, opt, step, rank, no_skip)
        opt.finish_param_sync()
        history.append(snapshot(model))
    return {"written": written, "kept": kept, "history": history,
            "steps": dict(opt.param_steps)}


@pytest.mark.parametrize("world_size,kernel,how", [
    (1, "torch", "inplace"), (2, "torch", "inplace"), (3, "torch", "inplace"),
    (2, "triton", "inplace"), (2, "torch", "data"), (3, "triton", "data"),
    (2, "torch", "overlap")])
def test_weights_written_after_construction_are_kept(world_size, kernel, how, tmp_path):
    if kernel == "triton" and not kernels.available(torch.device("cpu")):
        pytest.skip("no Triton for the CPU here (its interpreter needs TRITON_INTERPRET=1)")
    results = run_distributed(written_weights_rank, world_size, kernel, how, tmp_path=tmp_path)
    for res in results:
        for fqn, want in res["written"].items():
            assert torch.equal(bits(res["kept"][fqn]), bits(want)), (
                f"{fqn}: a step at lr=0 changed the weight the user wrote")
            assert torch.equal(bits(res["history"][-1][fqn]), bits(results[0]["history"][-1][fqn]))
        assert set(res["steps"].values()) == {6}
    if how != "data":
        assert not results[0]["written"]["a.weight"].any()

    ref = Reference(config(kernel))
    for step in range(2):
        ref.step(step, world_size, 1, [[frozenset()]] * world_size)
    with torch.no_grad():  # what the ranks wrote, into the masters (moments are kept)
        for f, m in ref.masters.items():
            m.copy_(results[0]["written"][f])
    ref.copy_back()
    lr = [g["lr"] for g in ref.opt.param_groups]
    for g in ref.opt.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    ref.step(2, world_size, 1, [[frozenset()]] * world_size)
    for g, old in zip(ref.opt.param_groups, lr):
        g["lr"], g["weight_decay"] = old, 0.1
    for i, step in enumerate(range(3, 6)):
        ref.step(step, world_size, 1, [[frozenset()]] * world_size)
        for fqn, p in ref.params.items():
            torch.testing.assert_close(results[0]["history"][i][fqn], p.detach(), **TOL,
                                       msg=lambda m, f=fqn, s=step: f"{f} after step {s}: {m}")


def saved_after_write_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    opt = DistributedOptimizer(model, config("torch"))
    for step in range(2):
        train_step(model, opt, step, rank, [frozenset()])
    write_weights(model, "inplace", opt)  # and save before the next step
    checkpoint.save(root, model, opt, step=2)
    torch.save(opt.state_dict(), f"{root}-sd-{rank}.pt")
    written = snapshot(model)
    for step in range(2, 4):
        train_step(model, opt, step, rank, [frozenset()])
    resumed = {}
    for how in ("checkpoint", "state_dict"):
        torch.manual_seed(0)
        model2 = Net()
        opt2 = DistributedOptimizer(model2, config("torch"))
        if how == "checkpoint":
            checkpoint.load(root, model2, opt2)
        else:
            model2.load_state_dict(written)
            opt2.load_state_dict(torch.load(f"{root}-sd-{rank}.pt", weights_only=True))
        at_load = snapshot(model2)
        for step in range(2, 4):
            train_step(model2, opt2, step, rank, [frozenset()])
        resumed[how] = (at_load, snapshot(model2))
    return {"written": written, "after": snapshot(model), "resumed": resumed}


def test_weights_written_then_saved_before_the_next_step_are_what_resumes(tmp_path):
    """Weights written after the last step (pretrained weights loaded after building the
    optimizer, say) and saved before the next one: the checkpoint and ``state_dict()``
    hold them as main params (not the stale ones), so a resume starts from them and
    continues bit for bit."""
    results = run_distributed(saved_after_write_rank, 2, str(tmp_path), tmp_path=tmp_path)
    for res in results:
        for how, (at_load, after) in res["resumed"].items():
            for fqn, want in res["written"].items():
                assert torch.equal(bits(at_load[fqn]), bits(want)), (how, fqn)
            for fqn, want in res["after"].items():
                assert torch.equal(bits(after[fqn]), bits(want)), (how, fqn)


# ----------------------------------------------------------------- moved model

@pytest.mark.parametrize("move", ["float", "double", "half"])
def test_cast_model_is_a_clear_error_naming_the_param(move):
    """The first backward after the cast raises at the first moved param, naming what
    differs, before its gradient reaches the grad buffer (a grad of another dtype or shape
    would be cast or refused there); step() and reload_model_params() raise too, and the
    params and main params are as they were."""
    torch.manual_seed(0)
    model = Net()
    opt = DistributedOptimizer(model, config("torch"))
    train_step(model, opt, 0, 0, [frozenset()])
    held = [t.clone() for t in opt.buffers.param_buffers + [m for m in opt.main_params if m is not None]]
    steps = dict(opt.param_steps)
    {"float": model.float, "double": lambda: model.to(torch.float64), "half": model.half}[move]()
    # d (fp16) is first to get a gradient; "half" leaves it as it was and moves a, b, c.
    first = "d.bias" if move != "half" else "c.bias"
    differs = {"float": "it is torch.float32 (the optimizer holds it as torch.float16)",
               "double": "it is torch.float64 (the optimizer holds it as torch.float16)",
               "half": "it is torch.float16 (the optimizer holds it as torch.float32)"}[move]
    with pytest.raises(ParamMovedError, match=rf"param '{first}' no longer lives in the "
                       rf"optimizer's buffer: {re.escape(differs)}"):
        loss_of(model, 1, 0, 0, frozenset()).backward()
    opt.zero_grad()  # allowed: it does not depend on where the params live
    with pytest.raises(ParamMovedError, match=r"param 'a\.weight' no longer lives in the "
                       r"optimizer's buffer.*then build the optimizer"):
        opt.step()
    with pytest.raises(ParamMovedError, match=r"'a\.weight'"):
        opt.reload_model_params()
    assert opt.param_steps == steps  # the failed step changed nothing
    now = opt.buffers.param_buffers + [m for m in opt.main_params if m is not None]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(held, now))


@pytest.mark.cuda
def test_model_moved_to_cuda_is_a_clear_error():
    model = nn.Linear(4, 3)
    opt = DistributedOptimizer(model, OptimizerConfig())
    model.cuda()
    with pytest.raises(ParamMovedError, match=r"param '(weight|bias)' no longer lives .* it "
                       r"is on cuda:0 \(the optimizer holds it on cpu\)"):
        model(torch.ones(2, 4, device="cuda")).sum().backward()
    with pytest.raises(ParamMovedError, match=r"param 'weight' no longer lives .* on cuda"):
        opt.step()


def test_fp32_model_float_is_a_no_op_and_keeps_training():
    model = nn.Linear(4, 3)
    opt = DistributedOptimizer(model, OptimizerConfig(lr=0.1))
    model.float()  # already fp32: same storage, nothing moved
    model(torch.ones(2, 4)).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    assert not torch.equal(model.weight.detach(), before)


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
    model = Net()
    cfg = dataclasses.replace(config("torch", grad_mode=grad_mode),
                              overlap_grad_reduce=not after_backward)
    opt = DistributedOptimizer(model, cfg)
    after_step = []
    for step in range(3):
        if after_backward:
            loss_of(model, step, rank, 0, frozenset("c")).backward()
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
    return {"params": snapshot(model), "after_step": after_step}


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
    model = Net()
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
            torch.testing.assert_close(res["params"][f], p.detach(), **TOL)
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
    model = Net()
    opt = DistributedOptimizer(model, config("torch", grad_mode="buffer"))
    loss_of(model, 0, rank, 0, frozenset()).backward()
    model.a.weight.grad = torch.ones_like(model.a.weight)
    before = snapshot(model)
    try:
        opt.step()
        error = None
    except GradientOrderError as e:
        error = str(e)
    unchanged = all(torch.equal(p, before[f]) for f, p in snapshot(model).items())
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
    model = Net()
    model.b.weight.requires_grad_(False)
    opt = DistributedOptimizer(model, config("torch"))
    train_step(model, opt, 0, 0, [frozenset()])
    model.b.weight.requires_grad_(True)
    held = [t.clone() for t in opt.buffers.param_buffers]
    steps = dict(opt.param_steps)
    loss_of(model, 1, 0, 0, frozenset()).backward()
    with pytest.raises(ValueError, match=r"param 'b\.weight' was frozen .* built"):
        opt.step()
    assert opt.param_steps == steps
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(held, opt.buffers.param_buffers))
    model.b.weight.requires_grad_(False)  # frozen again: fine
    model.b.weight.grad = None
    opt.step()
    assert all(n == 2 for f, n in opt.param_steps.items())
    # Unfrozen for an optimizer of its own: not this one's to train.
    for p in model.parameters():
        p.requires_grad_(p is model.b.weight)
    other = DistributedOptimizer(model, config("torch"))
    for p in model.parameters():
        p.requires_grad_(True)
    loss_of(model, 2, 0, 0, frozenset()).backward()
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
    model = Net()
    opt = DistributedOptimizer(model, config(kernel, clip))
    history, moments, steps = [], [], []
    for step in range(STEPS):
        if step == 3:
            model.norm.requires_grad_(False)  # frozen after construction: never updated again
        train_step(model, opt, step, rank, skips_for(step, world_size, micro_batches)[rank])
        history.append(snapshot(model))
        moments.append({f"{s.fqn}@{s.range_param.start}": (opt.state_view("exp_avg", s).clone(),
                                                             opt.state_view("exp_avg_sq", s).clone())
                        for s in opt.shards})
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
    ref = Reference(config(kernel, clip))
    for step in range(STEPS):
        if step == 3:
            ref.model.norm.requires_grad_(False)
        ref.step(step, world_size, micro, skips_for(step, world_size, micro))
        for res in results:
            assert res["steps"][step] == ref.steps(), f"step counts after step {step}"
            for fqn, p in ref.params.items():
                torch.testing.assert_close(res["history"][step][fqn], p.detach(), **TOL,
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
    model = Net()
    opt = DistributedOptimizer(model, config(kernel, clip))
    calls = {"n": 0}
    original = dist.all_reduce

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    out = []
    for step in range(3):
        skip = frozenset({"b"}) if step == 1 and rank == 0 else frozenset()
        loss_of(model, step, rank, 0, skip).backward()
        opt.finish_grad_sync()
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


# -------------------------------------------------------------------- checkpoints

def resume_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Per-param step counts differ (a skipped step) when saved; resume is bit-identical."""
    def build() -> tuple[Net, DistributedOptimizer]:
        torch.manual_seed(0)
        model = Net()
        return model, DistributedOptimizer(model, config("torch", 0.5))

    def skips(step: int) -> list[frozenset[str]]:
        return skips_for(step, world_size, 1)[rank]

    model, opt = build()
    for step in range(3):
        train_step(model, opt, step, rank, skips(step))
    saved_steps = dict(opt.param_steps)
    checkpoint.save(root, model, opt, step=3)
    for step in range(3, 5):
        train_step(model, opt, step, rank, skips(step))
    model2, opt2 = build()
    with torch.no_grad():  # written before the load: the loaded weights win
        model2.a.weight.zero_()
    checkpoint.load(root, model2, opt2)
    loaded_steps = dict(opt2.param_steps)
    for step in range(3, 5):
        train_step(model2, opt2, step, rank, skips(step))
    return {"saved": saved_steps, "loaded": loaded_steps, "a": snapshot(model),
            "b": snapshot(model2), "steps": (dict(opt.param_steps), dict(opt2.param_steps))}


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
    (one launch per count), and the split tables are built once."""
    torch.manual_seed(0)
    model = Net()
    opt = DistributedOptimizer(model, config("triton"))
    counts: list[int] = []
    real = kernels.adamw_

    def counted(*args, **kwargs):
        counts.append(kwargs["step"])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "adamw_", counted)
    train_step(model, opt, 0, 0, [frozenset()])
    assert len(opt._update.chunk_tables) == 3 and counts == [1, 1, 1]  # bf16, fp32, fp16 buffers
    assert not opt._update._subset_tables
    counts.clear()
    train_step(model, opt, 1, 0, [frozenset({"b"})])  # b (bf16) has no gradient anywhere
    assert sorted(counts) == [2, 2, 2]
    for step in (2, 3):
        counts.clear()
        train_step(model, opt, step, 0, [frozenset()])
        assert sorted(counts) == [step, step + 1, step + 1, step + 1]  # b, then the rest
    assert len(opt._update._subset_tables) == 4  # step 1's three, and b's own from step 2 on
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


def broadcast_weights_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Every rank draws its own weights (a bf16 and an fp32 param among them) and builds the
    optimizer; rank 0's weights are then broadcast into the params with torch.distributed,
    which bumps no version counter, before the first step."""
    torch.manual_seed(rank)
    model = Net()
    opt = DistributedOptimizer(model, config("torch"))
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, 0)
    sent = snapshot(model)
    for g in opt.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    train_step(model, opt, 0, rank, [frozenset()])
    return {"sent": sent, "after": snapshot(model),
            "dtypes": {f: str(p.dtype) for f, p in model.named_parameters()}}


@pytest.mark.parametrize("world_size", [2, 3])
def test_weights_broadcast_before_the_first_step_are_kept(world_size, tmp_path):
    """The first step re-seeds every main param from its param: rank 0's broadcast weights
    survive it on every rank (no rank's part reverts to that rank's own initial draws)."""
    results = run_distributed(broadcast_weights_rank, world_size, tmp_path=tmp_path)
    assert {"torch.bfloat16", "torch.float32"} <= set(results[0]["dtypes"].values())
    for res in results:
        for fqn, want in results[0]["sent"].items():
            assert torch.equal(bits(res["sent"][fqn]), bits(want)), fqn
            assert torch.equal(bits(res["after"][fqn]), bits(want)), (
                f"{fqn}: a step at lr=0 changed the broadcast weight")


def optimizer_then_model_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """An optimizer state saved two steps before the weights: loaded first, then the newer
    weights over it, as docs/optimizer.md says to put an optimizer state under other weights."""
    torch.manual_seed(0)
    model = Net()
    opt = DistributedOptimizer(model, config("torch"))
    for step in range(2):
        train_step(model, opt, step, rank, [frozenset()])
    torch.save(opt.state_dict(), f"{root}-older-{rank}.pt")
    older_moment = {f: s["exp_avg"].local.clone() for f, s in opt.state_dict()["state"].items()}
    for step in range(2, 4):
        train_step(model, opt, step, rank, [frozenset()])
    newer = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    model2 = Net()
    opt2 = DistributedOptimizer(model2, config("torch"))
    opt2.load_state_dict(torch.load(f"{root}-older-{rank}.pt", weights_only=True))
    model2.load_state_dict(newer)
    loaded_moment = {f: s["exp_avg"].local.clone()
                     for f, s in opt2.state_dict()["state"].items()}
    for g in opt2.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    train_step(model2, opt2, 4, rank, [frozenset()])
    return {"newer": snapshot(model), "after": snapshot(model2), "older_moment": older_moment,
            "loaded_moment": loaded_moment}


def test_optimizer_loaded_first_then_other_weights_keeps_the_weights(tmp_path):
    """``opt.load_state_dict`` sets the weights from the dict's main params; weights loaded
    into the model after it are what trains on (a step at lr=0 keeps them bit for bit), and
    the moments are the loaded ones (compared before that step, which updates them)."""
    results = run_distributed(optimizer_then_model_rank, 2, str(tmp_path / "sd"),
                              tmp_path=tmp_path)
    for res in results:
        for fqn, want in res["newer"].items():
            assert torch.equal(bits(res["after"][fqn]), bits(want)), fqn
        assert res["older_moment"].keys() == res["loaded_moment"].keys()
        for fqn, want in res["older_moment"].items():
            assert torch.equal(res["loaded_moment"][fqn], want), fqn
