"""The Hugging Face Trainer with ``ShardoptTrainer`` against the Trainer with its default
AdamW (DDP at 2 processes) on a tiny Llama: ``bf16``, ``max_grad_norm``,
``gradient_accumulation_steps=2``, a linear LR schedule, ``save_steps``; the logged
``grad_norm`` equal to torch's; ``resume_from_checkpoint`` bit for bit at the same number of
processes and exact at another (2 -> 1, 1 -> 2). Each world size is one spawned run whose
ranks join a process group first and set the variables ``torchrun`` sets."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.checks import (  # noqa: E402
    assert_same_state, assert_trains_as_reference, full_state, max_diff, model_state)
from helpers.dist import launcher_env, runs_at_two_sizes  # noqa: E402
from shardopt import (  # noqa: E402
    DistributedOptimizer, OptimizerConfig, ParamMovedError, checkpoint)
from shardopt.recipes.integrations.transformers import ShardoptTrainer  # noqa: E402
from shardopt.errors import WrappedModelError  # noqa: E402

CLIP, SAMPLES, MICRO_BATCH, SEQ = 0.5, 32, 4, 8  # 8 micro-batches an epoch: 4 steps of 2
STEPS = 8
TOL = 2e-5


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _StateAt(transformers.TrainerCallback):
    """The optimizer's whole state at the first step's start (after a resume) and at step 4."""

    def __init__(self) -> None:
        self.states: dict[str, Any] = {}

    def on_step_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                      **kw: Any) -> None:
        if "start" not in self.states:
            self.states["start"] = full_state(optimizer.optimizer)

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                    **kw: Any) -> None:
        if state.global_step == STEPS // 2:
            self.states["step 4"] = full_state(optimizer.optimizer)


def _train(out_dir: Path, shardopt: bool, resume: str | None = None, steps: int = STEPS
           ) -> dict[str, Any]:
    world_size = int(os.environ["WORLD_SIZE"])
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), use_cpu=True, bf16=True, max_steps=steps,
        per_device_train_batch_size=MICRO_BATCH // world_size, gradient_accumulation_steps=2,
        learning_rate=2e-2, weight_decay=0.1, adam_beta2=0.95, max_grad_norm=CLIP,
        lr_scheduler_type="linear", logging_steps=1, save_strategy="steps",
        save_steps=STEPS // 2, report_to=[], disable_tqdm=True, seed=0,
        dataloader_num_workers=0)
    states = _StateAt()
    cls = ShardoptTrainer if shardopt else transformers.Trainer
    trainer = cls(model=_model(), args=args, train_dataset=_Tokens(),
                  callbacks=[states] if shardopt else [])
    trainer.train(resume_from_checkpoint=resume)
    norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    return {"params": model_state(trainer.model), "norms": norms, "states": states.states}


def _job(rank: int, world_size: int, tmp: str, other: str | None) -> dict[str, Any]:
    launcher_env(rank, world_size)
    tmp_path = Path(tmp)
    out = {"ref": _train(tmp_path / f"ref_{world_size}", shardopt=False)}
    ours = tmp_path / f"ours_{world_size}"
    out["ours"] = _train(ours, shardopt=True)
    out["resumed"] = _train(tmp_path / f"resumed_{world_size}", True,
                            resume=str(ours / f"checkpoint-{STEPS // 2}"))
    if other is not None:
        out["other"] = _train(tmp_path / f"other_{world_size}", True, resume=other)
    try:
        _train(tmp_path / f"plain_{world_size}", True,
               resume=str(tmp_path / f"ref_{world_size}" / f"checkpoint-{STEPS // 2}"))
    except checkpoint.CheckpointError as e:
        out["plain_refused"] = str(e)
    try:  # another optimizer asked for
        sgd = transformers.TrainingArguments(output_dir=str(tmp_path / "sgd"), use_cpu=True,
                                             optim="sgd", report_to=[])
        ShardoptTrainer(model=_model(), args=sgd, train_dataset=_Tokens())
    except ValueError as e:
        out["sgd_refused"] = str(e)
    if world_size > 1:  # the plain Trainer with a DistributedOptimizer: DDP
        try:
            model = _model()
            opt = DistributedOptimizer(model, OptimizerConfig())
            args = transformers.TrainingArguments(output_dir=str(tmp_path / "ddp"), use_cpu=True,
                                                  max_steps=1, report_to=[], save_strategy="no")
            transformers.Trainer(model=model, args=args, train_dataset=_Tokens(),
                                 optimizers=(opt, None)).train()
        except (ParamMovedError, WrappedModelError) as e:  # .to("cpu:0") copies it first
            out["ddp_refused"] = str(e)
    return out


def _resume_only(rank: int, world_size: int, tmp: str, other: str) -> dict[str, Any]:
    launcher_env(rank, world_size)
    return {"other": _train(Path(tmp) / f"other_{world_size}b", True, resume=other)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("hf_trainer")
    return runs_at_two_sizes(_job, _resume_only, tmp,
                             lambda ws: str(tmp / f"ours_{ws}" / f"checkpoint-{STEPS // 2}"))


@pytest.mark.parametrize("world_size", [1, 2])
def test_trains_as_the_trainer_with_adamw(runs, world_size):
    for out in runs[world_size]:  # norms: the grad_norm the Trainer logged
        assert_trains_as_reference(out["ours"], out["ref"], runs[world_size][0]["ours"],
                                   STEPS, CLIP, TOL)


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_from_checkpoint_is_bitwise(runs, world_size):
    for out in runs[world_size]:
        assert max_diff(out["resumed"]["params"], out["ours"]["params"]) == 0


def test_resume_at_another_world_size(runs):
    assert_same_state(runs[1][0]["other"]["states"]["start"],
                      runs[2][0]["ours"]["states"]["step 4"])
    for out in runs[21]:
        assert_same_state(out["other"]["states"]["start"], runs[1][0]["ours"]["states"]["step 4"])


def test_wrong_setups_are_refused(runs):
    for world_size in (1, 2):
        assert "plain Trainer's optimizer.pt" in runs[world_size][0]["plain_refused"]
        assert "optim='sgd'" in runs[world_size][0]["sgd_refused"]
    for out in runs[2]:
        assert "ShardoptTrainer" in out["ddp_refused"]
