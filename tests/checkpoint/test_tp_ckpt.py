"""Checkpoints of tensor- and expert-parallel models: saved as N-D boxes of each param's
global tensor, loaded at any other (DP, TP, EP) layout (gloo, up to 4 ranks)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from helpers.checks import bits, exported
from helpers.dist import run_distributed
from helpers.parallel_models import Run, checkpoint_rank
from shardopt import checkpoint


def _save(tmp: Path, run: Run, name: str, load_from: str | None = None, first: int = 0,
          steps: int = 2) -> str:
    world = run.dp * run.mp
    out = run_distributed(checkpoint_rank, world, run, str(tmp / name), load_from, first,
                          steps, True, tmp_path=tmp)
    return out[0]["path"]


def _assert_same_export(tmp: Path, a: str, b: str) -> None:
    want, got = exported(a, tmp / "export_a"), exported(b, tmp / "export_b")
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(bits(got[key]), bits(want[key])), key


@pytest.fixture(scope="module")
def saved_tp(tmp_path_factory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("tp")
    return tmp, _save(tmp, Run("tp", dp=2, mp=2), "source")


@pytest.mark.parametrize("dp,tp", [(4, 1), (1, 4), (1, 2), (3, 1)])
def test_tp_checkpoint_loads_at_another_layout(saved_tp, dp, tp):
    """Loaded at the new layout and saved again without a step: the same export, bit for bit."""
    tmp, source = saved_tp
    again = _save(tmp, Run("tp", dp=dp, mp=tp), f"at_{dp}_{tp}", source, first=2, steps=0)
    _assert_same_export(tmp / f"cmp_{dp}_{tp}", source, again)


def test_tp_resume_at_the_same_layout_is_bit_identical(saved_tp):
    tmp, source = saved_tp
    run = Run("tp", dp=2, mp=2)
    straight = run_distributed(checkpoint_rank, 4, run, str(tmp / "straight"), None, 0, 5,
                               False, tmp_path=tmp)
    resumed = run_distributed(checkpoint_rank, 4, run, str(tmp / "resumed"), source, 2, 3,
                              False, tmp_path=tmp)
    for a, b in zip(straight, resumed):
        for fqn in a["params"]:
            assert torch.equal(bits(a["params"][fqn]), bits(b["params"][fqn])), fqn


def test_tp_checkpoint_describes_global_shapes_and_boxes(saved_tp):
    _, source = saved_tp
    rows = {r["fqn"]: r for r in checkpoint.inspect(source)["params"]}
    assert rows["down.weight"]["shape"] == [8, 16]
    assert rows["down.weight"]["placements"] == ["Shard(dim=1)"]
    boxes = rows["down.weight"]["boxes"]
    assert sum(b["lengths"][0] * b["lengths"][1] for b in boxes) == 8 * 16
    assert {b["offsets"][1] for b in boxes} == {0, 8}  # each TP rank's half of the columns
    assert rows["norm.weight"]["placements"] == []


@pytest.mark.parametrize("ep", [1, 4])
def test_moe_checkpoint_loads_at_another_expert_parallel_size(tmp_path, ep):
    source = _save(tmp_path, Run("moe", dp=2, mp=2), "source")
    again = _save(tmp_path, Run("moe", dp=2 if ep == 1 else 1, mp=ep), f"ep{ep}", source,
                  first=2, steps=0)
    _assert_same_export(tmp_path / "cmp", source, again)
