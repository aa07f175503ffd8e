"""Checkpoints: name-keyed, reshardable, pickle-free save and resume.

``save`` and ``load`` are collective over the optimizer's DP group; ``latest``,
``export``, ``inspect`` and ``verify`` run in a single process.
"""

from .export import export, inspect, verify
from .format import FormatError
from .io import CheckpointError, LoadInfo, latest, load, save

__all__ = ["CheckpointError", "FormatError", "LoadInfo", "export", "inspect", "latest", "load",
           "save", "verify"]
