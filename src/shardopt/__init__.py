"""shardopt: a data-parallel sharded AdamW (ZeRO-1/2), with Muon for chosen matrices, and
exact, reshardable checkpoints.

Where things live, lowest layer first. ``tests/core/test_layering.py`` fails on an import cycle
and on any upward import between its layers: the core (the first six groups below),
``shardopt.checkpoint``, this package's ``__init__``, and ``recipes`` / ``cli``.

* records and rules: ``errors``, ``config``, ``layout`` (which element of which buffer belongs
  to which param and rank), ``boxes``, ``quant``; collectives: ``comm``;
* ``buffers`` (flat param and grad buffers), ``parallel`` (DTensor params, DP groups);
* the shard state: ``shard_state`` (every flat state tensor and where it lives), ``moments``;
* the step: ``optimizer`` (``DistributedOptimizer.step``, its three phases), ``sync`` (phases 1
  and 3: grad reduction, param gather), ``grad_norm``, ``update`` and ``kernels`` (phase 2, the
  fused AdamW), ``muon`` and ``muon_update``;
* offload: ``host_state`` (``offload()`` / ``onload()``, ``low_memory_resume``'s staging);
* torch-facing views: ``state_dict``, ``local_state`` (``opt.state``), ``flat_shard``,
  ``box_shard``; the layers above reach the optimizer through ``shard_access``
  (``opt.shard_state``) only;
* :mod:`shardopt.checkpoint`: ``save``, ``load``, ``export``; the on-disk format in
  ``checkpoint.format`` and ``checkpoint.manifest`` (docs/format.md); background saves in
  ``checkpoint.background``, ``checkpoint.snapshot`` and ``checkpoint.drain``;
* ``recipes`` and ``cli``, which use the library from outside: the reference job, the adapters
  for Lightning, Accelerate and the Hugging Face Trainer (``recipes.integrations``), and the
  ``shardopt`` command.
"""

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
