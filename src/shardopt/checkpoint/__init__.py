"""Checkpoints: name-keyed, reshardable, pickle-free save and resume.

``save`` and ``load`` are collective over the optimizer's DP group (``save`` may finish in the
background: ``blocking=False``; ``prepare`` allocates its snapshot ahead, each rank its own);
``latest``, ``export``, ``inspect`` and ``verify`` run in a single process.
"""

from .agree import CheckpointError
from .background import SaveHandle
from .commit import latest
from .config import SNAPSHOTS, CheckpointConfig
from .export import export, inspect, verify
from .format import FormatError
from .load import LoadInfo, load
from .prepare import prepare
from .save import save

__all__ = ["SNAPSHOTS", "CheckpointConfig", "CheckpointError", "FormatError", "LoadInfo",
           "SaveHandle", "export", "inspect", "latest", "load", "prepare", "save", "verify"]
