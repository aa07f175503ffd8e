"""Resharding: save at N ranks, load at M, for every N, M in {1, 2, 3, 4}.

One spawn per N trains, saves, and keeps training; one spawn per M loads every
N's checkpoint, saves it again at once (so the parent can check that nothing
was lost: the exported state is identical), and keeps training from it (which
must track the run that never stopped, up to the rounding of a different
reduction order). The model has uneven param sizes, bf16 and fp32 params, a
tied embedding/head, a frozen param and a buffer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers.checks import assert_tensors_equal, exported, model_state
from helpers.dist import device_for, require_world_size, run_distributed
from helpers.models import STATE_NAMES, build, train
from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint

SIZES = (1, 2, 3, 4)
SAVE_STEP, END_STEP = 2, 4


def _manifest(path: Path) -> dict:
    return json.loads((path / f"step_{SAVE_STEP:08d}" / "manifest.json").read_text())


def save_rank(rank: int, world_size: int, backend: str, base: str) -> None:
    from shardopt.checkpoint import storage

    model, opt = build(0, device_for(backend, rank), tied=True)
    train(model, opt, range(SAVE_STEP), rank, world_size)
    # Tiny parts: each rank's state is split over 8 files, chunks cut across them.
    storage.MIN_PART_BYTES = 64
    checkpoint.save(f"{base}/saved-{world_size}", model, opt, step=SAVE_STEP,
                    extra={"saved_by": world_size},
                    config=checkpoint.CheckpointConfig(io_threads=8))
    storage.MIN_PART_BYTES = 64 << 20
    train(model, opt, range(SAVE_STEP, END_STEP), rank, world_size)
    checkpoint.save(f"{base}/continued-{world_size}", model, opt, step=END_STEP)


def load_rank(rank: int, world_size: int, backend: str, base: str,
              saved_sizes: list[int]) -> dict[int, dict]:
    out = {}
    for n in saved_sizes:
        model, opt = build(100 + n, device_for(backend, rank), tied=True)
        info = checkpoint.load(f"{base}/saved-{n}", model, opt)
        assert (info.step, info.extra, info.dp_size_saved) == (SAVE_STEP, {"saved_by": n}, n)
        checkpoint.save(f"{base}/resaved-{n}-at-{world_size}", model, opt, step=SAVE_STEP)
        train(model, opt, range(SAVE_STEP, END_STEP), rank, world_size)
        checkpoint.save(f"{base}/continued-{n}-at-{world_size}", model, opt, step=END_STEP)
        out[n] = model_state(model)
    return out


@dataclass(frozen=True)
class Saved:
    backend: str
    base: Path
    sizes: list[int]
    state: dict[int, dict[str, torch.Tensor]]  # exported state at SAVE_STEP, by N
    continued: dict[int, dict[str, torch.Tensor]]  # exported state at END_STEP, by N


@pytest.fixture(scope="module", params=["gloo", pytest.param("nccl", marks=pytest.mark.cuda)])
def saved(request, tmp_path_factory) -> Saved:
    backend = request.param
    base = tmp_path_factory.mktemp(f"reshard-{backend}")
    sizes = [n for n in SIZES if backend != "nccl" or n <= torch.cuda.device_count()]
    for n in sizes:
        run_distributed(save_rank, n, backend, str(base), backend=backend, tmp_path=base / "runs")
    for n in sizes:  # saved in parts; every other save below is not
        assert len(_manifest(base / f"saved-{n}")["files"]) == 9 * n
    state = {n: exported(base / f"saved-{n}", base / f"export-saved-{n}") for n in sizes}
    continued = {n: exported(base / f"continued-{n}", base / f"export-continued-{n}")
                 for n in sizes}
    return Saved(backend, base, sizes, state, continued)


def assert_tracks(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                  what: str) -> None:
    """Optimizer state after two steps from the same state at different DP sizes.

    bf16 gradients are rounded per rank, so the runs differ by about 0.5% of
    each moment's scale and 2e-4 in the main params. A lost or misplaced moment
    or step count moves a main param by about one step (lr = 1e-2) instead.
    """
    assert sorted(actual) == sorted(expected)
    for key, ref in expected.items():
        diff = (actual[key] - ref).abs().max().item() if ref.numel() else 0.0
        if key.endswith(".master_param"):
            assert diff <= 1e-3, f"{what} {key}: {diff}"
        elif key.endswith((".exp_avg", ".exp_avg_sq")):
            assert diff <= 0.02 * ref.abs().max().item(), f"{what} {key}: {diff}"


@pytest.mark.parametrize("load_size", SIZES)
def test_load_every_saved_size(saved, load_size, tmp_path):
    require_world_size(saved.backend, load_size)
    m = load_size
    results = run_distributed(load_rank, m, saved.backend, str(saved.base), saved.sizes,
                              backend=saved.backend, tmp_path=tmp_path)
    for n in saved.sizes:
        what = f"saved at {n}, loaded at {m}"
        # Resharding loses nothing: the state saved again at M is the state saved at N.
        resaved = exported(saved.base / f"resaved-{n}-at-{m}", tmp_path / f"resaved-{n}")
        assert_tensors_equal(resaved, saved.state[n], what)
        before, after = _manifest(saved.base / f"saved-{n}"), \
            _manifest(saved.base / f"resaved-{n}-at-{m}")
        assert after["params"] == before["params"], what  # shapes, dtypes, steps, groups
        assert after["aliases"] == before["aliases"] == {"head.weight": "emb.weight"}
        assert (after["dp_size"], len(after["files"])) == (m, 5 * m)

        # Training continues: every rank holds the same params, and they track the run
        # that continued at N (different reduction order: rounding differences only).
        for r in results:
            assert_tensors_equal(r[n], results[0][n], f"{what}: ranks disagree")
        cont = exported(saved.base / f"continued-{n}-at-{m}", tmp_path / f"continued-{n}")
        assert_tracks(cont, saved.continued[n], what)
        # The continued run is not the saved state: training moved it.
        assert not torch.equal(cont["up.weight.master_param"], resaved["up.weight.master_param"])


# ------------------------------------------------ ranks that own nothing but padding

class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 1)
        self.b = nn.Linear(1, 2, bias=False).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).to(torch.bfloat16)).float().square().mean()


def _tiny(seed: int) -> tuple[Tiny, DistributedOptimizer]:
    torch.manual_seed(seed)
    model = Tiny()
    return model, DistributedOptimizer(model, OptimizerConfig(lr=0.1, align_numel=4))


def tiny_rank(rank: int, world_size: int, base: str, save: bool) -> dict[str, torch.Tensor]:
    model, opt = _tiny(0 if save else 1)
    if save:
        assert rank == 0 or not opt.shard_state.shards  # every bucket fits in rank 0's shard
        model(torch.ones(world_size, 2)[rank:rank + 1]).backward()
        opt.step()
        checkpoint.save(f"{base}/saved", model, opt, step=1)
    else:
        checkpoint.load(f"{base}/saved", model, opt)
        checkpoint.save(f"{base}/resaved-{world_size}", model, opt, step=1)
    return model_state(model)


def test_ranks_without_shards_save_empty_files_and_reshard(tmp_path):
    base = tmp_path / "ckpt"
    saved = run_distributed(tiny_rank, 4, str(base), True, tmp_path=tmp_path)
    path = base / "saved" / "step_00000001"
    assert len(list(path.glob("*.safetensors"))) == 20
    for kind in ("model", "optim", "exp_avg", "exp_avg_sq"):
        assert load_file_keys(path / f"{kind}-00003.safetensors") == []
    checkpoint.verify(path)
    state = exported(path, tmp_path / "export")
    assert sorted(state) == sorted(["a.weight", "a.bias", "b.weight"] +
                                   [f"{p}.{n}" for p in ("a.weight", "a.bias", "b.weight")
                                    for n in STATE_NAMES])
    loaded = run_distributed(tiny_rank, 3, str(base), False, tmp_path=tmp_path)
    assert_tensors_equal(loaded[2], saved[0])
    assert_tensors_equal(exported(base / "resaved-3", tmp_path / "export-3"), state)
    # One process, no process group at all.
    model, opt = _tiny(2)
    checkpoint.load(path, model, opt)
    assert_tensors_equal(model_state(model), saved[0])


def load_file_keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())

