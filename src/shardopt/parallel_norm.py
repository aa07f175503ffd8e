"""The global grad norm of a model-parallel optimizer (:mod:`.parallel`).

Every rank sums the squares of its DP shards of each param, weighted by ``1 / copies`` of
that param, and one all-reduce over the world (with the "got a gradient" flags, as in
:mod:`.grad_norm`) adds them up: each element is counted once, whether it is replicated
(plain params outside their DP group, ``Replicate()`` dims of a DTensor) or sharded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .grad_norm import GradNorm, contiguous_runs, sum_of_squares

if TYPE_CHECKING:
    from .buffers import FlatBuffers
    from .config import OptimizerConfig
    from .layout import Layout, ParamShard
    from .parallel import ParallelPlan


class ParallelGradNorm(GradNorm):
    """:class:`~shardopt.grad_norm.GradNorm` over the world, each param weighed by its copies."""

    def __init__(self, plan: ParallelPlan, buffers: FlatBuffers, layout: Layout,
                 config: OptimizerConfig, fqns: tuple[str, ...], written: set[str],
                 shards: Sequence[ParamShard]) -> None:
        super().__init__(plan.world, buffers, layout, config, fqns, written)
        self.copies = {fqn: r.copies for fqn, r in plan.params.items()}
        self._shards = shards
        self._by_copies: dict[int, list[torch.Tensor]] | None = None

    def local_sq(self) -> torch.Tensor:
        """This rank's share of the world's sum of squared grads (``1 / copies`` each)."""
        if self._by_copies is None:  # built lazily, as the base class's views are
            by_copies: dict[int, list[torch.Tensor]] = {}
            for s in self._shards:
                grads = self.buffers.step_grads[s.buffer_index]
                by_copies.setdefault(self.copies[s.fqn], []).append(
                    grads[s.range_global.as_slice()])
            self._by_copies = {c: contiguous_runs(v) for c, v in by_copies.items()}
        total = torch.zeros((), dtype=torch.float32, device=self.buffers.device)
        for copies, views in self._by_copies.items():
            sq = sum_of_squares(views, self.buffers.device)
            total = total + (sq if copies == 1 else sq / copies)
        return total
