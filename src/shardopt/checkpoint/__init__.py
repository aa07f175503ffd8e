"""Checkpoints: name-keyed, reshardable, pickle-free save and resume."""
