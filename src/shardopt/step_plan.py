"""Which params one optimizer step updates, and at which step count.

As ``torch.optim.AdamW`` does, a param that got no gradient on any DP rank is left alone and
its own step count stays (``DistributedOptimizer.param_steps``, FQN -> updates applied). The
common case keeps one launch per (buffer, param group): :func:`next_steps` says per group
whether all its params are updated at one count; others are split by :func:`split`. ``got``
is the set of FQNs that got a gradient on some rank in this step, or None for all.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from .layout import ParamShard


def next_steps(param_steps: dict[str, int], group_fqns: Sequence[Sequence[str]],
               got: frozenset[str] | None) -> list[int | None]:
    """Per param group: the count all its params reach in this step, when every one of
    them is updated and they share a count now; else None (the group takes subsets)."""
    out: list[int | None] = []
    for fqns in group_fqns:
        counts = list(map(param_steps.__getitem__, fqns))
        uniform = bool(counts) and counts.count(counts[0]) == len(counts)
        out.append(counts[0] + 1 if uniform and (got is None or got.issuperset(fqns)) else None)
    return out


def advance(param_steps: dict[str, int], group_fqns: Sequence[Sequence[str]],
            got: frozenset[str] | None, steps: Sequence[int | None]) -> None:
    """Count this step for every param it updated (``steps`` from :func:`next_steps`)."""
    for fqns, n in zip(group_fqns, steps):
        if n is not None:
            param_steps.update(zip(fqns, repeat(n)))
            continue
        for fqn in fqns:
            if got is None or fqn in got:
                param_steps[fqn] += 1


def split(shard_ids: Sequence[int], shards: Sequence[ParamShard], param_steps: dict[str, int],
          got: frozenset[str] | None) -> dict[tuple[int, int], list[int]]:
    """(buffer index, count after this step) -> the ids among ``shard_ids`` (indices into
    ``shards``) of the shards this step updates, in order."""
    out: dict[tuple[int, int], list[int]] = {}
    for i in shard_ids:
        fqn = shards[i].fqn
        if got is None or fqn in got:
            out.setdefault((shards[i].buffer_index, param_steps[fqn] + 1), []).append(i)
    return out


class KeptGrads:
    """The zero grads ``zero_grad(set_to_none=False)`` keeps: torch keeps a zero ``p.grad`` for
    every param that got a gradient since ``set_to_none=True``, and AdamW steps such a param."""

    def __init__(self) -> None:
        self.had: set[str] | None = set()  # got a gradient since set_to_none (None: all)
        self.kept: frozenset[str] | None = frozenset()  # zero grads now (None: all)

    def zero_grad(self, set_to_none: bool) -> None:
        if set_to_none:
            self.had = set()
        self.kept = (frozenset() if set_to_none else None if self.had is None
                     else frozenset(self.had))

    def step(self, got: frozenset[str] | None, fqns: Sequence[str]) -> frozenset[str] | None:
        """``got`` widened by the kept zero grads (then consumed, as step() consumes grads)."""
        if got is not None and self.kept != frozenset():
            got = None if self.kept is None or len(got | self.kept) == len(fqns) \
                else got | self.kept
        if self.had is not None:
            self.had = None if got is None else self.had | got
        self.kept = frozenset()
        return got
