"""Accelerate with ``shardopt.recipes.integrations.accelerate.prepare`` against Accelerate with
``torch.optim.AdamW`` (``accelerator.prepare``: DDP at 2 processes): bf16 mixed precision,
``gradient_accumulation_steps=2`` through ``accelerator.accumulate``,
``accelerator.clip_grad_norm_``, an LR scheduler; ``save_state``/``load_state`` resume bit
for bit at the same number of processes and load exactly at another (2 -> 1, 1 -> 2). Each
world size is one spawned run whose ranks join a process group first and set the variables
``accelerate launch`` sets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

accelerate = pytest.importorskip("accelerate")

from helpers.checks import (  # noqa: E402
    assert_same_state, assert_trains_as_reference, full_state, max_diff, model_state)
from helpers.dist import launcher_env, runs_at_two_sizes  # noqa: E402
from shardopt import (  # noqa: E402
    DistributedOptimizer, OptimizerConfig, ParamMovedError, checkpoint)
from shardopt.recipes.integrations.accelerate import prepare  # noqa: E402
from shardopt.errors import WrappedModelError  # noqa: E402

LR, CLIP, EPOCHS = 2e-2, 0.3, 2
SAMPLES, MICRO_BATCH = 32, 4  # over all processes: 8 micro-batches an epoch, 4 steps of 2
TOL = 2e-5


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(-1)


def _run(shardopt: bool, epochs: range = range(EPOCHS), save: Path | None = None,
         load: Path | None = None, wrong: str | None = None) -> dict[str, Any]:
    """Train ``epochs`` of the run; ``save_state`` into ``save`` after epoch 0;
    ``load_state`` from ``load`` first. ``wrong``: ``accelerator.prepare`` for a
    DistributedOptimizer, which moves the model (``"moved"``) or, told not to, wraps it
    (``"wrapped"``)."""
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 6, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.sin(x.sum(-1))),
                                         batch_size=MICRO_BATCH // acc.num_processes)
    model = Net()
    kw = dict(lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = DistributedOptimizer(model, OptimizerConfig(**kw)) if shardopt else \
        torch.optim.AdamW(model.parameters(), **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.5 * s))
    if shardopt and wrong is None:
        model, opt, loader, sched = prepare(acc, model, opt, loader, sched)
    else:
        model, opt, loader, sched = acc.prepare(
            model, opt, loader, sched, device_placement=[False] * 4 if wrong == "wrapped" else None)
    out: dict[str, Any] = {"norms": []}
    if load is not None:
        acc.load_state(str(load))
        out["loaded_state"] = full_state(opt.optimizer) if shardopt else None
    for epoch in epochs:
        for xb, yb in loader:
            with acc.accumulate(model):
                acc.backward(F.mse_loss(model(xb).float(), yb))
                if acc.sync_gradients:
                    out["norms"].append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
                opt.step()
                sched.step()
                opt.zero_grad()
        if epoch == 0 and save is not None:
            acc.save_state(str(save))
            out["saved_state"] = full_state(opt.optimizer) if shardopt else None
    out["params"] = model_state(acc.unwrap_model(model))
    return out


def _job(rank: int, world_size: int, tmp: str, other: str | None) -> dict[str, Any]:
    launcher_env(rank, world_size)
    tmp_path = Path(tmp)
    out: dict[str, Any] = {"ref": _run(False, save=tmp_path / f"plain_{world_size}")}
    saved = tmp_path / f"state_{world_size}"
    out["ours"] = _run(True, save=saved)
    out["resumed"] = _run(True, epochs=range(1, EPOCHS), load=saved)
    if other is not None:
        out["other"] = _run(True, epochs=range(0), load=Path(other))
    try:
        _run(True, epochs=range(0), load=tmp_path / f"plain_{world_size}")
    except checkpoint.CheckpointError as e:
        out["plain_refused"] = str(e)
    acc = accelerate.Accelerator(cpu=True)
    model = Net()
    try:  # the framework would clip and log p.grad, which this mode leaves None
        prepare(acc, model, DistributedOptimizer(model, OptimizerConfig(grad_mode="buffer")))
    except ValueError as e:
        out["buffer_refused"] = str(e)
    if world_size > 1:  # accelerator.prepare copies the model (.to("cpu:0")), wraps it in DDP
        for name in ("moved", "wrapped"):
            try:
                _run(True, epochs=range(1), wrong=name)
            except (ParamMovedError, WrappedModelError) as e:
                out[f"{name}_refused"] = (type(e).__name__, str(e))
    return out


def _load_only(rank: int, world_size: int, _tmp: str, other: str) -> dict[str, Any]:
    launcher_env(rank, world_size)
    return {"other": _run(True, epochs=range(0), load=Path(other))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("accelerate")
    return runs_at_two_sizes(_job, _load_only, tmp, lambda ws: str(tmp / f"state_{ws}"))


@pytest.mark.parametrize("world_size", [1, 2])
def test_trains_as_accelerate_with_adamw(runs, world_size):
    for out in runs[world_size]:  # norms: what accelerator.clip_grad_norm_ returned
        assert_trains_as_reference(out["ours"], out["ref"], runs[world_size][0]["ours"],
                                   4 * EPOCHS, CLIP, TOL)


@pytest.mark.parametrize("world_size", [1, 2])
def test_load_state_resumes_bitwise(runs, world_size):
    for out in runs[world_size]:
        assert max_diff(out["resumed"]["params"], out["ours"]["params"]) == 0


def test_load_state_at_another_world_size(runs):
    assert_same_state(runs[1][0]["other"]["loaded_state"], runs[2][0]["ours"]["saved_state"])
    for out in runs[21]:
        assert_same_state(out["other"]["loaded_state"], runs[1][0]["ours"]["saved_state"])


def test_wrong_setups_are_refused(runs):
    for world_size in (1, 2):
        assert "holds no shardopt optimizer state" in runs[world_size][0]["plain_refused"]
        assert "grad_mode='torch'" in runs[world_size][0]["buffer_refused"]
    for out in runs[2]:
        assert out["moved_refused"][0] == "ParamMovedError"
        assert out["wrapped_refused"][0] == "WrappedModelError"
        for _, msg in (out["moved_refused"], out["wrapped_refused"]):
            assert "integrations.accelerate.prepare" in msg
