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
            self._views = contiguous_runs([
                self.buffers.bucket_step_grads(b).narrow(0, self.dp.rank * b.shard_numel,
                                                       b.shard_numel)
                for buf in self.layout.buffers for b in buf.buckets])
        sq = sum_of_squares(self._views, self.device)
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



# A run this long is reduced alone (torch's vector_norm), shorter ones together (_foreach_norm):
# on an H200, 1e9 bf16 elements read at 3.6 TB/s as one run, 2.8 TB/s as 25 runs of 40M
# alone and 2.2 TB/s through _foreach_norm; 10M-element runs read faster through _foreach_norm
# (1.9 against 1.5 TB/s). benchmarks/probes/grad_norm_kernels.py measures it.
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
