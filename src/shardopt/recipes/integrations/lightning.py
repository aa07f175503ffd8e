"""Lightning: ``Trainer(strategy=ShardoptStrategy(), ...)`` trains with a
:class:`~shardopt.DistributedOptimizer` at any number of processes.

The LightningModule's ``configure_optimizers`` returns ``DistributedOptimizer(self, config)``
(with any LR schedulers over it). The strategy launches and connects the processes as
Lightning's DDP strategy does, but leaves the module unwrapped: the optimizer averages the
gradients itself. Lightning's own machinery then works as with DDP and a torch optimizer:

* ``accumulate_grad_batches``: the micro-batches Lightning marks as not to be synced run
  under ``optimizer.no_sync()`` (:meth:`ShardoptStrategy.block_backward_sync`);
* ``gradient_clip_val`` and ``precision`` ("bf16-mixed", "16-mixed", "bf16-true", ...) go
  through Lightning's precision plugin, which clips and unscales ``p.grad``;
* checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``, ``fit(ckpt_path=...)``):
  a checkpoint is a directory holding Lightning's file ``lightning.ckpt`` (written by rank 0
  through the strategy's ``CheckpointIO``, with a marker in place of the optimizer state) and
  a :mod:`shardopt.checkpoint` directory ``optimizer/`` every rank writes its part of. It
  resumes bit for bit at the same number of processes and loads at any other. A checkpoint
  of weights only (``save_weights_only=True``) is Lightning's usual single file.

Everything here is Lightning's public strategy surface (the hooks its DeepSpeed and FSDP
strategies override); the launcher, process group and collectives are those of
``DDPStrategy``, which this strategy extends.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from shardopt import checkpoint
from shardopt import DistributedOptimizer
from . import _state

LIGHTNING_FILE = "lightning.ckpt"
STATE_DIR = "optimizer"
_FIX = ("return shardopt.DistributedOptimizer(self, shardopt.OptimizerConfig(lr=...)) from "
        "configure_optimizers (with any LR schedulers built over it)")


class ShardoptStrategy(DDPStrategy):
    """Lightning's DDP launch and process group, no DDP wrapper, shardopt checkpoints.

    ``checkpoint_config`` (a :class:`shardopt.checkpoint.CheckpointConfig`) sets how the
    optimizer state is saved and loaded (threads, verification, ``low_memory_resume``);
    the other arguments are those of ``DDPStrategy`` that do not configure DDP itself.
    """

    strategy_name = "shardopt"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        checkpoint_config: checkpoint.CheckpointConfig | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method)
        self.checkpoint_config = checkpoint_config

    # ------------------------------------------------------------- the model
    def configure_ddp(self) -> None:
        """Leave the LightningModule unwrapped: the optimizer reduces its gradients."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        self.shardopt_optimizer()  # refuse anything else now, not at the first save

    def shardopt_optimizer(self) -> DistributedOptimizer:
        """The one :class:`DistributedOptimizer` of ``configure_optimizers``; raises
        ``ValueError`` saying what to return otherwise."""
        if len(self.optimizers) != 1:
            raise ValueError(f"ShardoptStrategy trains one optimizer; configure_optimizers "
                             f"returned {len(self.optimizers)}: {_FIX}")
        opt = self.optimizers[0]
        _state.check_optimizer(opt, self.lightning_module, self.world_size, _FIX)
        return opt

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Micro-batches Lightning accumulates without syncing run under ``no_sync()``."""
        with contextlib.ExitStack() as stack:
            for opt in self.optimizers:
                if isinstance(opt, DistributedOptimizer):
                    stack.enter_context(opt.no_sync())
            yield

    def teardown(self) -> None:
        """Lightning's teardown without moving the module and the optimizer state to the
        CPU: the params live in the optimizer's flat buffers, which hold their memory as long
        as the optimizer exists, and moved they would leave them (a save or test after
        ``fit`` would then be refused)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if self._layer_sync is not None and trainer is not None and \
                trainer.state.fn == TrainerFn.FITTING:
            self.model = self._layer_sync.revert(self.model)  # sync_batchnorm=True
        for part in (self.cluster_environment, self.precision_plugin, self.accelerator,
                     self.checkpoint_io):
            if part is not None:
                part.teardown()

    # ------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizer must exist to load its state

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        # The state itself is written by save_checkpoint on every rank; Lightning's dict
        # gets the marker there.
        return {}

    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Collective (for a checkpoint with optimizer state): ``filepath`` becomes a
        directory of Lightning's file and the shardopt checkpoint (module docstring)."""
        if "optimizer_states" not in checkpoint_dict:  # weights only: Lightning's own file
            super().save_checkpoint(checkpoint_dict, filepath, storage_options)
            return
        path = Path(filepath)
        if self.is_global_zero and path.is_file():  # replaced, as Lightning replaces files
            path.unlink()
        self.barrier("ShardoptStrategy.save_checkpoint")
        marker = _state.save(path / STATE_DIR, self.lightning_module, self.shardopt_optimizer(),
                             int(checkpoint_dict["global_step"]), self.checkpoint_config)
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint({**checkpoint_dict, "optimizer_states": [marker]},
                                               path / LIGHTNING_FILE,
                                               storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if not path.is_dir():
            return super().load_checkpoint(path, weights_only=weights_only)
        if not (path / LIGHTNING_FILE).is_file():
            raise checkpoint.CheckpointError(
                f"{path} is a directory without {LIGHTNING_FILE}: not a checkpoint that "
                "ShardoptStrategy saved")
        loaded = super().load_checkpoint(path / LIGHTNING_FILE, weights_only=weights_only)
        loaded["shardopt_directory"] = str(path)  # where the marker's directory is
        return loaded

    def load_optimizer_state_dict(self, checkpoint_dict: Any) -> None:
        """Collective. Load every rank's optimizer state from the shardopt checkpoint beside
        Lightning's file, at any number of processes; refuse another strategy's state."""
        states = checkpoint_dict["optimizer_states"]
        marker = _state.marker_of(states[0]) if len(states) == 1 else None
        where = checkpoint_dict.get("shardopt_directory")
        if marker is None or where is None:
            raise checkpoint.CheckpointError(
                "the checkpoint holds no shardopt optimizer state (its optimizer_states are "
                "another strategy's, torch optimizer state dicts, or it was saved as a single "
                "file): ShardoptStrategy resumes only checkpoints it saved. To start from its "
                "weights alone, load them into the model (model.load_state_dict("
                "torch.load(path)['state_dict'])) and fit without ckpt_path")
        _state.load(Path(where), marker, self.lightning_module, self.shardopt_optimizer(),
                    self.checkpoint_config)

    def remove_checkpoint(self, filepath: Any) -> None:
        path = Path(filepath)
        if self.is_global_zero and path.is_dir():
            shutil.rmtree(path)
        else:
            super().remove_checkpoint(filepath)
