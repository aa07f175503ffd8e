"""DistributedOptimizer over DTensor params: tensor parallelism and experts against
``torch.optim.AdamW`` + ``clip_grad_norm_`` on the full model in one process (gloo, 4 ranks)."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from helpers.dist import run_distributed
from helpers.parallel_models import Run, mismatch, reference, train_rank
from shardopt import parallel


@pytest.mark.parametrize("grad_mode", ["torch", "buffer"])
def test_dp2_tp2_matches_full_model(grad_mode, tmp_path):
    run = Run("tp", grad_mode=grad_mode)
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
