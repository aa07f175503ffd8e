"""Lightning with ``ShardoptStrategy`` against Lightning with ``torch.optim.AdamW`` (DDP at 2
processes): bf16-mixed precision, ``gradient_clip_val``, ``accumulate_grad_batches=2``, an LR
scheduler, ``ModelCheckpoint``; resume bit for bit at the same number of processes and at
another (2 -> 1, 1 -> 2). Each world size is one spawned run (the ranks join a process group
first, then Lightning sees ``LOCAL_RANK`` and uses it, as under ``torchrun``); the tests read
the runs' results."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from helpers.checks import (  # noqa: E402
    assert_same_state, assert_trains_as_reference, full_state, max_diff, model_state)
from helpers.dist import runs_at_two_sizes  # noqa: E402
from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint  # noqa: E402
from shardopt.recipes.integrations.lightning import ShardoptStrategy  # noqa: E402
from shardopt.errors import WrappedModelError  # noqa: E402

LR, CLIP, STEPS_PER_EPOCH, EPOCHS = 2e-2, 0.3, 4, 2
SAMPLES, MICRO_BATCH = 32, 4  # over all processes; 8 micro-batches an epoch: 4 steps of 2
TOL = 2e-5


class Net(pl.LightningModule):
    def __init__(self, shardopt: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 1)
        self.shardopt = shardopt
        self.norms: list[float] = []
        self.state_at: dict[str, Any] = {}  # the optimizer's full state at some points

    def training_step(self, batch: Any, _index: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.body(x)).float().squeeze(-1), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:  # before Lightning clips
        norms = pl.utilities.grad_norm(self, 2)  # empty without p.grad
        self.norms.append(float(norms.get("grad_2.0_norm_total", float("nan"))))

    def on_train_start(self) -> None:  # after Lightning restored a checkpoint
        if self.shardopt:
            self.state_at["start"] = full_state(self.trainer.optimizers[0])

    def on_train_epoch_end(self) -> None:  # where ModelCheckpoint saves
        if self.shardopt and self.current_epoch == 0:
            self.state_at["epoch 0"] = full_state(self.trainer.optimizers[0])

    def configure_optimizers(self) -> Any:
        kw = dict(lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        if self.shardopt:
            opt = DistributedOptimizer(self, OptimizerConfig(**kw))
        else:
            opt = torch.optim.AdamW(self.parameters(), **kw)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.5 * s))
        return {"optimizer": opt, "lr_scheduler": sched}


def _data(world_size: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 6, generator=g)
    y = torch.sin(x.sum(-1)) * 3
    # Each process sees every world_size-th sample, in order (the sampler Lightning puts in
    # for a distributed strategy would shuffle), so every run trains on the same batches.
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(data, batch_size=MICRO_BATCH // world_size,
                                       sampler=torch.utils.data.DistributedSampler(data,
                                                                                   shuffle=False))


def _fit(world_size: int, shardopt: bool, ckpt_dir: Path | None = None,
         resume: str | None = None, strategy: Any = None) -> Net:
    model = Net(shardopt)
    # Every epoch's checkpoint kept in ckpt_dir; in ckpt_dir/latest only the newest (the one
    # before is removed) and last.ckpt (saved again over itself).
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1),
                 pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir / "latest", save_top_k=1,
                                              every_n_train_steps=STEPS_PER_EPOCH,
                                              save_last=True)
                 ] if ckpt_dir is not None else []
    if strategy is None:
        strategy = ShardoptStrategy() if shardopt else ("ddp" if world_size > 1 else "auto")
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy,
                         max_epochs=EPOCHS, accumulate_grad_batches=2, gradient_clip_val=CLIP,
                         precision="bf16-mixed", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=bool(callbacks),
                         callbacks=callbacks, num_sanity_val_steps=0)
    trainer.fit(model, _data(world_size), ckpt_path=resume)
    return model


def _ckpt(directory: Path, step: int) -> str:
    return str(directory / f"epoch={step // STEPS_PER_EPOCH - 1}-step={step}.ckpt")


def _job(rank: int, world_size: int, tmp: str, other: str | None) -> dict[str, Any]:
    """One world size's runs: the torch reference, shardopt with checkpoints, its resume at
    the same size, a resume of ``other`` (saved at another size), the wrong strategy."""
    os.environ["LOCAL_RANK"] = str(rank)
    tmp_path = Path(tmp)
    out: dict[str, Any] = {}
    ref = _fit(world_size, shardopt=False)
    out["ref"] = {"params": model_state(ref), "norms": ref.norms}
    ckpts = tmp_path / f"ckpt_{world_size}"
    ours = _fit(world_size, shardopt=True, ckpt_dir=ckpts)
    out["ours"] = {"params": model_state(ours), "norms": ours.norms}
    latest = ckpts / "latest"
    out["latest"] = {p.name: sorted(q.name for q in (p / "optimizer").iterdir())
                     for p in latest.iterdir()}
    out["saved_state"] = ours.state_at["epoch 0"]
    out["resumed"] = model_state(_fit(world_size, True, resume=_ckpt(ckpts, STEPS_PER_EPOCH)))
    if other is not None:
        out["loaded_state"] = _fit(world_size, True, resume=other).state_at["start"]
    # A torch optimizer's Lightning checkpoint is refused, saying why.
    plain = tmp_path / f"plain_{world_size}.ckpt"
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, max_steps=1, logger=False,
                         strategy="ddp" if world_size > 1 else "auto",
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    trainer.fit(Net(False), _data(world_size))
    trainer.save_checkpoint(plain)
    try:
        _fit(world_size, True, resume=str(plain))
    except checkpoint.CheckpointError as e:
        out["plain_refused"] = str(e)
    if world_size > 1:  # Lightning's DDP strategy around a DistributedOptimizer
        try:
            _fit(world_size, True, strategy="ddp")
        except WrappedModelError as e:
            out["ddp_refused"] = str(e)
    return out


def _resume_only(rank: int, world_size: int, _tmp: str, ckpt: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    return {"loaded_state": _fit(world_size, True, resume=ckpt).state_at["start"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("lightning")
    return runs_at_two_sizes(_job, _resume_only, tmp,
                             lambda ws: _ckpt(tmp / f"ckpt_{ws}", STEPS_PER_EPOCH))


@pytest.mark.parametrize("world_size", [1, 2])
def test_trains_as_lightning_with_adamw(runs, world_size):
    for out in runs[world_size]:  # norms: Lightning's grad_norm utility, from p.grad
        assert_trains_as_reference(out["ours"], out["ref"], runs[world_size][0]["ours"],
                                   STEPS_PER_EPOCH * EPOCHS, CLIP, TOL)


def test_modelcheckpoint_replaces_and_removes_directories(runs):
    # What save_top_k dropped is gone; last.ckpt, saved at both epochs, holds the last only.
    final = f"step_{STEPS_PER_EPOCH * EPOCHS:08d}"
    for world_size in (1, 2):
        assert runs[world_size][0]["latest"] == {
            _ckpt(Path(), STEPS_PER_EPOCH * EPOCHS): [".lock", "latest", final],
            "last.ckpt": [".lock", "latest", final]}


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_from_modelcheckpoint_is_bitwise(runs, world_size):
    for out in runs[world_size]:
        assert max_diff(out["resumed"], out["ours"]["params"]) == 0


def test_checkpoints_load_at_another_world_size(runs):
    # What a resume at 1 process finds is what 2 processes saved, bit for bit, and back.
    for loaded, saved in [(runs[1][0]["loaded_state"], runs[2][0]["saved_state"]),
                          *[(out["loaded_state"], runs[1][0]["saved_state"]) for out in runs[21]]]:
        assert_same_state(loaded, saved)


def test_wrong_setups_are_refused(runs):
    for world_size in (1, 2):
        assert "holds no shardopt optimizer state" in runs[world_size][0]["plain_refused"]
    for out in runs[2]:
        assert "ShardoptStrategy" in out["ddp_refused"]
