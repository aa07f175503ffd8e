"""What the framework adapters share, with no framework imported: the checks of the optimizer
they are given, and one optimizer's state saved and loaded through :mod:`shardopt.checkpoint`
in a directory of the framework's checkpoint, with a small marker in the framework's own file
in place of the state."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from shardopt import checkpoint
from shardopt.checkpoint.format import step_dir_name
from shardopt import DistributedOptimizer

# The key of the marker that stands in a framework's file for the optimizer state that
# shardopt.checkpoint saved beside it.
MARKER = "shardopt_checkpoint"


def check_optimizer(opt: Any, model: torch.nn.Module, world_size: int, fix: str) -> None:
    """Raise ``ValueError`` unless ``opt`` is a :class:`DistributedOptimizer` built over
    ``model`` across ``world_size`` ranks; ``fix`` says how to build it."""
    if not isinstance(opt, DistributedOptimizer):
        raise ValueError(f"got a {type(opt).__module__}.{type(opt).__qualname__}, not a "
                         f"shardopt.DistributedOptimizer: {fix}")
    opt.shard_state.check_model(model)
    if not opt.config.param_grads:  # the frameworks clip, unscale and log p.grad
        raise ValueError(
            f"the DistributedOptimizer has grad_mode={opt.config.grad_mode!r}, which leaves "
            "p.grad None after backward: the framework's clipping, GradScaler and grad-norm "
            "logging would see no gradient. Build it with grad_mode='torch' (the default)")
    if opt.shard_state.dp.size != world_size:
        raise ValueError(
            f"the DistributedOptimizer spans {opt.shard_state.dp.size} rank(s) but the framework runs "
            f"{world_size}: it was built before the process group existed, or over another "
            f"group; {fix}")


def steps_taken(opt: DistributedOptimizer) -> int:
    """Optimizer steps taken so far (the most any param took), to label a save with."""
    return max(opt.param_steps.values(), default=0)


def save(root: Path, model: torch.nn.Module, opt: DistributedOptimizer, step: int,
         config: checkpoint.CheckpointConfig | None) -> dict[str, Any]:
    """Collective. Save ``model`` and ``opt`` as the only checkpoint under ``root`` (a save
    of the same name replaces the one before it, as the frameworks' files are replaced);
    return the marker for the framework's file."""
    rollback = dataclasses.replace(config or checkpoint.CheckpointConfig(), rollback=True)
    checkpoint.save(root, model, opt, step=step, keep_last=1, config=rollback)
    return {MARKER: {"dir": root.name, "step": step}}


def marker_of(obj: Any) -> dict[str, Any] | None:
    """The marker inside ``obj`` (what :func:`save` returned, as the framework stored it),
    or None when ``obj`` is something else (another optimizer's state dict)."""
    if isinstance(obj, dict) and isinstance(obj.get(MARKER), dict):
        return obj[MARKER]
    return None


def load(directory: Path, marker: dict[str, Any], model: torch.nn.Module,
         opt: DistributedOptimizer, config: checkpoint.CheckpointConfig | None
         ) -> checkpoint.LoadInfo:
    """Collective. Load the state ``marker`` names from under ``directory`` into ``model``
    and ``opt``, at any number of ranks. Refuses, changing nothing, a directory whose state
    is of another step than the framework's file (a save interrupted between the two)."""
    root = directory / marker["dir"]
    found = checkpoint.latest(root)
    want = step_dir_name(int(marker["step"]))
    if found is None or Path(found).name != want:
        raise checkpoint.CheckpointError(
            f"{directory}: the framework's file names optimizer state {marker['dir']}/{want}, "
            f"but {root} holds {Path(found).name if found else 'no committed checkpoint'} "
            "(a save was interrupted between the two, or files were moved): resume from "
            "another checkpoint")
    return checkpoint.load(found, model, opt, config=config)
