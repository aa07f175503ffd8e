"""Cross-rank agreement: every phase of a save or load ends with all ranks knowing whether
all of them succeeded, so that a rank that fails never leaves the others waiting."""

from __future__ import annotations

from typing import Any

from .. import comm
from ..errors import CheckpointError


def agree(dp: comm.DPGroup, error: BaseException | None, what: str,
          payload: Any = None) -> list[Any]:
    """Collective. Every rank's ``payload``; the same :class:`CheckpointError` on every
    rank if any rank brings an error (chained to the local one where there is one)."""
    payloads, detail = comm.agree(dp, error, payload)
    if detail is not None:
        raise CheckpointError(f"{what} failed: {detail}") from error
    return payloads
