"""shardopt: a data-parallel sharded AdamW (ZeRO-1/2) with exact, reshardable checkpoints."""

from . import checkpoint
from .config import OptimizerConfig
from .flat_shard import FlatShard
from .optimizer import DistributedOptimizer
from .param_watch import ParamMovedError

__all__ = ["DistributedOptimizer", "FlatShard", "OptimizerConfig", "ParamMovedError", "checkpoint"]
__version__ = "0.1.0"
