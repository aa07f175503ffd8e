"""The collective agreement of a step: the global gradient norm (for clipping and
``last_grad_norm``) and which params got a gradient on some rank, in one all-reduce."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import comm

if TYPE_CHECKING:
    from .buffers import FlatBuffers
    from .config import OptimizerConfig
    from .layout import Layout


class GradNorm:
    """What one optimizer's ``step()`` agrees on, and the views it reads for that."""

    def __init__(self, dp: comm.DPGroup, buffers: FlatBuffers, layout: Layout,
                 config: OptimizerConfig, fqns: tuple[str, ...], written: set[str]) -> None:
        self.dp, self.buffers, self.layout, self.config = dp, buffers, layout, config
        self.device = buffers.device
        self.fqns = fqns  # order of the grad-presence flags
        self.written = written  # the optimizer's: params that got a gradient on this rank
        self._views: list[torch.Tensor] | None = None  # each bucket's own grad shard
        self._all_present: torch.Tensor | None = None  # flags of a rank that has every grad

    def global_norm(self) -> tuple[torch.Tensor, torch.Tensor | None, frozenset[str] | None]:
        """Collective. Global grad L2 norm (as ``clip_grad_norm_`` on the full model), the
        clipping divisor the update applies (None without clipping), and which params got a
        gradient (:meth:`agree`). Reads each bucket's own shard whole: padding is zero."""
        if self._views is None:
            self._views = [
                self.buffers.bucket_step_grads(b).narrow(0, self.dp.rank * b.shard_numel,
                                                       b.shard_numel)
                for buf in self.layout.buffers for b in buf.buckets]
        if self._views:
            norms = torch._foreach_norm(self._views, 2, dtype=torch.float32)
            sq = torch.stack(norms).square().sum()
        else:
            sq = torch.zeros((), device=self.device)
        total, got = self.agree(sq)
        assert total is not None
        max_norm = self.config.max_grad_norm
        if not max_norm:
            return total, None, got
        # clip_grad_norm_ multiplies by min(1, max_norm / (norm + 1e-6)); dividing by its
        # reciprocal inside the update saves a pass over the grads (no host sync either).
        return total, torch.clamp((total + 1e-6) / max_norm, min=1.0), got

    def finish(self, local_sq: torch.Tensor) -> torch.Tensor:
        """Collective. sqrt of the sum over ranks of each rank's sum of squared grads."""
        return comm.all_reduce_sum_(local_sq.reshape(1), self.dp).sqrt()[0]

    def agree(self, local_sq: torch.Tensor | None
              ) -> tuple[torch.Tensor | None, frozenset[str] | None]:
        """Collective (one all-reduce; none with ``dp_size == 1``). The params that got a
        gradient on some rank in this step (None: every param) and, given this rank's sum
        of squared grads ``local_sq``, the global grad norm.

        A rank that got every gradient itself knows the answer (None) and sends ones
        without reading the result back: only a rank that misses some syncs the host."""
        missing = len(self.written) < len(self.fqns)
        local = frozenset(self.written) if missing else None
        if self.dp.size == 1:
            return (None if local_sq is None else local_sq.sqrt()), local
        if missing:
            flags = torch.tensor([f in self.written for f in self.fqns],
                                 dtype=torch.float32).to(self.device)
        else:
            if self._all_present is None:
                self._all_present = torch.ones(len(self.fqns), device=self.device)
            flags = self._all_present
        sums = torch.cat([local_sq.reshape(1), flags]) if local_sq is not None else flags.clone()
        comm.all_reduce_sum_(sums, self.dp)
        norm = None if local_sq is None else sums[0].sqrt()
        if not missing:
            return norm, None
        counts = sums[len(sums) - len(self.fqns):].tolist()
        got = frozenset(f for f, c in zip(self.fqns, counts) if c > 0)
        return norm, (None if len(got) == len(self.fqns) else got)

