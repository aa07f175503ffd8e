"""DistributedOptimizer against ``torch.optim.AdamW`` on a full replica.

Every rank trains the same model on its own slice of a global batch; the
parent process replays the whole global batch through a plain model and
``torch.optim.AdamW`` and compares parameters after every step. Ranks also
return their params so the parent can check that they are bit-identical.

Each spawned scenario checks many things at once (clipping, param groups,
accumulation, scheduler, unused and tied params) to keep process starts down.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers.checks import bits, param_copies
from helpers.dist import device_for, require_world_size, run_distributed
from helpers.models import (FP32_TOL, MixedNet, Scenario, ToyLM, assert_matches_reference,
                            assert_ranks_identical, mixed_config, mixed_data, reference_run,
                            tol_for, train_rank)
from shardopt import DistributedOptimizer, OptimizerConfig, kernels


# ----------------------------------------------------------------- scenarios

@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_plain_adamw_matches_reference(backend, world_size, tmp_path):
    require_world_size(backend, world_size)
    sc = Scenario(world_size=world_size)
    results = run_distributed(train_rank, world_size, sc, backend, backend=backend,
                              tmp_path=tmp_path)
    assert_matches_reference(sc, results, tol_for(backend))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_features_match_reference(backend, world_size, overlap, tmp_path):
    """Clipping, decay groups, accumulation, cosine LR, tied, unused and partly used params."""
    require_world_size(backend, world_size)
    # eps comparable to the grads makes the update depend on their scale (AdamW with a
    # tiny eps barely notices a sum where a mean belongs).
    sc = Scenario(world_size=world_size, steps=6, micro_batches=2, max_grad_norm=0.5, eps=1e-3,
                  groups="no_decay", scheduler="cosine", tied=True, branch=True,
                  overlap_grad_reduce=overlap, bucket_numel=100 + 37 * world_size,
                  align_numel=world_size, seed=world_size)
    results = run_distributed(train_rank, world_size, sc, backend, backend=backend,
                              tmp_path=tmp_path)
    assert_matches_reference(sc, results, tol_for(backend))
    _, norms = reference_run(sc)
    assert any(n > sc.max_grad_norm for n in norms), "clipping never engaged; lower max_grad_norm"
    for res in results:
        assert res["tie_kept"]
        decay = {g["weight_decay"] for g in res["groups"] if "norm.weight" in g["fqns"]}
        assert decay == {0.0}


def test_param_groups_lr_override_and_lambda_scheduler(tmp_path):
    sc = Scenario(world_size=2, steps=4, groups="lr_override", scheduler="lambda",
                  max_grad_norm=1.0, bucket_numel=64, align_numel=1)
    results = run_distributed(train_rank, 2, sc, "gloo", tmp_path=tmp_path)
    assert_matches_reference(sc, results, FP32_TOL)
    groups = results[0]["groups"]
    by_fqn = {fqn: g for g in groups for fqn in g["fqns"]}
    assert by_fqn["emb.weight"]["lr"] == pytest.approx(3e-3 / (1 + 0))  # before any step
    assert by_fqn["emb.weight"]["betas"] == (0.8, 0.9)
    assert by_fqn["emb.weight"]["weight_decay"] == 0.1
    assert by_fqn["up.bias"]["weight_decay"] == 0.0 and by_fqn["up.bias"]["lr"] == 1e-2
    assert by_fqn["up.weight"]["weight_decay"] == 0.1 and by_fqn["up.weight"]["eps"] == 1e-8
    assert len(groups) == 3
    emb_group = next(i for i, g in enumerate(groups) if "emb.weight" in g["fqns"])
    assert results[0]["lrs"][-1][emb_group] == pytest.approx(3e-3 / 5)


def test_world_size_one_without_process_group():
    """In-process: no torch.distributed initialisation at all."""
    assert not dist.is_initialized()
    sc = Scenario(world_size=1, steps=4, micro_batches=3, max_grad_norm=0.5, groups="no_decay",
                  scheduler="cosine", tied=True, branch=True, bucket_numel=120)
    result = train_rank(0, 1, sc, None)
    assert not result["dist_initialized"]
    assert_matches_reference(sc, [result], FP32_TOL)


def test_world_size_one_with_process_group(backend, tmp_path):
    sc = Scenario(world_size=1, steps=3, tied=True, branch=True, overlap_grad_reduce=False)
    results = run_distributed(train_rank, 1, sc, backend, backend=backend, tmp_path=tmp_path)
    assert results[0]["dist_initialized"]
    assert_matches_reference(sc, results, tol_for(backend))


# ------------------------------------------------- communication behaviour

def count_collectives(rank: int, world_size: int, overlap: bool,
                      grad_mode: str) -> dict[str, Any]:
    """How many collectives backward issues, inside and outside ``no_sync``."""
    calls = {"n": 0}
    for name in ("all_reduce", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
                 "reduce_scatter", "broadcast"):
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            calls["n"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    sc = Scenario(world_size=world_size, bucket_numel=100, overlap_grad_reduce=overlap)
    model = sc.model()
    opt = DistributedOptimizer(model, dataclasses.replace(sc.config(), grad_mode=grad_mode))
    tokens, targets = sc.batches()
    out = {}
    opt.zero_grad()
    before = calls["n"]
    with opt.no_sync():
        model(tokens[0, 0, rank], targets[0, 0, rank], False).backward()
    out["no_sync_backward"] = calls["n"] - before
    before = calls["n"]
    model(tokens[1, 0, rank], targets[1, 0, rank], False).backward()
    out["sync_backward"] = calls["n"] - before
    out["grads_after_backward"] = {f: None if p.grad is None else p.grad.clone()
                                   for f, p in model.named_parameters()}
    before = calls["n"]
    opt.step()
    out["step"] = calls["n"] - before
    out["grads_freed"] = all(p.grad is None for p in model.parameters())
    return out


def test_no_sync_and_overlap_schedule(tmp_path):
    """grad_mode='buffer': a no_sync backward issues nothing; with overlap, backward itself
    starts reductions, without it step() does; p.grad is None throughout."""
    with_overlap = run_distributed(count_collectives, 2, True, "buffer", tmp_path=tmp_path)
    without = run_distributed(count_collectives, 2, False, "buffer", tmp_path=tmp_path)
    for res in with_overlap + without:
        assert res["no_sync_backward"] == 0
        assert res["step"] > 0
        assert res["grads_freed"]
        assert all(g is None for g in res["grads_after_backward"].values())
    assert all(res["sync_backward"] > 0 for res in with_overlap)
    assert all(res["sync_backward"] == 0 for res in without)


def test_torch_grad_mode_averages_p_grad_inside_backward(tmp_path):
    """grad_mode='torch': a no_sync backward issues nothing; any other backward returns with
    p.grad averaged over the ranks (reductions overlapping it, or at its end without
    overlap), equal on every rank; an unused param's p.grad stays None; step() keeps them."""
    for overlap in (True, False):
        results = run_distributed(count_collectives, 2, overlap, "torch", tmp_path=tmp_path)
        for res in results:
            assert res["no_sync_backward"] == 0
            assert res["sync_backward"] > 0
            assert not res["grads_freed"]
            grads = res["grads_after_backward"]
            assert grads["unused.weight"] is None and grads["emb.weight"] is not None
            for fqn, g in grads.items():
                other = results[0]["grads_after_backward"][fqn]
                assert (g is None) == (other is None), fqn
                if g is not None:
                    assert torch.equal(bits(g), bits(other)), fqn


# ------------------------------------------------------- mixed precision

MIXED_STEPS = 12


def triton_device() -> torch.device | None:
    """Where the Triton step can run here: the GPU, else the CPU under Triton's interpreter."""
    for device in (torch.device("cuda", 0), torch.device("cpu")):
        if (device.type == "cpu" or torch.cuda.is_available()) and kernels.available(device):
            return device
    return None


def train_mixed_rank(rank: int, world_size: int, backend: str | None,
                     config_overrides: dict[str, Any] | None = None,
                     device: torch.device | None = None) -> dict[str, Any]:
    device = device or device_for(backend, rank)
    torch.manual_seed(0)
    model = MixedNet().to(device)
    dtypes = {fqn: p.dtype for fqn, p in model.named_parameters()}
    opt = DistributedOptimizer(model, mixed_config(**(config_overrides or {})))
    x, y = mixed_data(world_size)
    # Each step's gradients as backward produced them (before the optimizer takes them), so
    # a reference can apply exactly these: on a GPU two backward passes over differently laid
    # out params may round a near-zero grad to opposite signs, and Adam turns that into +-lr.
    grads: list[dict[str, torch.Tensor]] = []
    for fqn, p in model.named_parameters():
        p.register_hook(lambda g, f=fqn: grads[-1].__setitem__(
            f, grads[-1][f] + g.detach().cpu() if f in grads[-1] else g.detach().cpu()))
    losses, history, dtypes_ok = [], [], True
    for _ in range(MIXED_STEPS):
        opt.zero_grad()
        grads.append({})
        loss = F.mse_loss(model(x[rank].to(device)), y[rank].to(device))
        loss.backward()
        opt.step()
        losses.append(loss.detach().item())
        history.append(param_copies(model))
        dtypes_ok &= all(p.dtype == dtypes[f] for f, p in model.named_parameters())
    return {"losses": losses, "history": history, "dtypes_ok": dtypes_ok, "dtypes": dtypes,
            "grads": grads}


@pytest.mark.parametrize("world_size,grad_dtype", [(1, torch.float32), (2, torch.float32),
                                                   (3, torch.float32), (2, torch.bfloat16)],
                         ids=["1-fp32_grads", "2-fp32_grads", "3-fp32_grads", "2-model_dtype_grads"])
def test_mixed_precision_trains_and_ranks_agree(backend, world_size, grad_dtype, tmp_path):
    require_world_size(backend, world_size)
    results = run_distributed(train_mixed_rank, world_size, backend,
                              {"grad_dtype": grad_dtype},
                              backend=backend, tmp_path=tmp_path)
    assert_ranks_identical(results)
    for res in results:
        assert res["dtypes_ok"]
        assert set(res["dtypes"].values()) == {torch.bfloat16, torch.float16, torch.float32}
        assert all(res["history"][-1][f].dtype == d for f, d in res["dtypes"].items())
    first = sum(r["losses"][0] for r in results) / world_size
    last = sum(r["losses"][-1] for r in results) / world_size
    assert last < 0.6 * first, f"loss did not fall: {first:.4f} -> {last:.4f}"


@pytest.mark.parametrize("step_kernel", ["torch", "triton"])
@pytest.mark.parametrize("max_grad_norm,steps", [(None, MIXED_STEPS), (1.0, 5)],
                         ids=["no_clip", "clip"])
def test_mixed_precision_single_rank_matches_fp32_master_reference(max_grad_norm, steps,
                                                                  step_kernel):
    """One rank: AdamW on fp32 master copies, written back to the bf16/fp16/fp32 params.

    Clipping computes the global norm in a different order than
    ``clip_grad_norm_``; the last-bit difference flips a bf16 rounding now and
    then, and after that the runs drift apart chaotically, so with clipping
    only the first steps are compared. The same holds for the Triton step, whose fp32
    arithmetic differs from torch's (which does part of it in double) in the last bit.
    """
    device = torch.device("cpu")
    if step_kernel == "triton":
        # Compiled Triton runs on a GPU; on the CPU only its interpreter does (TRITON_INTERPRET=1,
        # which conftest sets only where there is no GPU), so a GPU host runs this case there.
        device = triton_device()
        if device is None:
            pytest.skip("Triton is not installed, or no GPU and TRITON_INTERPRET is not 1")
        steps = min(steps, 5)
    result = train_mixed_rank(0, 1, None, {"max_grad_norm": max_grad_norm,
                                           "step_kernel": step_kernel}, device=device)

    torch.manual_seed(0)
    model = MixedNet().to(device)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    cfg = mixed_config(max_grad_norm=max_grad_norm)
    opt = torch.optim.AdamW(masters, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    names = [fqn for fqn, _ in model.named_parameters()]
    for step in range(steps):
        # The grads the optimizer got (see train_mixed_rank); an idle expert has none: skipped.
        recorded = result["grads"][step]
        for fqn, m in zip(names, masters):
            m.grad = recorded[fqn].to(device).float() if fqn in recorded else None
        if cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(masters, cfg.max_grad_norm)
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        got = result["history"][step]
        for fqn, p in model.named_parameters():
            assert got[fqn].dtype == p.dtype
            torch.testing.assert_close(got[fqn], p.detach().cpu(), msg=lambda m, f=fqn, s=step:
                                       f"{f} after step {s}: {m}")


def test_float64_params_are_refused_by_name():
    # fp32 main params and fp32 state would silently train float64 params at fp32 precision.
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 1).double())
    with pytest.raises(ValueError, match=r"'1\.weight'.*float64"):
        DistributedOptimizer(model, OptimizerConfig())


def test_param_group_fn_with_unknown_key_raises():
    model = ToyLM(tied=False)
    with pytest.raises(ValueError, match="momentum"):
        DistributedOptimizer(model, OptimizerConfig(), param_group_fn=lambda f, p: {"momentum": 0.9})


def test_is_a_torch_optimizer():
    model = ToyLM(tied=True)
    opt = DistributedOptimizer(model, OptimizerConfig(lr=0.5))
    assert isinstance(opt, torch.optim.Optimizer)
    assert [g["lr"] for g in opt.param_groups] == [0.5]
    # A tied weight is one param, listed once.
    listed = [p for g in opt.param_groups for p in g["params"]]
    assert len(listed) == len({id(p) for p in listed}) == len(list(model.parameters()))


def test_param_unused_after_a_used_step_is_skipped_not_stale():
    """The grad buffer is not cleared between steps: a param that got a gradient in one step and
    none in the next is left alone (as torch does with ``grad=None``), never updated with the
    previous step's values, and resumes at its own step count."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    reference = copy.deepcopy(model)
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-2, weight_decay=0.01, bucket_numel=8))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for use_b in (True, False, False, True):
        x = torch.randn(3, 4)
        for net in (model, reference):
            y = net["a"](x)
            (net["b"](y) if use_b else y).square().mean().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for got, want in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert opt.param_steps == {"a.weight": 4, "a.bias": 4, "b.weight": 2, "b.bias": 2}
