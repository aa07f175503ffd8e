"""Phase 1 of the optimizer's schedule (:mod:`.optimizer`): gradients into the grad buffers
and their reduce-scatters, launched bucket by bucket in one order that every rank shares.

A param's post-accumulate-grad hook adds its gradient into the grad buffer and frees
``param.grad``. When every param of the next bucket in launch order has reported, that
bucket's reduce-scatter (average) starts asynchronously. Buckets launch strictly in order,
so ranks whose hooks fire in different orders (unused params, MoE experts without tokens)
still issue identical collectives; ``step()`` launches the rest (:meth:`GradSync.finish`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import torch

from . import build, comm
from .buffers import FlatBuffers
from .config import OptimizerConfig
from .layout import Layout


class GradientOrderError(RuntimeError):
    """A gradient arrived for a bucket whose reduction had already started."""


class GradSync:
    """The readiness of each bucket, the reductions in flight, and which params' grad-buffer
    regions hold a gradient of this rank. Owned by one optimizer."""

    def __init__(self, dp: comm.DPGroup, buffers: FlatBuffers, layout: Layout,
                 config: OptimizerConfig, named: list[tuple[str, torch.nn.Parameter]],
                 fqn_of: Mapping[torch.nn.Parameter, str]) -> None:
        self.dp, self.buffers, self.config, self.fqn_of = dp, buffers, config, fqn_of
        self.launch_order = build.launch_order(layout, named)
        position = {(b.buffer_index, b.index): i for i, b in enumerate(self.launch_order)}
        self._launch_pos = {
            fqn: position[(slot.buffer_index, slot.bucket_index)]
            for fqn, slot in layout.slots.items()
        }
        self._bucket_pending: list[int] = []
        # Params that got a gradient on this rank since the last step or zero_grad (their
        # grad-buffer region holds it); the others hold stale values and are overwritten by
        # their first gradient or zeroed when their bucket launches.
        self.written: set[str] = set()
        self._next_launch = 0
        self._handles: list[object] = []
        self._enabled = True
        self.reset()

    def reset(self) -> None:
        """Every bucket waits for all of its params again (a new backward)."""
        self._bucket_pending = [len(b.param_fqns) for b in self.launch_order]
        self._next_launch = 0

    def clear(self) -> None:
        """The gradients are consumed: the next one of each param overwrites its region (no
        memset), and every bucket waits for all of its params again."""
        self.written.clear()
        self.reset()

    def mark_written(self, fqns: Iterable[str]) -> None:
        """Take the grad-buffer regions of ``fqns`` as written by a backward on this rank
        (for callers that fill the grad buffers directly, as benchmarks do)."""
        self.written.update(fqns)

    def on_grad_ready(self, param: torch.nn.Parameter) -> None:
        """The post-accumulate-grad hook of every param (through :func:`.build.grad_hooks`)."""
        fqn = self.fqn_of[param]
        pos = self._launch_pos[fqn]
        if pos < self._next_launch:
            raise GradientOrderError(
                f"[dp rank {self.dp.rank}] gradient for {fqn!r} arrived after its bucket's "
                "reduction started; run accumulation micro-batches under optimizer.no_sync() "
                "and call step() or zero_grad() between iterations"
            )
        with torch.no_grad():
            view = self.buffers.grad_views[fqn]
            if fqn in self.written:
                view.add_(param.grad)
            else:  # first gradient since the last step or zero_grad: no memset, no read
                view.copy_(param.grad)
                self.written.add(fqn)
        param.grad = None
        if not (self._enabled and self.config.overlap_grad_reduce):
            return
        self._bucket_pending[pos] -= 1
        while (
            self._next_launch < len(self.launch_order)
            and self._bucket_pending[self._next_launch] <= 0
        ):
            self._launch_next()

    def _launch_next(self) -> None:
        bucket = self.launch_order[self._next_launch]
        for fqn in bucket.param_fqns:
            if fqn not in self.written:  # no gradient here this iteration: it counts as zero
                self.buffers.grad_views[fqn].zero_()
        self._handles.append(
            comm.reduce_scatter_avg_(self.buffers.bucket_grads(bucket), self.dp, async_op=True)
        )
        self._next_launch += 1

    def finish(self) -> None:
        """Collective. Reduce every bucket not yet launched (missing grads count as zero) and wait."""
        while self._next_launch < len(self.launch_order):
            self._launch_next()
        self.wait()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for micro-batches inside the block."""
        previous = self._enabled
        self._enabled = False
        try:
            yield
        finally:
            self._enabled = previous
            self.reset()

    def wait(self) -> bool:
        """Wait for the gradient reductions in flight (starts none). Returns whether a
        backward since the last :meth:`clear` left gradients in the grad buffers."""
        for h in self._handles:
            h.wait()
        self._handles.clear()
        return bool(self.written)
