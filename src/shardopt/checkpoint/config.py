"""Checkpoint settings: one validated dataclass accepted by ``save`` and ``load``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .format import DEFAULT_BLOCK_BYTES, MAX_BLOCK_BYTES, is_int
from ..errors import CheckpointError

# What a save does while another of this process is still being written.
BUSY_POLICIES = ("wait", "error")
# Where an asynchronous save copies the state (see .snapshot).
SNAPSHOTS = ("host",)
# Host memory a save or load stages data through at most (pinned when the optimizer is on a GPU).
STAGING_BYTES = 128 << 20


def refuse_invalid(checks: dict[str, tuple[bool, str]], values: dict[str, Any]) -> None:
    """Raise :class:`CheckpointError` naming the first setting whose check failed;
    ``checks`` maps a name to (valid, what it must be)."""
    for name, (ok, wanted) in checks.items():
        if not ok:
            raise CheckpointError(f"{name} must be {wanted}, got {values[name]!r}")


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """How :func:`~shardopt.checkpoint.save` and :func:`~shardopt.checkpoint.load` work
    (passed as ``config=``; the arguments of those functions are not repeated here)."""

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
    rollback: bool = False
    """Save: replace committed checkpoints of steps at or after this one (an abandoned branch)
    although this run did not resume from the root at or before it (``checkpoint.load``)."""
    block_bytes: int = DEFAULT_BLOCK_BYTES
    """Save: the hash block size of the data files."""
    if_busy: str = "wait"
    """Save while an asynchronous save is in flight: ``"wait"`` for it, or ``"error"``."""
    snapshot: str = "host"
    """Asynchronous save: where the state is copied; ``"host"``, the only kind: one reused
    copy of the rank's state in host memory (:mod:`.snapshot`)."""
    drain_piece_bytes: int = 64 << 20
    """Asynchronous save: the most bytes the drain copies at a time (:mod:`.drain`; why this
    size: docs/async_save.md, Host reads during the snapshot)."""
    drain_in_flight: int = 1
    """Asynchronous save on a GPU: the drain's pieces queued at once."""

    def __post_init__(self) -> None:
        refuse_invalid({
            "verify": (isinstance(self.verify, bool), "a bool"),
            "hyperparameters": (self.hyperparameters in ("saved", "current"),
                                "'saved' or 'current'"),
            "io_threads": (self.io_threads is None or is_int(self.io_threads, 1),
                           "an int >= 1 or None"),
            "staging_bytes": (is_int(self.staging_bytes, 1), "an int >= 1"),
            "block_bytes": (is_int(self.block_bytes, 1) and self.block_bytes <= MAX_BLOCK_BYTES,
                            f"an int in [1, {MAX_BLOCK_BYTES}]"),
            "rollback": (isinstance(self.rollback, bool), "a bool"),
            "if_busy": (self.if_busy in BUSY_POLICIES, "'wait' or 'error'"),
            "snapshot": (self.snapshot in SNAPSHOTS, "'host'"),
            "drain_piece_bytes": (is_int(self.drain_piece_bytes, 1), "an int >= 1"),
            "drain_in_flight": (is_int(self.drain_in_flight, 1), "an int >= 1"),
        }, vars(self))


# ``save``'s and ``load``'s own arguments: (valid, what each must be).
_ARGUMENTS = {
    "blocking": (lambda v: isinstance(v, bool), "a bool"),
    "keep_last": (lambda v: v is None or is_int(v, 1), "an int >= 1 or None"),
    "low_memory_resume": (lambda v: isinstance(v, (bool, type(None))), "a bool or None"),
}


def settings(config: CheckpointConfig | None, **arguments: Any) -> CheckpointConfig:
    """``config`` (the defaults where it is None), after checking the ``arguments`` of
    ``save`` or ``load`` passed beside it."""
    refuse_invalid({k: (_ARGUMENTS[k][0](v), _ARGUMENTS[k][1]) for k, v in arguments.items()},
                   arguments)
    if config is None:
        return CheckpointConfig()
    if not isinstance(config, CheckpointConfig):
        raise CheckpointError(f"config must be a CheckpointConfig, got {type(config).__name__}")
    return config
