"""Weights written into the model, and the model moved, after the optimizer was built.

* Weights written after construction (``load_state_dict``, ``zero_``, ``nn.init``, EMA
  copy-back; ``p.data.copy_`` with ``reload_model_params()``; a broadcast before the first
  step; a checkpoint's weights loaded over the optimizer's) are kept: a step at lr=0 leaves
  them bit for bit, and training continues from them with the moments kept.
* Casting or moving the model after construction is a clear error naming the param.

The reference (``helpers.models.MlpReference``) is ``torch.optim.AdamW`` on fp32 master
copies of a full replica that sees the whole global batch (each rank's loss / world size),
written back to the bf16/fp16/fp32 params after every step.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers.checks import bits, param_copies
from helpers.dist import run_distributed
from helpers.models import (MLP_TOL, MixedMLP, MlpReference, mlp_config, mlp_loss,
                            mlp_train_step)
from shardopt import DistributedOptimizer, OptimizerConfig, ParamMovedError, checkpoint, kernels

# ------------------------------------------------------------- written weights

def write_weights(model: MixedMLP, how: str, opt: DistributedOptimizer) -> None:
    """Set new weights the ways users do (the same on every rank)."""
    torch.manual_seed(123)
    fresh = MixedMLP()
    if how == "data":  # invisible to version counters: needs reload_model_params()
        for p, q in zip(model.parameters(), fresh.parameters()):
            p.data.copy_(q.data)
        opt.reload_model_params()
        return
    model.load_state_dict(fresh.state_dict())
    assert opt.shard_state.gathers_in_flight == 0  # it waited for them before writing
    ema = {f: p.detach() * 0.5 + 0.25 for f, p in model.c.named_parameters()}
    with torch.no_grad():
        model.a.weight.zero_()
        nn.init.normal_(model.b.weight, std=0.3)
        model.d.bias.fill_(0.75)
        for f, p in model.c.named_parameters():
            p.copy_(ema[f])  # EMA copy-back


def written_weights_rank(rank: int, world_size: int, kernel: str, how: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MixedMLP()
    opt = DistributedOptimizer(model, mlp_config(kernel, overlap=how == "overlap"))
    no_skip = [frozenset()]
    for step in range(2):  # main params now hold more than the bf16 weights do
        mlp_train_step(model, opt, step, rank, no_skip)
    write_weights(model, how, opt)
    written = param_copies(model)
    for g in opt.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    mlp_train_step(model, opt, 2, rank, no_skip)
    opt.shard_state.finish_param_sync()
    kept = param_copies(model)
    for g in opt.param_groups:
        g["lr"], g["weight_decay"] = 2e-2, 0.1
    history = []
    for step in range(3, 6):
        mlp_train_step(model, opt, step, rank, no_skip)
        opt.shard_state.finish_param_sync()
        history.append(param_copies(model))
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

    ref = MlpReference(mlp_config(kernel))
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
            torch.testing.assert_close(results[0]["history"][i][fqn], p.detach(), **MLP_TOL,
                                       msg=lambda m, f=fqn, s=step: f"{f} after step {s}: {m}")


def saved_after_write_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MixedMLP()
    opt = DistributedOptimizer(model, mlp_config("torch"))
    for step in range(2):
        mlp_train_step(model, opt, step, rank, [frozenset()])
    write_weights(model, "inplace", opt)  # and save before the next step
    checkpoint.save(root, model, opt, step=2)
    torch.save(opt.state_dict(), f"{root}-sd-{rank}.pt")
    written = param_copies(model)
    for step in range(2, 4):
        mlp_train_step(model, opt, step, rank, [frozenset()])
    resumed = {}
    for how in ("checkpoint", "state_dict"):
        torch.manual_seed(0)
        model2 = MixedMLP()
        opt2 = DistributedOptimizer(model2, mlp_config("torch"))
        if how == "checkpoint":
            checkpoint.load(root, model2, opt2)
        else:
            model2.load_state_dict(written)
            opt2.load_state_dict(torch.load(f"{root}-sd-{rank}.pt", weights_only=True))
        at_load = param_copies(model2)
        for step in range(2, 4):
            mlp_train_step(model2, opt2, step, rank, [frozenset()])
        resumed[how] = (at_load, param_copies(model2))
    return {"written": written, "after": param_copies(model), "resumed": resumed}


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
    model = MixedMLP()
    opt = DistributedOptimizer(model, mlp_config("torch"))
    mlp_train_step(model, opt, 0, 0, [frozenset()])
    held = [h.device.clone() for h in opt.shard_state.held.values()
            if h.kind in ("params", "main_params")]
    steps = dict(opt.param_steps)
    {"float": model.float, "double": lambda: model.to(torch.float64), "half": model.half}[move]()
    # d (fp16) is first to get a gradient; "half" leaves it as it was and moves a, b, c.
    first = "d.bias" if move != "half" else "c.bias"
    differs = {"float": "it is torch.float32 (the optimizer holds it as torch.float16)",
               "double": "it is torch.float64 (the optimizer holds it as torch.float16)",
               "half": "it is torch.float16 (the optimizer holds it as torch.float32)"}[move]
    with pytest.raises(ParamMovedError, match=rf"param '{first}' no longer lives in the "
                       rf"optimizer's buffer: {re.escape(differs)}"):
        mlp_loss(model, 1, 0, 0, frozenset()).backward()
    opt.zero_grad()  # allowed: it does not depend on where the params live
    with pytest.raises(ParamMovedError, match=r"param 'a\.weight' no longer lives in the "
                       r"optimizer's buffer.*then build the optimizer"):
        opt.step()
    with pytest.raises(ParamMovedError, match=r"'a\.weight'"):
        opt.reload_model_params()
    assert opt.param_steps == steps  # the failed step changed nothing
    now = [h.device for h in opt.shard_state.held.values() if h.kind in ("params", "main_params")]
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




# ---------------------------------------------------- weights set by other means

def broadcast_weights_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Every rank draws its own weights (a bf16 and an fp32 param among them) and builds the
    optimizer; rank 0's weights are then broadcast into the params with torch.distributed,
    which bumps no version counter, before the first step."""
    torch.manual_seed(rank)
    model = MixedMLP()
    opt = DistributedOptimizer(model, mlp_config("torch"))
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, 0)
    sent = param_copies(model)
    for g in opt.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    mlp_train_step(model, opt, 0, rank, [frozenset()])
    return {"sent": sent, "after": param_copies(model),
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
    model = MixedMLP()
    opt = DistributedOptimizer(model, mlp_config("torch"))
    for step in range(2):
        mlp_train_step(model, opt, step, rank, [frozenset()])
    torch.save(opt.state_dict(), f"{root}-older-{rank}.pt")
    older_moment = {f: s["exp_avg"].local.clone() for f, s in opt.state_dict()["state"].items()}
    for step in range(2, 4):
        mlp_train_step(model, opt, step, rank, [frozenset()])
    newer = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    model2 = MixedMLP()
    opt2 = DistributedOptimizer(model2, mlp_config("torch"))
    opt2.load_state_dict(torch.load(f"{root}-older-{rank}.pt", weights_only=True))
    model2.load_state_dict(newer)
    loaded_moment = {f: s["exp_avg"].local.clone()
                     for f, s in opt2.state_dict()["state"].items()}
    for g in opt2.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    mlp_train_step(model2, opt2, 4, rank, [frozenset()])
    return {"newer": param_copies(model), "after": param_copies(model2), "older_moment": older_moment,
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
