"""DistributedOptimizer over DTensor params: tensor parallelism and experts against
``torch.optim.AdamW`` + ``clip_grad_norm_`` on the full model in one process (gloo, 4 ranks)."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from torch.distributed.tensor import DTensor

from helpers.checks import bits
from helpers.dist import run_distributed
from helpers.parallel_models import Run, build, mismatch, reference, train_rank, train_step
from shardopt import parallel


@pytest.mark.parametrize("grad_mode, groups", [("torch", False), ("buffer", False),
                                               ("torch", True)], ids=["torch", "buffer", "groups"])
def test_dp2_tp2_matches_full_model(grad_mode, groups, tmp_path):
    run = Run("tp", grad_mode=grad_mode, groups=groups)
    ref = reference(run)
    assert any(n > run.max_grad_norm for n in ref["norms"]), "clipping never engaged"
    for rank, result in enumerate(run_distributed(train_rank, 4, run, tmp_path=tmp_path)):
        assert mismatch(result, ref) == [], f"rank {rank}"


def _count_every_copy(*args, **kwargs):
    return dataclasses.replace(_record(*args, **kwargs), copies=1)


_record = parallel._record


def broken_norm_rank(rank: int, world_size: int, run: Run):
    with mock.patch.object(parallel, "_record", _count_every_copy):
        return train_rank(rank, world_size, run)


def test_norm_that_counts_replicas_on_every_tp_rank_fails_the_check(tmp_path):
    """The test of the test: the LayerNorm and the row-parallel bias counted on both TP
    ranks give another norm, which the check above catches."""
    run = Run("tp")
    ref = reference(run)
    results = run_distributed(broken_norm_rank, 4, run, tmp_path=tmp_path)
    problems = mismatch(results[0], ref)
    assert any("last_grad_norm" in p for p in problems), problems


def test_dp2_ep2_experts_match_full_model(tmp_path):
    run = Run("moe")
    ref = reference(run)
    assert any(n > run.max_grad_norm for n in ref["norms"]), "clipping never engaged"
    for rank, result in enumerate(run_distributed(train_rank, 4, run, tmp_path=tmp_path)):
        assert mismatch(result, ref) == [], f"rank {rank}"


def features_rank(rank: int, world_size: int, run: Run) -> dict:
    """opt.state, offload/onload, iter_param_buckets and state_dict() over DTensor params."""
    model, opt, piece = build(run)
    train_step(model, opt, run, piece, 0)
    out = {}
    p = model.up.weight  # column-parallel: this rank's rows
    entry = opt.state[p]
    local = p.to_local().reshape(-1)
    n = entry["master_param"].numel()
    out["state_views_local"] = torch.equal(
        entry["master_param"], local[entry["offset"]:entry["offset"] + n].float())
    before = {k: t.clone() for k, t in opt.shard_state.sources().items()}
    opt.offload()
    opt.onload()
    after = opt.shard_state.sources()
    out["onload_bitwise"] = all(torch.equal(bits(after[k]), bits(v)) for k, v in before.items())
    placed_ok = []
    for fqns, flat, placed in opt.iter_param_buckets(with_placements=True):
        pos = 0
        for fqn, rec in zip(fqns, placed):
            param = model.get_parameter(fqn)
            mine = param.to_local() if isinstance(param, DTensor) else param
            placed_ok.append(rec.fqn == fqn and rec.global_shape == tuple(param.shape)
                             and torch.equal(flat[pos:pos + mine.numel()], mine.reshape(-1)))
            pos += mine.numel()
    out["buckets_placed"] = placed_ok and all(placed_ok)
    out["placements"] = opt.shard_state.parallel.placements["down.weight"]
    train_step(model, opt, run, piece, 1)
    out["norm"] = opt.last_grad_norm
    return out


def test_state_offload_and_param_buckets_over_dtensor_params(tmp_path):
    for result in run_distributed(features_rank, 4, Run("tp"), tmp_path=tmp_path):
        assert result["state_views_local"] and result["onload_bitwise"]
        assert result["buckets_placed"], result
        assert result["placements"] == ("Shard(dim=1)",)


@pytest.mark.parametrize("moments,atol", [(torch.bfloat16, 2e-3), ("int8", 5e-3)])
def test_low_precision_moments_train_tensor_parallel(moments, atol, tmp_path):
    """Against the fp32 reference within the moments' rounding (params move by 4e-2)."""
    run = Run("tp", extra={"exp_avg_dtype": moments, "exp_avg_sq_dtype": moments})
    ref = reference(run)
    for result in run_distributed(train_rank, 4, run, tmp_path=tmp_path):
        assert mismatch(result, ref, atol=atol, norm_rtol=1e-2) == []


def misuse_rank(rank: int, world_size: int) -> list[str]:
    """Every rank raises UsageError naming the param, before anything is laid out."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.parallel import parallelize_module

    from helpers.parallel_models import TP_PLAN, TPNet
    from shardopt import DistributedOptimizer
    from shardopt.errors import UsageError

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    messages = []

    def refused(make_model, **kwargs) -> None:
        with pytest.raises(UsageError) as info:
            DistributedOptimizer(make_model(), **kwargs)
        messages.append(str(info.value))

    def tp_model():
        model = TPNet()
        parallelize_module(model, mesh["tp"], TP_PLAN)
        return model

    refused(tp_model)  # process_group: the world, which the TP mesh dim is not orthogonal to
    refused(TPNet, dp_group_fn=lambda fqn, p: "dp")

    def partial_model():
        model = TPNet()
        model.norm.weight = torch.nn.Parameter(
            DTensor.from_local(torch.ones(8), mesh["tp"], [Partial()], run_check=False))
        return model

    refused(partial_model, process_group=mesh["dp"].get_group())
    refused(tp_model, process_group=mesh["dp"].get_group(), param_group_fn=lambda fqn, p: (
        {"optimizer": "muon"} if fqn == "up.weight" else {}))
    dist.barrier()
    return messages


def test_params_that_cannot_be_placed_are_refused_by_name(tmp_path):
    for messages in run_distributed(misuse_rank, 4, tmp_path=tmp_path):
        world, not_group, partial, muon = messages
        assert "param 'up.weight': its DP group of 4 ranks and its 2 shards" in world
        assert "do not tile the world of 4 ranks" in world
        assert "dp_group_fn returned str for param 'up.weight'" in not_group
        assert "param 'norm.weight' has a Partial placement" in partial
        assert "param 'up.weight' is in a Muon param group" in muon


def test_a_plan_without_torch_distributed_keeps_global_shape_state(tmp_path):
    """One process, plain params, a dp_group_fn: a plan of one rank, whose state dict holds
    each state at its param's global shape (what a TP run's DCP checkpoint loads into)."""
    from helpers.parallel_models import TPNet
    from shardopt import BoxShard, DistributedOptimizer, OptimizerConfig

    torch.manual_seed(0)
    model = TPNet()
    opt = DistributedOptimizer(model, OptimizerConfig(), dp_group_fn=lambda fqn, p: None)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    entry = opt.state_dict()["state"]["down.weight"]
    assert isinstance(entry["exp_avg"], BoxShard) and tuple(entry["exp_avg"].shape) == (8, 16)
    assert opt.shard_state.parallel.saved_shards == opt.shard_state.shards
    opt.load_state_dict(opt.state_dict())
