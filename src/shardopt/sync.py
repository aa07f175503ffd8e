"""Phases 1 and 3 of the optimizer's schedule (:mod:`.optimizer`).

:class:`GradSync` (``grad_mode="buffer"``; ``"torch"`` is its subclass
:class:`~shardopt.param_grads.ParamGrads`): gradients into the grad buffers and their
reduce-scatters, bucket by bucket in a launch order every rank shares, so ranks whose hooks
fire in different orders (unused params, experts without tokens) issue identical collectives.
:class:`ParamSync`: each rank's updated shard into the param buffers and the all-gathers,
left in flight after ``step()`` with ``overlap_param_gather``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from operator import attrgetter

import torch

from . import build, comm
from .buffers import FlatBuffers
from .config import OptimizerConfig
from .errors import GradientOrderError, ParamMovedError, UsageError
from .layout import Bucket, Layout
from .param_watch import Placement, Replacements, moved_message
from .shard_state import ShardState

_grad = attrgetter("grad")


class GradSync:
    """The readiness of each bucket, the reductions in flight, and which params' grad-buffer
    regions hold a gradient of this rank. Owned by one optimizer."""

    def __init__(self, dp: comm.DPGroup, buffers: FlatBuffers, layout: Layout,
                 config: OptimizerConfig, named: build.Named,
                 fqn_of: Mapping[torch.nn.Parameter, str], replaced: Replacements) -> None:
        self.dp, self.buffers, self.layout, self.config = dp, buffers, layout, config
        self.fqn_of, self.replaced = fqn_of, replaced
        self._params = list(fqn_of)
        self.launch_order = build.launch_order(layout, named)
        position = {(b.buffer_index, b.index): i for i, b in enumerate(self.launch_order)}
        self._launch_pos = {fqn: position[(slot.buffer_index, slot.bucket_index)]
                            for fqn, slot in layout.slots.items()}
        # Params that got a gradient on this rank since the last step or zero_grad (their
        # grad-buffer region holds it); the others' regions are stale until their first
        # gradient overwrites them or their bucket's launch zeroes them.
        self.written: set[str] = set()
        self._handles: list[object] = []
        self._enabled = True
        self.reset()

    def reset(self) -> None:
        """Every bucket waits for all of its params again (a new backward)."""
        self._bucket_pending: list[int] = [len(b.param_fqns) for b in self.launch_order]
        self._next_launch = 0

    def clear(self) -> None:
        """The gradients are consumed: each param's next one overwrites it (no memset)."""
        self.written.clear()
        self.reset()

    def mark_written(self, fqns: Iterable[str]) -> None:
        """Take the grad-buffer regions of ``fqns`` as written by a backward on this rank
        (for callers that fill the grad buffers directly, as benchmarks do)."""
        self.written.update(fqns)

    def on_grad_ready(self, param: torch.nn.Parameter) -> None:
        """The post-accumulate-grad hook of every param (through :func:`.build.grad_hooks`)."""
        fqn = self.fqn_of[param]
        self.check_placed(param, fqn)
        if self._launch_pos[fqn] < self._next_launch:
            raise GradientOrderError(
                f"[dp rank {self.dp.rank}] gradient for {fqn!r} arrived after its bucket's "
                f"reduction started: a second backward before step() at DP size {self.dp.size} "
                "with grad_mode='buffer', whose reduce-scatter kept only this rank's shard of "
                "the first. Run the micro-batches before the last under optimizer.no_sync(), "
                "or use grad_mode='torch' (the default), where a second backward accumulates "
                "as in torch (what a framework's gradient_accumulation_steps or "
                "accumulate_grad_batches needs); call step() or zero_grad() between iterations")
        hooks = build.post_accumulate_grad_hooks(param)
        if len(hooks) > 1 and not isinstance(next(reversed(hooks)), build.WeakGradHook):
            raise UsageError(
                f"[dp rank {self.dp.rank}] param {fqn!r} has a post-accumulate-grad hook "
                "registered after the optimizer was built: with grad_mode='buffer' it would "
                "see p.grad None (the gradient has left it). Use grad_mode='torch' (the "
                "default), or register the hook with p.register_hook")
        g = param.grad
        if g.requires_grad:  # create_graph: not recorded by autograd
            g = g.detach()
        view = self.buffers.grad_views[fqn]
        if fqn in self.written:
            view.add_(g)
        else:  # first gradient since the last step or zero_grad: no memset, no read
            view.copy_(g)
            self.written.add(fqn)
        param.grad = None
        # One rank launches nothing: a second backward just accumulates.
        if self._enabled and self.config.overlap_grad_reduce and self.dp.size > 1:
            self._count_in(fqn)

    def _count_in(self, fqn: str) -> None:
        """``fqn``'s gradient is in: launch every bucket now complete, in launch order."""
        self._bucket_pending[self._launch_pos[fqn]] -= 1
        while (self._next_launch < len(self.launch_order)
               and self._bucket_pending[self._next_launch] <= 0):
            self._launch_next()

    def _launch_rest(self) -> None:
        while self._next_launch < len(self.launch_order):
            self._launch_next()

    def check_placed(self, param: torch.nn.Parameter, fqn: str) -> None:
        """Raise :class:`ParamMovedError` if ``param`` no longer lives in its place in the
        param buffer (``param.data`` re-bound), before its gradient reaches the grad buffer."""
        self.replaced.check_in_backward()
        if param.data_ptr() != self.buffers.param_views[fqn].data_ptr():
            slot = self.layout.slots[fqn]
            raise ParamMovedError(moved_message(self.dp.rank, fqn, param, Placement(
                self.layout.buffers[slot.buffer_index].dtype, self.buffers.device, slot.shape)))

    def take_assigned(self) -> None:
        """Take grads set by hand (``p.grad = g``), which bypass the hooks, as a backward's
        would be: torch's optimizers step with whatever ``p.grad`` holds. An assignment
        replaces the gradient a backward left; one whose bucket was already reduced raises
        before anything changes."""
        grads = list(map(_grad, self._params))
        if grads.count(None) == len(grads):
            return
        assigned = [p for p, g in zip(self._params, grads) if g is not None]
        for p in assigned:
            fqn = self.fqn_of[p]
            if self._launch_pos[fqn] < self._next_launch:
                raise GradientOrderError(
                    f"[dp rank {self.dp.rank}] p.grad of {fqn!r} was set by hand after a "
                    "backward had started reducing its bucket, which no longer allows replacing "
                    "its gradient. Set it before that backward, or use grad_mode='torch' (the "
                    "default), where step() takes whatever p.grad holds")
        for p in assigned:
            self.written.discard(self.fqn_of[p])  # replaced, not added to
            self.on_grad_ready(p)

    def before_step(self) -> None:
        """Collective. Take grads set by hand, reduce what is left and wait (``step()``)."""
        self.take_assigned()
        self.finish()

    def after_step(self) -> None:
        """``step()`` consumed the gradients: the next one overwrites (no memset)."""
        self.clear()

    def zero_grad(self, set_to_none: bool) -> None:
        """Drop every gradient since the last step (the next one overwrites its region)."""
        self.wait()
        self.clear()
        for p in self._params:  # a grad set by hand is dropped too
            p.grad = None

    def _launch_next(self) -> None:
        bucket = self.launch_order[self._next_launch]
        for fqn in bucket.param_fqns:
            if fqn not in self.written:  # no gradient here this iteration: it counts as zero
                self.buffers.grad_views[fqn].zero_()
        self._handles.append(
            comm.reduce_scatter_avg_(self.buffers.bucket_grads(bucket), self.dp, async_op=True))
        self._next_launch += 1

    def finish(self) -> None:
        """Collective. Reduce every bucket not yet launched (missing grads count as zero) and wait."""
        self._launch_rest()
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
        """Wait for the reductions in flight; whether the grad buffers hold gradients."""
        for h in self._handles:
            h.wait()
        self._handles.clear()
        return bool(self.written)


class ParamSync:
    """The param all-gathers of one optimizer, and those still in flight."""

    def __init__(self, state: ShardState, launch_order: Sequence[Bucket]) -> None:
        self.dp, self.buffers, self.layout, self.state = (state.dp, state.buffers,
                                                          state.layout, state)
        self.launch_order = launch_order
        # overlap_param_gather: all-gathers in flight, keyed (buffer index, bucket index).
        self.handles: dict[tuple[int, int], object] = {}

    def register_hooks(self, model: torch.nn.Module, config: OptimizerConfig,
                       fqn_of: Mapping[torch.nn.Parameter, str]) -> list[object]:
        """With ``overlap_param_gather`` and several ranks: a forward and a ``state_dict``
        pre-hook on each module that wait for the buckets of its own params, and a
        ``load_state_dict`` pre-hook that waits for all; the caller keeps them."""
        if not (config.overlap_param_gather and self.dp.size > 1):
            return []
        hooks = []
        for module in model.modules():
            keys = sorted({(self.layout.slots[fqn_of[p]].buffer_index,
                            self.layout.slots[fqn_of[p]].bucket_index)
                           for p in module.parameters(recurse=False) if p in fqn_of})
            if keys:
                wait = lambda *_, keys=tuple(keys): self._wait(keys)  # noqa: E731
                hooks.append(module.register_forward_pre_hook(wait))
                hooks.append(module.register_state_dict_pre_hook(wait))  # torch.save reads them
        # model.load_state_dict writes the params: no gather may still be writing them.
        hooks.append(model.register_load_state_dict_pre_hook(lambda *_: self.finish()))
        return hooks

    def _wait(self, keys: tuple[tuple[int, int], ...]) -> None:
        if self.handles:
            for key in keys:
                handle = self.handles.pop(key, None)
                if handle is not None:
                    handle.wait()

    def finish(self) -> None:
        """Wait for every all-gather still in flight."""
        for handle in self.handles.values():
            handle.wait()
        self.handles.clear()

    def publish(self, own_written: bool = False, wait: bool = True) -> None:
        """Collective. Copy main shards into the model-dtype buffer (unless the update wrote
        them: ``own_written``), then all-gather every bucket, in the order forward uses them;
        without ``wait`` the all-gathers stay in flight (:meth:`finish`)."""
        self.finish()
        for bucket in reversed(self.launch_order):
            full = self.buffers.bucket_params(bucket)
            main = self.state.main(bucket.buffer_index)
            if main is not None and not own_written:
                own = full.narrow(0, self.dp.rank * bucket.shard_numel, bucket.shard_numel)
                offset = self.layout.buffers[bucket.buffer_index].local_offset(bucket.index)
                own.copy_(main.narrow(0, offset, bucket.shard_numel))
            handle = comm.all_gather_(full, self.dp, async_op=True)
            if handle is not comm.DONE:
                self.handles[(bucket.buffer_index, bucket.index)] = handle
        if wait:
            self.finish()
