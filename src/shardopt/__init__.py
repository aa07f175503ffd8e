"""shardopt: a data-parallel sharded AdamW (ZeRO-1/2), with Muon for chosen matrices, and
exact, reshardable checkpoints."""

from . import checkpoint
from .box_shard import BoxShard
from .config import OptimizerConfig
from .errors import (CheckpointError, FormatError, GradientOrderError, LockTimeout,
                     LowPrecisionStateError, OffloadError, ParamMovedError, ProcessGroupError,
                     StateDictError, StateWriteError, UsageError, WrappedModelError)
from .flat_shard import FlatShard
from .muon import MuonSettings, muon_groups
from .optimizer import DistributedOptimizer

__all__ = ["BoxShard", "CheckpointError", "DistributedOptimizer", "FlatShard", "FormatError",
           "GradientOrderError", "LockTimeout", "LowPrecisionStateError", "MuonSettings",
           "OffloadError", "OptimizerConfig", "ParamMovedError", "ProcessGroupError",
           "StateDictError", "StateWriteError", "UsageError", "WrappedModelError", "checkpoint",
           "muon_groups"]
__version__ = "0.1.0"
