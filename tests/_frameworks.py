"""What the framework tests share: the spawned runs at two world sizes, the launcher's
variables, the optimizer's whole state gathered from every rank, a model's weights, and
their comparison."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _dist import run_distributed
from shardopt import DistributedOptimizer


def full_state(opt: DistributedOptimizer) -> dict[Any, Any]:
    """Collective. Every param's whole Adam state, step count and lr, from every rank's part."""
    sd = opt.state_dict()
    mine = {(fqn, name): (st[name].offset, st[name].local.clone(), st[name].numel())
            for fqn, st in sd["state"].items()
            for name in ("exp_avg", "exp_avg_sq", "master_param")}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    full: dict[Any, Any] = {}
    for part in parts:
        for key, (offset, local, numel) in part.items():
            t = full.setdefault(key, torch.full((numel,), float("nan")))
            t[offset:offset + local.numel()] = local
    full["steps"] = {fqn: int(st["step"]) for fqn, st in sd["state"].items()}
    full["lr"] = [g["lr"] for g in opt.param_groups]
    return full


def assert_same_state(loaded: dict[Any, Any], saved: dict[Any, Any]) -> None:
    """Bit for bit, as :func:`full_state` gives them."""
    assert loaded.keys() == saved.keys()
    for key in saved:
        if isinstance(saved[key], torch.Tensor):
            assert torch.equal(loaded[key], saved[key]), key
        else:
            assert loaded[key] == saved[key], key


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def launcher_env(rank: int, world_size: int) -> None:
    """What ``torchrun`` / ``accelerate launch`` set (the process group exists already)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")


def runs_at_two_sizes(job: Callable[..., Any], load_only: Callable[..., Any], tmp: Path,
                      saved_by: Callable[[int], str]) -> dict[int, list[Any]]:
    """``job(rank, world_size, tmp, other)`` at 2 processes, then at 1 with ``other`` what
    the 2 saved (``saved_by(2)``), then ``load_only(rank, 2, tmp, saved_by(1))``: results
    by world size, the last under 21. Forked ranks start with the framework imported."""
    def run(fn: Callable[..., Any], world_size: int, other: str | None) -> list[Any]:
        return run_distributed(fn, world_size, str(tmp), other, tmp_path=tmp, start_method="fork")

    two = run(job, 2, None)
    one = run(job, 1, saved_by(2))
    return {1: one, 2: two, 21: run(load_only, 2, saved_by(1))}


def assert_trains_as_reference(ours: dict[str, Any], ref: dict[str, Any],
                               rank0: dict[str, Any], steps: int, clip: float,
                               tol: float) -> None:
    """``ours`` (a rank's ``norms``, the grad norm the framework saw before clipping at each
    step, and final ``params``) against ``ref``, the same framework's run with
    ``torch.optim.AdamW``; ``rank0``: rank 0's run of ours."""
    assert len(ours["norms"]) == steps
    assert ours["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    assert max(ref["norms"]) > clip  # clipping changed the steps
    assert max_diff(ours["params"], ref["params"]) <= tol
    assert max_diff(ours["params"], rank0["params"]) == 0  # the ranks agree
