"""Cross-rank agreement: every phase of a save or load ends with all ranks knowing whether
all of them succeeded, so that a rank that fails never leaves the others waiting."""

from __future__ import annotations

from typing import Any

from .. import comm


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file, FQN or rank."""


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"


def agree(dp: comm.DPGroup, error: BaseException | None, what: str,
          payload: Any = None) -> list[Any]:
    """Collective. Every rank's ``payload``; the same :class:`CheckpointError` on every
    rank if any rank brings an error (chained to the local one where there is one)."""
    gathered = comm.all_gather_objects((payload, None if error is None else _describe(error)), dp)
    failed: dict[str, list[int]] = {}
    for r, (_, e) in enumerate(gathered):
        if e is not None:
            failed.setdefault(e, []).append(r)
    if failed:
        # The same problem seen by many ranks is reported once, with its ranks.
        detail = "; ".join(f"[dp rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}] {e}"
                           for e, rs in failed.items())
        raise CheckpointError(f"{what} failed: {detail}") from error
    return [p for p, _ in gathered]


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else f"{g[0]}" for g in runs)
