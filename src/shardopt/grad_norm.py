"""The collective agreement of a step: the global gradient norm (for clipping and
``last_grad_norm``) and which params got a gradient on some rank, in one all-reduce."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import comm
from .buffers import FlatBuffers
from .config import OptimizerConfig
from .layout import Layout


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed on: the global grad norm (None when the update sums it), the
    params that got a gradient on some rank (None: every param) and the clip divisor (None:
    no clipping)."""

    total: torch.Tensor | None
    got: frozenset[str] | None
    grad_scale: torch.Tensor | None = None


class GradNorm:
    """What one optimizer's ``step()`` agrees on, and the views it reads for that.
    ``written`` is the optimizer's set of params that got a gradient on this rank."""

    def __init__(self, dp: comm.DPGroup, buffers: FlatBuffers, layout: Layout,
                 config: OptimizerConfig, fqns: tuple[str, ...], written: set[str]) -> None:
        self.dp, self.buffers, self.layout, self.config = dp, buffers, layout, config
        self.fqns, self.written = fqns, written  # fqns: the order of the flags
        self._views: list[torch.Tensor] | None = None  # each bucket's own grad shard
        self._all_present: torch.Tensor | None = None  # flags of a rank that has every grad

    def global_norm(self) -> Agreed:
        """Collective. :meth:`agree` with the global grad L2 norm (as ``clip_grad_norm_`` on
        the full model) and the clip divisor. Reads each bucket's own shard whole: padding is
        zero."""
        if self._views is None:
            rank = self.dp.rank
            self._views = contiguous_runs([self.buffers.step_grads[b.buffer_index][
                b.shard_range_global(rank).as_slice()] for buf in self.layout.buffers
                for b in buf.buckets])
        agreed = self.agree(sum_of_squares(self._views, self.buffers.device))
        max_norm = self.config.max_grad_norm
        if not max_norm:
            return agreed
        # clip_grad_norm_ multiplies by min(1, max_norm / (norm + 1e-6)); dividing by its
        # reciprocal inside the update saves a pass over the grads (no host sync either).
        scale = torch.clamp((agreed.total + 1e-6) / max_norm, min=1.0)
        return Agreed(agreed.total, agreed.got, scale)

    def finish(self, local_sq: torch.Tensor) -> torch.Tensor:
        """Collective. sqrt of the sum over ranks of each rank's sum of squared grads."""
        return comm.all_reduce_sum_(local_sq.reshape(1), self.dp).sqrt()[0]

    def agree(self, local_sq: torch.Tensor | None) -> Agreed:
        """Collective (one all-reduce; none with ``dp_size == 1``): who got a gradient and,
        given this rank's sum of squared grads ``local_sq``, the global norm. A rank that got
        every gradient sends ones and never reads them back: only a rank missing some syncs."""
        missing = len(self.written) < len(self.fqns)
        local = frozenset(self.written) if missing else None
        if self.dp.size == 1:
            return Agreed(None if local_sq is None else local_sq.sqrt(), local)
        if missing:
            flags = torch.tensor([f in self.written for f in self.fqns],
                                 dtype=torch.float32).to(self.buffers.device)
        else:
            if self._all_present is None:
                self._all_present = torch.ones(len(self.fqns), device=self.buffers.device)
            flags = self._all_present
        sums = torch.cat([local_sq.reshape(1), flags]) if local_sq is not None else flags.clone()
        comm.all_reduce_sum_(sums, self.dp)
        norm = None if local_sq is None else sums[0].sqrt()
        if not missing:
            return Agreed(norm, None)
        counts = sums[len(sums) - len(self.fqns):].tolist()
        got = frozenset(f for f, c in zip(self.fqns, counts) if c > 0)
        return Agreed(norm, None if len(got) == len(self.fqns) else got)


# A run this long is reduced alone (torch's vector_norm), shorter ones together (_foreach_norm):
# the faster way for each on an H200 (benchmarks/probes/grad_norm_kernels.py).
LONG_RUN = 1 << 24


def contiguous_runs(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """``views`` (1-D) with each group of neighbours that lie back to back in one storage
    merged into one view (with DP 1 a rank's shards of a buffer's buckets are the buffer)."""
    runs: list[torch.Tensor] = []
    for v in views:
        last = runs[-1] if runs else None
        if (last is not None and last.dtype == v.dtype
                and last.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
                and last.storage_offset() + last.numel() == v.storage_offset()):
            runs[-1] = last.as_strided((last.numel() + v.numel(),), (1,), last.storage_offset())
        else:
            runs.append(v)
    return runs


def sum_of_squares(runs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The fp32 sum of the squares of every element of ``runs`` (a device scalar)."""
    long = [r for r in runs if r.numel() >= LONG_RUN]
    short = [r for r in runs if r.numel() < LONG_RUN]
    norms = [torch.linalg.vector_norm(r, 2, dtype=torch.float32) for r in long]
    if short:
        norms.extend(torch._foreach_norm(short, 2, dtype=torch.float32))
    if not norms:
        return torch.zeros((), device=device)
    return torch.stack(norms).square().sum()
