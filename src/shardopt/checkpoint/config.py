"""Checkpoint settings: one validated dataclass accepted by ``save`` and ``load``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .agree import CheckpointError
from .format import DEFAULT_BLOCK_BYTES, MAX_BLOCK_BYTES

# What a save does while another of this process is still being written.
BUSY_POLICIES = ("wait", "error")
# Where an asynchronous save copies the state (see .snapshot).
SNAPSHOTS = ("host", "device_staged")

# Host memory a save or load stages data through at most (pinned when the optimizer is on a GPU).
STAGING_BYTES = 128 << 20


def _is_int(v: Any, minimum: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """How :func:`~shardopt.checkpoint.save` and :func:`~shardopt.checkpoint.load` work.
    Each field may also be passed to them as a keyword argument of the same name, which
    overrides the ``config``'s value."""

    low_memory_resume: bool | None = None
    """Load: keep the loaded Adam moments in host memory until the first ``step()``;
    ``None``: the optimizer config's ``low_memory_resume``."""
    hyperparameters: str = "saved"
    """Load: ``"saved"`` restores each param group's ``lr``, ``betas``, ``eps`` and
    ``weight_decay`` as saved (an error if the params are grouped otherwise than when saved);
    ``"current"`` keeps the optimizer's values (a changed ``param_group_fn``)."""
    verify: bool = True
    """Load: check the content hash of every block read."""
    io_threads: int | None = None
    """Files a rank writes at once, blocks it reads at once; ``None``: this process's share
    of the node's CPUs, 2 to 16."""
    staging_bytes: int = STAGING_BYTES
    """Host memory (pinned for a GPU optimizer) a save or load stages data through at most."""
    keep_last: int | None = None
    """Save: delete older committed checkpoints beyond the newest ``keep_last``."""
    rollback: bool = False
    """Save: replace committed checkpoints of steps at or after this one (the branch a
    rollback abandons) although this run did not resume from the root at or before this
    step (with ``checkpoint.load``, which allows it by itself); otherwise such a save is
    refused and nothing changes."""
    block_bytes: int = DEFAULT_BLOCK_BYTES
    """Save: the hash block size of the data files."""
    blocking: bool = True
    """Save: ``False`` copies the state and writes it in the background (``save`` returns a
    handle; see :mod:`.background`)."""
    if_busy: str = "wait"
    """Save while an asynchronous save is in flight: ``"wait"`` for it, or ``"error"``."""
    snapshot: str = "host"
    """Asynchronous save on a GPU: copy the state to pinned ``"host"`` memory (one copy of
    the rank's state, reused), drained in small pieces from where it lives; or to spare
    device memory written out through the ``staging_bytes`` pinned buffers
    (``"device_staged"``: no host copy). See :mod:`.snapshot`."""

    def __post_init__(self) -> None:
        checks = {  # field: (valid, what it must be)
            "low_memory_resume": (isinstance(self.low_memory_resume, (bool, type(None))),
                                  "a bool or None"),
            "verify": (isinstance(self.verify, bool), "a bool"),
            "hyperparameters": (self.hyperparameters in ("saved", "current"),
                                "'saved' or 'current'"),
            "io_threads": (self.io_threads is None or _is_int(self.io_threads, 1),
                           "an int >= 1 or None"),
            "staging_bytes": (_is_int(self.staging_bytes, 1), "an int >= 1"),
            "keep_last": (self.keep_last is None or _is_int(self.keep_last, 1),
                          "an int >= 1 or None"),
            "block_bytes": (_is_int(self.block_bytes, 1) and self.block_bytes <= MAX_BLOCK_BYTES,
                            f"an int in [1, {MAX_BLOCK_BYTES}]"),
            "blocking": (isinstance(self.blocking, bool), "a bool"),
            "rollback": (isinstance(self.rollback, bool), "a bool"),
            "if_busy": (self.if_busy in BUSY_POLICIES, "'wait' or 'error'"),
            "snapshot": (self.snapshot in SNAPSHOTS, "'host' or 'device_staged'"),
        }
        for name, (ok, wanted) in checks.items():
            if not ok:
                raise CheckpointError(f"{name} must be {wanted}, got "
                                      f"{getattr(self, name)!r}")


def resolve_config(config: CheckpointConfig | None, **overrides: Any) -> CheckpointConfig:
    """``config`` (or the defaults) with the keyword arguments that were passed (not None)."""
    if config is not None and not isinstance(config, CheckpointConfig):
        raise CheckpointError(f"config must be a CheckpointConfig, got {type(config).__name__}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(config or CheckpointConfig(), **given)
