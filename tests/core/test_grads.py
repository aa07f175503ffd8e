"""``grad_mode="torch"`` (the default): ``p.grad`` after backward as with DDP +
``torch.optim.AdamW``, against that reference.

* DP 2: the same loop (user ``clip_grad_norm_`` on ``p.grad``, ``p.grad`` edits and
  ``p.grad = None``, 2 micro-batches under ``no_sync``, a second backward without it,
  ``zero_grad(set_to_none=False)``) with shardopt and with DDP + ``torch.optim.AdamW``
  (fused, the kernel shardopt's torch step runs): grads after every backward, clip norms
  and params equal bit for bit.
* DP 1: ``GradScaler`` with fp16 autocast, overflow steps skipped; what code does to
  ``p.grad`` (``model.zero_grad()`` to drop a micro-batch, ``clamp_``, a post-accumulate
  hook); bf16 params with fp32 grads sum micro-batches in fp32 and show p.grad in bf16.
* ``grad_mode="buffer"``: a second backward at DP 2 raises naming what to do; a
  post-accumulate hook registered after the optimizer raises.
* The small ones: ``WORLD_SIZE`` without a process group, a param resized
  (``resize_token_embeddings``) or replaced after construction, ``FlatShard.to``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers.checks import bits
from helpers.dist import run_distributed
from helpers.models import FP32_TOL
from shardopt import DistributedOptimizer, FlatShard, OptimizerConfig, ParamMovedError
from shardopt.errors import GradientOrderError, ProcessGroupError, UsageError

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).squeeze(-1)


def data(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    x = torch.randn(4, 6, generator=g)
    return x, torch.sin(3 * x.sum(-1))


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {f: None if p.grad is None else p.grad.detach().clone()
            for f, p in model.named_parameters()}


def loop(model: nn.Module, opt: Any, no_sync: Any, rank: int,
         forward: Any = None) -> dict[str, Any]:
    """The loop a user (or a framework) writes; ``no_sync`` is DDP's or the optimizer's,
    ``forward`` the DDP wrapper (default: ``model``)."""
    forward = forward or model
    out: dict[str, Any] = {"grads": [], "norms": [], "params": []}
    for step in range(5):
        loss_fn = torch.nn.functional.mse_loss
        if step == 1:  # two micro-batches, the first under no_sync
            with no_sync():
                (loss_fn(forward(data(step, rank, 0)[0]), data(step, rank, 0)[1]) / 2).backward()
            out["grads"].append(grads_of(model))
            (loss_fn(forward(data(step, rank, 1)[0]), data(step, rank, 1)[1]) / 2).backward()
        elif step == 2:  # a second backward without no_sync: accumulates, as with DDP
            for micro in range(2):
                x, y = data(step, rank, micro)
                (loss_fn(forward(x), y) / 2).backward()
        else:
            x, y = data(step, rank, 0)
            loss_fn(forward(x), y).backward()
        out["grads"].append(grads_of(model))
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)))
        if step == 3:  # edits after backward: taken by step(), as torch's optimizers take them
            model.b.weight.grad.mul_(-1.0)
            model.a.bias.grad = None  # left alone this step
            model.c.bias.grad = torch.full_like(model.c.bias, 0.25)
        opt.step()
        out["params"].append({f: p.detach().clone() for f, p in model.named_parameters()})
        opt.zero_grad(set_to_none=step != 0)
    return out


def ddp_rank(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    ours_model = Net()
    ref_model = copy.deepcopy(ours_model)
    opt = DistributedOptimizer(ours_model, OptimizerConfig(**HYPER, bucket_numel=200,
                                                           align_numel=4))
    ours = loop(ours_model, opt, opt.no_sync, rank)
    ddp = nn.parallel.DistributedDataParallel(ref_model, bucket_cap_mb=1e-3)
    ref = loop(ref_model, torch.optim.AdamW(ref_model.parameters(), **HYPER, fused=True),
               ddp.no_sync, rank, ddp)
    return {"ours": ours, "ref": ref}


def test_p_grad_matches_ddp_with_clipping_edits_and_accumulation(tmp_path):
    for res in run_distributed(ddp_rank, 2, tmp_path=tmp_path):
        ours, ref = res["ours"], res["ref"]
        assert ours["norms"] == ref["norms"]
        assert len(ours["grads"]) == len(ref["grads"]) == 6
        for i, (got, want) in enumerate(zip(ours["grads"], ref["grads"])):
            for fqn, w in want.items():
                assert (got[fqn] is None) == (w is None), (i, fqn)
                assert w is None or torch.equal(bits(got[fqn]), bits(w)), (i, fqn)
        for step, (got, want) in enumerate(zip(ours["params"], ref["params"])):
            for fqn, w in want.items():  # the same fused AdamW kernel: bit for bit
                assert torch.equal(bits(got[fqn]), bits(w)), (step, fqn)


def no_sync_only_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Every micro-batch under no_sync(), then step(): p.grad holds this rank's sum until
    step() averages it (DDP would step on unaveraged grads)."""
    torch.manual_seed(0)
    model = Net()
    opt = DistributedOptimizer(model, OptimizerConfig(**HYPER))
    local, used = [], []
    for step in range(3):
        with opt.no_sync():
            for micro in range(2):
                x, y = data(step, rank, micro)
                (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
        local.append(grads_of(model))
        opt.step()
        used.append(grads_of(model))
        opt.zero_grad()
    return {"local": local, "used": used,
            "params": {f: p.detach().clone() for f, p in model.named_parameters()}}


def test_micro_batches_all_under_no_sync_are_averaged_by_step(tmp_path):
    results = run_distributed(no_sync_only_rank, 2, tmp_path=tmp_path)
    torch.manual_seed(0)
    model = Net()
    ref = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
    for step in range(3):
        for fqn, p in model.named_parameters():
            p.grad = results[0]["local"][step][fqn] / 2 + results[1]["local"][step][fqn] / 2
        ref.step()
        for res in results:
            for fqn, p in model.named_parameters():
                assert torch.equal(bits(res["used"][step][fqn]), bits(p.grad)), (step, fqn)
    assert not torch.equal(results[0]["local"][0]["a.weight"], results[1]["local"][0]["a.weight"])
    for res in results:
        for fqn, p in model.named_parameters():
            assert torch.equal(bits(res["params"][fqn]), bits(p.detach())), fqn


def buffer_second_backward_rank(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    opt = DistributedOptimizer(model, OptimizerConfig(**HYPER, grad_mode="buffer"))
    x, y = data(0, rank, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
        return {"error": None}
    except GradientOrderError as e:
        return {"error": str(e)}


def test_buffer_mode_second_backward_at_dp2_says_what_to_do(tmp_path):
    for res in run_distributed(buffer_second_backward_rank, 2, tmp_path=tmp_path):
        assert res["error"] is not None
        for needle in ("second backward before step()", "optimizer.no_sync()",
                       "grad_mode='torch'", "gradient_accumulation_steps"):
            assert needle in res["error"], res["error"]


# ------------------------------------------------------------------------ DP 1

def scaler_run(make_opt) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    opt = make_opt(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=2)
    scales = []
    for step in range(6):
        x, y = data(step, 0, 0)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()] + [torch.tensor(scales)]


def test_grad_scaler_with_fp16_autocast_matches_torch():
    ours = scaler_run(lambda m: DistributedOptimizer(m, OptimizerConfig(**HYPER)))
    ref = scaler_run(lambda m: torch.optim.AdamW(m.parameters(), **HYPER))
    assert torch.equal(ours[-1], ref[-1])
    assert ref[-1][0] < 2.0 ** 24  # the first steps overflowed and were skipped
    for got, want in zip(ours[:-1], ref[:-1]):
        torch.testing.assert_close(got, want, **FP32_TOL)


def edits_run(make_opt) -> list[torch.Tensor]:
    """Code that edits p.grad: a hook added after the optimizer, model.zero_grad() to drop a
    micro-batch, clamp_ behind an ``if p.grad is not None``, p.grad = None for a layer."""
    torch.manual_seed(0)
    model = Net()
    opt = make_opt(model)
    def halve(p: torch.Tensor) -> None:
        p.grad.mul_(0.5)

    model.b.bias.register_post_accumulate_grad_hook(halve)
    for step in range(4):
        x, y = data(step, 0, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        model.zero_grad()  # dropped
        x, y = data(step, 0, 1)
        torch.nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.clamp_(-0.05, 0.05)
        if step == 2:
            model.a.weight.grad = None
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return [p.detach().clone() for p in model.parameters()]


def test_code_that_edits_p_grad_works_as_with_torch():
    ours = edits_run(lambda m: DistributedOptimizer(m, OptimizerConfig(**HYPER)))
    ref = edits_run(lambda m: torch.optim.AdamW(m.parameters(), **HYPER))
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, **FP32_TOL)


def test_bf16_params_with_fp32_grads_sum_micro_batches_in_fp32():
    """p.grad is bf16 (the param's dtype), the fp32 sum of the micro-batches rounded once;
    an edit of p.grad between micro-batches is what the sum continues from."""
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    twin = copy.deepcopy(model)
    opt = DistributedOptimizer(model, OptimizerConfig(**HYPER, grad_dtype=torch.float32))
    sums: dict[str, torch.Tensor] = {}
    for micro in range(3):
        x, _ = data(0, 0, micro)
        model(x.bfloat16()).float().square().mean().backward()
        twin.zero_grad()
        twin(x.bfloat16()).float().square().mean().backward()
        for f, p in twin.named_parameters():
            sums[f] = sums.get(f, 0) + p.grad.float()
        if micro == 0:
            model.b.weight.grad.mul_(2)
            sums["b.weight"] = sums["b.weight"] * 2
        for f, p in model.named_parameters():
            assert p.grad.dtype == torch.bfloat16
            assert torch.equal(bits(p.grad), bits(sums[f].bfloat16())), (micro, f)
    opt.step()  # with the rounded p.grad: what it holds
    assert opt.param_steps["a.weight"] == 1


def test_buffer_mode_refuses_a_post_accumulate_hook_added_later():
    model = Net()
    opt = DistributedOptimizer(model, OptimizerConfig(grad_mode="buffer"))
    model.c.bias.register_post_accumulate_grad_hook(lambda p: None)
    x, y = data(0, 0, 0)
    with pytest.raises(UsageError, match=r"'c\.bias' has a post-accumulate-grad hook"):
        torch.nn.functional.mse_loss(model(x), y).backward()
    assert opt.param_steps["c.bias"] == 0


# -------------------------------------------------------------------- the small ones

def test_world_size_without_a_process_group_is_refused(monkeypatch):
    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ProcessGroupError, match=r"WORLD_SIZE=2 .*init_process_group"):
        DistributedOptimizer(Net())
    monkeypatch.setenv("WORLD_SIZE", "1")
    DistributedOptimizer(Net())


def test_resize_token_embeddings_after_construction_raises_before_backward_writes():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                     n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    opt = DistributedOptimizer(model, OptimizerConfig())
    model.resize_token_embeddings(80)
    ids = torch.randint(64, (2, 8))
    with pytest.raises(ParamMovedError, match=r"'transformer\.wte\.weight' .*its shape is "
                                              r"\(80, 16\) \(the optimizer holds \(64, 16\)\)"):
        model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(ParamMovedError, match="transformer.wte.weight"):
        opt.step()


def test_param_or_module_replaced_after_construction_is_named():
    model = Net()
    opt = DistributedOptimizer(model, OptimizerConfig())
    old = model.b.weight
    model.b.weight = nn.Parameter(torch.zeros(16, 16))
    x, y = data(0, 0, 0)
    with pytest.raises(ParamMovedError, match=r"param 'b\.weight' was replaced by a new "
                                              r"Parameter"):
        torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(ParamMovedError, match=r"'b\.weight'"):
        opt.step()
    model.b.weight = old  # back: fine
    opt.zero_grad()
    model.c = nn.Linear(16, 1)
    with pytest.raises(ParamMovedError, match=r"module 'c' was replaced"):
        opt.step()


def test_param_moved_error_says_storage_when_dtype_and_device_match():
    model = Net()
    opt = DistributedOptimizer(model, OptimizerConfig())
    model.a.weight.data = model.a.weight.detach().clone()
    with pytest.raises(ParamMovedError, match=r"'a\.weight' .*its storage was replaced "
                                              r"\(same dtype torch\.float32, device cpu"):
        opt.step()


def test_flat_shard_to_works_as_torch_to():
    opt = DistributedOptimizer(Net(), OptimizerConfig())
    shard = opt.state_dict()["state"]["a.weight"]["master_param"]
    assert shard.to("cpu") is shard and shard.to(torch.float32) is shard
    wide = shard.to(torch.float64)
    assert isinstance(wide, FlatShard) and wide.local.dtype == torch.float64
    assert (wide.offset, wide.shape) == (shard.offset, shard.shape)
    assert torch.equal(wide.local, shard.local.double())
    copied = shard.to("cpu", copy=True)
    assert copied is not shard and copied.local.data_ptr() != shard.local.data_ptr()
    assert shard.cpu() is shard
