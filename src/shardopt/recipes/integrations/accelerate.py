"""Accelerate: ``prepare(accelerator, model, optimizer, *others)`` in place of
``accelerator.prepare(model, optimizer, *others)``.

Build the model, move it to ``accelerator.device``, build the
:class:`~shardopt.DistributedOptimizer` over it (after ``Accelerator()``, which starts the
process group), then call :func:`prepare`. It prepares the model as Accelerate prepares one
for evaluation (mixed-precision autocast and ``torch.compile`` as configured, no DDP
wrapper: the optimizer averages the gradients itself) and gives it a ``no_sync`` that is the
optimizer's, so ``accelerator.accumulate(model)`` and ``accelerator.no_sync(model)`` skip the
optimizer's communication as they skip DDP's. The optimizer is wrapped as Accelerate wraps
every optimizer (``step`` and ``zero_grad`` only at the end of an accumulation window, the
GradScaler of fp16), without its usual round trip of the state to the device.

``accelerator.save_state(dir)`` then writes every rank's optimizer state through
:mod:`shardopt.checkpoint` into ``dir/shardopt`` (a save pre-hook) and a small marker in
Accelerate's ``optimizer.bin`` in place of rank 0's state; ``accelerator.load_state(dir)``
loads it (a load pre-hook, at any number of processes) before Accelerate loads the model
weights, scheduler, RNG and dataloader states it saved itself.
"""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import OPTIMIZER_NAME

from shardopt import checkpoint
from shardopt import DistributedOptimizer
from . import _state

STATE_DIR = "shardopt"
_FIX = ("build shardopt.DistributedOptimizer(model, shardopt.OptimizerConfig(...)) after "
        "Accelerator() and model.to(accelerator.device), then call "
        "shardopt.recipes.integrations.accelerate.prepare(accelerator, model, optimizer, ...)")
# Accelerate's settings in which it shards or reduces gradients its own way.
_REFUSED = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")


def prepare(accelerator: Accelerator, model: torch.nn.Module, optimizer: DistributedOptimizer,
            *others: Any, checkpoint_config: checkpoint.CheckpointConfig | None = None
            ) -> tuple[Any, ...]:
    """Prepare ``model`` and ``optimizer`` (built over it) for ``accelerator`` (module
    docstring), then ``others`` (dataloaders, schedulers) with ``accelerator.prepare``;
    returns them all in the order given. ``checkpoint_config`` sets how ``save_state`` and
    ``load_state`` write and read the optimizer state."""
    model, wrapped = prepare_model_and_optimizer(accelerator, model, optimizer,
                                                 checkpoint_config)
    rest = accelerator.prepare(*others) if others else ()
    rest = rest if isinstance(rest, tuple) else (rest,)
    return (model, wrapped, *rest)


def prepare_model_and_optimizer(accelerator: Accelerator, model: torch.nn.Module,
                                optimizer: DistributedOptimizer,
                                checkpoint_config: checkpoint.CheckpointConfig | None = None
                                ) -> tuple[torch.nn.Module, ShardoptAcceleratedOptimizer]:
    """:func:`prepare` for the model and the optimizer alone."""
    kind = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    if kind in _REFUSED:
        raise ValueError(f"Accelerate is set up for {kind}, which shards or reduces the "
                         "gradients itself; shardopt takes DDP's place: use Accelerate's "
                         "plain multi-process setting (no DeepSpeed/FSDP/Megatron config)")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError("the model is wrapped in DistributedDataParallel (by "
                         f"accelerator.prepare?): {_FIX} with the unwrapped model")
    _state.check_optimizer(optimizer, model, accelerator.num_processes, _FIX)
    if not _same_device(optimizer.shard_state.device, accelerator.device):
        raise ValueError(f"the optimizer's params are on {optimizer.shard_state.device} but "
                         f"Accelerate trains on {accelerator.device}: {_FIX}")
    model.no_sync = _NoSync(optimizer)
    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    wrapped = accelerator.prepare_optimizer(optimizer, device_placement=False)
    wrapped.__class__ = ShardoptAcceleratedOptimizer  # adds the checkpoint methods only
    wrapped._is_accelerate_prepared = True  # a later accelerator.prepare keeps it as it is
    wrapped.shardopt = _Checkpointing(accelerator, wrapped, model, checkpoint_config)
    accelerator.register_save_state_pre_hook(wrapped.shardopt.before_save)
    accelerator.register_load_state_pre_hook(wrapped.shardopt.before_load)
    return model, wrapped


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cpu":  # Accelerate says cpu:0 where the params say cpu
        return True
    index = lambda d: d.index if d.index is not None else torch.cuda.current_device()  # noqa: E731
    return index(a) == index(b)


class ShardoptAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's wrapper of a :class:`DistributedOptimizer`, whose ``save_state`` /
    ``load_state`` go through :mod:`shardopt.checkpoint` (module docstring). Outside them,
    ``state_dict()`` and ``load_state_dict()`` are the optimizer's."""

    shardopt: _Checkpointing

    def state_dict(self) -> dict[str, Any]:
        marker = self.shardopt.take_marker()
        return marker if marker is not None else self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.shardopt.took_load(state_dict):
            return
        self.optimizer.load_state_dict(state_dict)


class _Checkpointing:
    """The pre-hooks of one prepared optimizer's ``save_state``/``load_state``."""

    def __init__(self, accelerator: Accelerator, wrapped: ShardoptAcceleratedOptimizer,
                 model: torch.nn.Module, config: checkpoint.CheckpointConfig | None) -> None:
        self.accelerator, self.wrapped = weakref.ref(accelerator), weakref.ref(wrapped)
        self.model, self.config = weakref.ref(model), config
        self._marker: dict[str, Any] | None = None  # for the save_state in progress
        self._loaded: Path | None = None  # the load_state in progress

    def _index(self) -> int | None:
        """The optimizer's place among the accelerator's, which names its files."""
        accelerator, wrapped = self.accelerator(), self.wrapped()
        if accelerator is None or wrapped is None:
            return None
        return next((i for i, o in enumerate(accelerator._optimizers) if o is wrapped), None)

    def before_save(self, _models: list[torch.nn.Module], _weights: list[Any],
                    output_dir: str) -> None:
        """Collective (``save_state`` runs on every process)."""
        model, wrapped, index = self.model(), self.wrapped(), self._index()
        if model is None or wrapped is None or index is None:
            return
        opt = wrapped.optimizer
        root = Path(output_dir) / (STATE_DIR if index == 0 else f"{STATE_DIR}_{index}")
        self._marker = _state.save(root, model, opt, _state.steps_taken(opt), self.config)

    def take_marker(self) -> dict[str, Any] | None:
        marker, self._marker = self._marker, None
        return marker

    def before_load(self, _models: list[torch.nn.Module], input_dir: str) -> None:
        """Collective (``load_state`` runs on every process)."""
        model, wrapped, index = self.model(), self.wrapped(), self._index()
        if model is None or wrapped is None or index is None:
            return
        directory = Path(input_dir)
        # Accelerate's name for the optimizer's file, which holds the marker.
        marker_file = directory / (f"{OPTIMIZER_NAME}.bin" if index == 0
                                   else f"{OPTIMIZER_NAME}_{index}.bin")
        marker = _state.marker_of(torch.load(marker_file, weights_only=True)) \
            if marker_file.is_file() else None
        if marker is None:
            raise checkpoint.CheckpointError(
                f"{directory} holds no shardopt optimizer state ({marker_file.name} is "
                "missing or holds another optimizer's state: saved without "
                "shardopt.recipes.integrations.accelerate.prepare): resume from a save_state of the "
                "prepared optimizer")
        _state.load(directory, marker, model, wrapped.optimizer, self.config)
        self._loaded = directory

    def took_load(self, state_dict: Any) -> bool:
        """Whether ``state_dict`` is the marker of the state :meth:`before_load` loaded."""
        if _state.marker_of(state_dict) is None:
            return False
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            raise checkpoint.CheckpointError(
                "this optimizer's state was saved through shardopt.checkpoint beside this "
                "marker: load it with accelerator.load_state(dir), which reads it")
        return True


class _NoSync:
    """``model.no_sync`` of a prepared model: the optimizer's ``no_sync()``. Holds the
    optimizer weakly and pickles as a no-op (``torch.save(model)`` stores no optimizer)."""

    def __init__(self, opt: DistributedOptimizer | None) -> None:
        self._opt = weakref.ref(opt) if opt is not None else None

    def __call__(self) -> Any:
        opt = self._opt() if self._opt is not None else None
        return opt.no_sync() if opt is not None else contextlib.nullcontext()

    def __reduce__(self) -> Any:
        return (_NoSync, (None,))
