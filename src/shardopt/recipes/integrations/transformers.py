"""Hugging Face Trainer: ``ShardoptTrainer`` in place of ``Trainer`` trains with a
:class:`~shardopt.DistributedOptimizer` at any number of processes (``torchrun``,
``accelerate launch``), with the Trainer's own clipping (``max_grad_norm``), gradient
accumulation, ``bf16``/``fp16``, LR schedule, logging and checkpoints.

``create_optimizer`` builds the optimizer over ``trainer.model`` with the AdamW settings of
the ``TrainingArguments`` (``learning_rate``, ``adam_beta1``/``adam_beta2``,
``adam_epsilon``, ``weight_decay``, and no decay for the params the Trainer exempts: biases
and norms), or takes one passed as ``optimizers=(DistributedOptimizer(...), scheduler)``,
and prepares model and optimizer as :func:`shardopt.recipes.integrations.accelerate.prepare` does
before the Trainer's own ``accelerator.prepare``, which then keeps them: the model stays
unwrapped (the optimizer averages the gradients itself), and the Trainer's no-sync
micro-batches run under ``optimizer.no_sync()``. The Trainer clips ``p.grad`` itself, so the
optimizer's ``max_grad_norm`` is left unset.

A checkpoint (``save_steps``, ``resume_from_checkpoint``) holds the Trainer's files as
always, with every rank's optimizer state written through :mod:`shardopt.checkpoint` into
``checkpoint-N/shardopt`` in place of rank 0's ``optimizer.pt``; it resumes bit for bit at
the same number of processes and loads at any other.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer

from shardopt import checkpoint
from shardopt import OptimizerConfig
from shardopt import DistributedOptimizer
from . import _state
from .accelerate import STATE_DIR, ShardoptAcceleratedOptimizer, prepare_model_and_optimizer

# The Trainer's file names (transformers.trainer's constants).
OPTIMIZER_FILE, SCHEDULER_FILE, STATE_FILE = "optimizer.pt", "scheduler.pt", "trainer_state.json"
ADAMW = ("adamw_torch", "adamw_torch_fused")


class ShardoptTrainer(Trainer):
    """``Trainer`` whose optimizer is a :class:`DistributedOptimizer` (module docstring).

    ``optimizer_config``: the optimizer's settings in place of the ``TrainingArguments``'
    AdamW ones (the weight-decay exemptions still apply); ``checkpoint_config``: how its
    state is saved and loaded (a :class:`shardopt.checkpoint.CheckpointConfig`).
    """

    def __init__(self, *args: Any, optimizer_config: OptimizerConfig | None = None,
                 checkpoint_config: checkpoint.CheckpointConfig | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        why = None
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            why = "DeepSpeed and FSDP shard and reduce the gradients their own way"
        elif self.args.n_gpu > 1:
            why = (f"one process drives {self.args.n_gpu} GPUs (DataParallel); launch one "
                   "process per GPU (torchrun)")
        elif self.optimizer is not None and not isinstance(self.optimizer, DistributedOptimizer):
            why = (f"optimizers= holds a {type(self.optimizer).__qualname__}: pass a "
                   "shardopt.DistributedOptimizer, or none")
        elif self.optimizer_cls_and_kwargs is not None:
            why = "optimizer_cls_and_kwargs= names another optimizer; the optimizer is AdamW"
        elif self.optimizer is None and optimizer_config is None and (
                getattr(self.args.optim, "value", self.args.optim) not in ADAMW
                or self.args.optim_args):
            why = (f"optim={getattr(self.args.optim, 'value', self.args.optim)!r} "
                   f"(optim_args={self.args.optim_args!r}): the optimizer is AdamW, set optim "
                   f"to one of {ADAMW} or pass optimizer_config=")
        if why is not None:
            raise ValueError(f"ShardoptTrainer: {why}")

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if isinstance(self.optimizer, ShardoptAcceleratedOptimizer):
            return self.optimizer  # a later train() call
        opt = self.optimizer
        if opt is None:
            decay = set(self.get_decay_parameter_names(self.model))
            opt = DistributedOptimizer(
                self.model, self.optimizer_config or OptimizerConfig(
                    lr=self.args.learning_rate, betas=(self.args.adam_beta1, self.args.adam_beta2),
                    eps=self.args.adam_epsilon, weight_decay=self.args.weight_decay),
                param_group_fn=lambda fqn, _p: {} if fqn in decay else {"weight_decay": 0.0})
        self.model, self.optimizer = prepare_model_and_optimizer(
            self.accelerator, self.model, opt, self.checkpoint_config)
        return self.optimizer

    def _shardopt(self) -> DistributedOptimizer:
        if not isinstance(self.optimizer, ShardoptAcceleratedOptimizer):
            raise RuntimeError("ShardoptTrainer: the optimizer was replaced after "
                               "create_optimizer; its state cannot be saved or loaded")
        return self.optimizer.optimizer

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Collective: every rank writes its part of the optimizer state."""
        _state.save(Path(output_dir) / STATE_DIR, self.model, self._shardopt(),
                    self.state.global_step, self.checkpoint_config)
        if self.args.should_save:
            with warnings.catch_warnings():  # torch's warning about saving a scheduler
                warnings.simplefilter("ignore", UserWarning)
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        """Collective. Load every rank's optimizer state at any number of processes;
        refuse the plain Trainer's ``optimizer.pt`` (rank 0's torch optimizer state)."""
        if checkpoint_dir is None:
            return
        directory = Path(checkpoint_dir)
        if not (directory / STATE_DIR).is_dir():
            if (directory / OPTIMIZER_FILE).is_file():
                raise checkpoint.CheckpointError(
                    f"{directory} holds no shardopt optimizer state but the plain Trainer's "
                    f"{OPTIMIZER_FILE} (a torch optimizer's state): ShardoptTrainer resumes "
                    "only checkpoints it saved; to start from the weights alone, load the "
                    "model with from_pretrained and train without resume_from_checkpoint")
            return  # a checkpoint without optimizer state (save_only_model), as the Trainer
        # The Trainer writes its state after the optimizer's: their steps agree unless that
        # save was interrupted.
        step = json.loads((directory / STATE_FILE).read_text())["global_step"]
        _state.load(directory, {"dir": STATE_DIR, "step": step}, self.model, self._shardopt(),
                    self.checkpoint_config)
        if (directory / SCHEDULER_FILE).is_file():
            self.lr_scheduler.load_state_dict(torch.load(directory / SCHEDULER_FILE,
                                                         weights_only=True))
