"""Which checkpoint the ranks of one job load: one, chosen once.

A root resolved by every rank on its own (its ``latest``) can put the ranks of one job on
different steps when another job commits into that root meanwhile. So :func:`~.load.load`
starts with one exchange (collective, over the DP group):

1. Coordinator-free (:func:`propose`): DP rank 0 resolves what it was given (a root: the
   checkpoint :func:`~.commit.latest` names) and parses its manifest; every other rank
   given a checkpoint directory parses that one; a rank given a root looks at nothing yet.
2. Exchange: every rank's :class:`Choice` (what it was given, what it found and the
   manifest's checksum), or every rank raises.
3. Coordinator-free (:func:`settle`): checkpoints given explicitly whose manifest differs
   from rank 0's are refused by every rank alike, from the exchange alone. A rank given
   the root rank 0 was given parses rank 0's choice; one given another root resolves its
   own. Every rank's manifest must then have rank 0's checksum: one that differs (the
   checkpoint was replaced between the two reads) fails that rank, and so every rank, at
   the load's next exchange.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .agree import CheckpointError
from .commit import is_checkpoint_dir, resolve
from .manifest import Manifest, parse


@dataclass(frozen=True)
class Choice:
    """What one rank was asked to load and what it found there (sent to every rank)."""

    given: str  # the argument, a path
    root: bool  # a root (load its latest checkpoint), not a checkpoint directory
    path: str | None  # the checkpoint found: DP rank 0 always, others when given one
    checksum: str | None  # of its manifest


def propose(root_or_path: str | os.PathLike, rank: int) -> tuple[Choice, Manifest | None]:
    """Coordinator-free. Step 1: this rank's :class:`Choice` and the manifest it parsed."""
    given = Path(root_or_path)
    root = not is_checkpoint_dir(given)
    if root and rank != 0:
        return Choice(str(given), True, None, None), None
    m = parse(resolve(given))
    return Choice(str(given), root, str(m.path), m.checksum), m


def settle(mine: Choice, found: Manifest | None, choices: list[Choice], rank: int) -> Manifest:
    """Coordinator-free. Step 3: the manifest this rank loads; :class:`CheckpointError`
    naming both checkpoints where it is not the one DP rank 0 chose."""
    first = choices[0]
    differ = [r for r, c in enumerate(choices) if c.checksum not in (None, first.checksum)]
    if differ:
        shown = "; ".join(f"dp rank {r}: {choices[r].path} (manifest {choices[r].checksum})"
                          for r in [0, *differ])
        raise CheckpointError(f"the ranks were given different checkpoints ({shown}); every "
                              "rank must load the same one: give every rank the same path, or "
                              "the root, whose latest checkpoint dp rank 0 then chooses for all")
    if found is None:
        same_root = first.root and _same_dir(first.given, mine.given)
        found = parse(Path(first.path) if same_root else resolve(mine.given))
    if found.checksum != first.checksum:
        raise CheckpointError(
            f"dp rank 0 chose {first.path} (manifest {first.checksum}), but this rank found "
            f"{found.path} (manifest {found.checksum}): every rank must load the same checkpoint "
            "(was it replaced meanwhile, or another root given?)")
    return found


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # rank 0's path may not exist on this rank's node
        return False


__all__ = ["Choice", "propose", "settle"]
