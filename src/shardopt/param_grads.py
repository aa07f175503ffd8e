"""``grad_mode="torch"``: every param's ``.grad`` is its gradient after backward, as with DDP.

Schedule of one backward (buckets in the launch order of :mod:`.sync`): each param's gradient
reaches the grad buffer and ``p.grad`` becomes its view of it in the param's dtype; outside
``no_sync()``, when every param of the next bucket has reported, that bucket's all-reduce
(average) starts. When backward ends (the autograd engine's final callback, as DDP's) the rest
is launched with one all-reduce of "got a gradient" flags: a param that got a gradient on some
rank holds its average, one that got none anywhere keeps ``p.grad`` None. ``step()`` takes
what ``p.grad`` holds. bf16/fp16 params with fp32 grads keep the fp32 sum and the rounded
``p.grad``; a pre-hook on the param's gradient accumulator takes ``p.grad`` away before a
second backward would add into the rounded copy (docs/optimizer.md, "What p.grad is").
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from . import build, comm
from .buffers import FlatBuffers
from .config import OptimizerConfig
from .layout import Layout
from .param_watch import Replacements
from .sync import GradSync, _grad


class ParamGrads(GradSync):
    """:class:`~shardopt.sync.GradSync` for ``grad_mode="torch"`` (module docstring)."""

    def __init__(self, dp: comm.DPGroup, buffers: FlatBuffers, layout: Layout,
                 config: OptimizerConfig, named: build.Named,
                 fqn_of: Mapping[torch.nn.Parameter, str], replaced: Replacements) -> None:
        super().__init__(dp, buffers, layout, config, named, fqn_of, replaced)
        self._fqns = [fqn for fqn, _ in named]
        self._param_of = dict(named)
        self._views = [buffers.param_grad_views[fqn] for fqn in self._fqns]
        # fqn -> buffer index, for params whose p.grad is a rounded copy of the fp32 sum.
        self._mirrored = {fqn: slot.buffer_index for fqn, slot in layout.slots.items()
                          if buffers.mirrored(slot.buffer_index)}
        # Per buffer with a rounded copy: its version counter after our last write to it (a
        # different one means somebody else wrote p.grad there).
        self._seen = {i: buffers.param_grad_buffers[i]._version
                      for i in range(len(layout.buffers)) if buffers.mirrored(i)}
        self._reported: set[str] = set()  # reported in this backward (dp_size > 1)
        self._continuing: set[str] = set()  # mirrored: p.grad taken away to add in fp32
        # Mirrored, dp_size 1: params whose fp32 sum is not written yet (the first gradient
        # went to the rounded copy alone, which holds it exactly).
        self._unsummed: set[str] = set()
        self.reduced = False  # the grad buffers hold averaged gradients
        self._task: int | None = None  # the backward whose final callback is queued
        self._flags_all: torch.Tensor | None = None
        self._accumulators: list[Any] = []  # kept alive: their pre-hooks live on them
        self._register_prehooks(named)

    # ------------------------------------------------------------------ backward
    def _register_prehooks(self, named: build.Named) -> None:
        """On the gradient accumulator of each mirrored param (not a tensor hook: those run
        for ``torch.autograd.grad`` too, which accumulates nothing)."""
        handles = []
        me = weakref.ref(self)
        with torch.enable_grad():
            for fqn, p in named:
                if fqn not in self._mirrored:
                    continue
                acc = p.view_as(p).grad_fn.next_functions[0][0]
                self._accumulators.append(acc)
                handles.append(acc.register_prehook(
                    _WeakPrehook(me, fqn, p, self.buffers.param_grad_views[fqn])))
        weakref.finalize(self, build.remove_hooks, handles)

    def before_accumulate(self, fqn: str) -> None:
        """Mirrored params: autograd is about to add a gradient to ``p.grad``; if that is the
        rounded copy, take it away so the new gradient is added to the fp32 sum instead."""
        p = self._param_of[fqn]
        view = self.buffers.param_grad_views[fqn]
        if p.grad is view:
            self._take_edits(self._mirrored[fqn])
            if fqn in self._unsummed:
                self._unsummed.discard(fqn)
                with torch.no_grad():
                    self.buffers.grad_views[fqn].copy_(view)
            p.grad = None
            self._continuing.add(fqn)

    def on_grad_ready(self, param: torch.nn.Parameter) -> None:
        fqn = self.fqn_of[param]
        self.check_placed(param, fqn)
        self._queue_end()
        g = param.grad
        view = self.buffers.param_grad_views[fqn]
        if g is not view:
            accum = self.buffers.grad_views[fqn]
            graph = g.requires_grad  # create_graph: leave the grad that carries a graph
            if graph:
                g = g.detach()
            if fqn in self._continuing:  # mirrored: the exact fp32 sum is in accum
                self._continuing.discard(fqn)
                accum.add_(g)
                view.copy_(accum)
            elif fqn not in self._mirrored:  # p.grad was None (or a tensor set by hand)
                accum.copy_(g)
            else:  # at one rank the fp32 sum waits for a second backward (if any)
                view.copy_(g)
                if self.dp.size > 1:
                    accum.copy_(g)
                else:
                    self._unsummed.add(fqn)
            if fqn in self._mirrored:
                self._wrote(self._mirrored[fqn])
            if not graph:
                param.grad = view
        elif fqn in self._mirrored:  # added to the rounded copy in place: p.grad counts
            self.buffers.grad_views[fqn].copy_(view)
        if self.dp.size == 1 or not self._enabled:
            return
        self._reported.add(fqn)
        if self.config.overlap_grad_reduce:
            self._count_in(fqn)

    def _queue_end(self) -> None:
        """Queue :meth:`_end_of_backward` once per backward, on its first hook."""
        task = torch._C._current_graph_task_id()
        if task == self._task:
            return
        if self._task is not None:  # that backward raised before its end: start over
            self._recover()
        self._task = task
        me = weakref.ref(self)
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: (lambda s: s is not None and s._end_of_backward())(me()))

    def _recover(self) -> None:
        self.wait()
        self.reset()
        self._reported.clear()
        self._continuing.clear()

    def _end_of_backward(self) -> None:
        self._task = None
        if self.dp.size > 1:
            if self._enabled:
                self._reduce_all()
            else:  # this rank's gradients were added to whatever was averaged
                self.reduced = False
        self.reset()

    # -------------------------------------------------------------- reductions
    def _launch_next(self) -> None:
        bucket = self.launch_order[self._next_launch]
        for fqn in bucket.param_fqns:
            if fqn not in self._reported:
                self._take_param_grad(fqn)
        self._handles.append(
            comm.all_reduce_avg_(self.buffers.bucket_grads(bucket), self.dp, async_op=True))
        self._next_launch += 1

    def _take_param_grad(self, fqn: str) -> None:
        """Make the grad buffer hold what ``p.grad`` of ``fqn`` holds (a param this backward
        did not reach): zero for None, the tensor set by hand, an edit of the rounded copy."""
        g = self._param_of[fqn].grad
        accum = self.buffers.grad_views[fqn]
        if g is None:
            accum.zero_()
        elif g is self.buffers.param_grad_views[fqn]:
            if fqn in self._mirrored:
                self._take_edits(self._mirrored[fqn])
        else:
            accum.copy_(g)

    def _reduce_all(self) -> None:
        """Collective. Launch every bucket not launched, with the flags of which params have
        a gradient here; wait; give every param with a gradient on some rank its average."""
        self._launch_rest()
        grads = list(map(_grad, self._params))
        missing = grads.count(None)
        if missing:
            flags = torch.tensor([g is not None for g in grads], dtype=torch.float32)
            flags = flags.to(self.buffers.device)
        else:  # a rank with every gradient knows the answer: it sends and never reads
            if self._flags_all is None:
                self._flags_all = torch.empty(len(grads), device=self.buffers.device)
            flags = self._flags_all.fill_(1)  # the last all-reduce summed into it
        handle = comm.all_reduce_sum_async_(flags, self.dp)
        self.wait()
        handle.wait()
        for i in self._seen:
            self.buffers.param_grad_buffers[i].copy_(self.buffers.grad_buffers[i])
            self._wrote(i)
        counts = flags.tolist() if missing else None
        for i, (p, g, view) in enumerate(zip(self._params, grads, self._views)):
            if g is view:
                continue
            if g is None:
                if counts is not None and counts[i] > 0:  # a gradient elsewhere: its average
                    p.grad = view
            elif not g.requires_grad:
                p.grad = view
        self._reported.clear()
        self.reduced = True

    # -------------------------------------------------------------------- step
    def before_step(self) -> None:
        """Collective where gradients need averaging. Make the step buffer hold what every
        ``p.grad`` holds and ``written`` name the params that have one."""
        self.finish()
        grads = list(map(_grad, self._params))
        if all(map(operator.is_, grads, self._views)):
            if len(self.written) != len(grads):
                self.written.update(self._fqns)
            return
        self.written.clear()
        with torch.no_grad():
            for fqn, g, view in zip(self._fqns, grads, self._views):
                if g is None:  # no gradient: zero where the norm reads it
                    view.zero_()
                else:
                    self.written.add(fqn)
                    if g is not view:
                        view.copy_(g)
                if g is not view and fqn in self._mirrored:
                    self._wrote(self._mirrored[fqn])

    def finish(self) -> None:
        """Collective. Average whatever no backward averaged since the last ``step()`` or
        ``zero_grad()`` (gradients set by hand, ``no_sync()`` micro-batches) and wait."""
        self.wait()
        if self.dp.size > 1 and not self.reduced:
            self.reset()
            self._reduce_all()

    def after_step(self) -> None:
        """The gradients stay in ``p.grad`` (as in torch); a next step re-averages nothing
        that a backward averaged, but anything set by hand before it."""
        self.reduced = False

    def zero_grad(self, set_to_none: bool) -> None:
        """As ``torch.optim.Optimizer.zero_grad``: ``p.grad = None``, or zero where it is."""
        self.wait()
        if set_to_none:
            for p in self._params:
                p.grad = None
        else:
            with torch.no_grad():
                for p, view in zip(self._params, self._views):
                    if p.grad is not None and p.grad is not view:
                        p.grad.zero_()
                for t in self.buffers.grad_tensors():
                    t.zero_()
                for i in self._seen:
                    self._wrote(i)
        self.written.clear()
        self.reduced = False
        self.reset()
        self._reported.clear()
        self._continuing.clear()

    def wait(self) -> bool:
        """Wait for the reductions in flight; whether any param has a gradient."""
        super().wait()
        return any(g is not None for g in map(_grad, self._params))

    def mark_written(self, fqns: Any) -> None:
        """As after a backward that reached ``fqns``: their ``p.grad`` is their view of the
        grad buffers as they are (benchmarks fill ``buffers.step_grads`` directly)."""
        for fqn in fqns:
            self._param_of[fqn].grad = self.buffers.param_grad_views[fqn]
        self.reduced = True

    # ------------------------------------------------------ the rounded copies
    def _wrote(self, buffer_index: int) -> None:
        self._seen[buffer_index] = self.buffers.param_grad_buffers[buffer_index]._version

    def _take_edits(self, buffer_index: int) -> None:
        """If somebody wrote the rounded copy since we did, the fp32 sum takes its values."""
        if self.buffers.param_grad_buffers[buffer_index]._version != self._seen[buffer_index]:
            with torch.no_grad():
                self.buffers.grad_buffers[buffer_index].copy_(
                    self.buffers.param_grad_buffers[buffer_index])
            self._wrote(buffer_index)


class _WeakPrehook:
    """:meth:`ParamGrads.before_accumulate` through a weak reference (see
    :func:`.build.grad_hooks` for why), called only when there is something to do: it runs
    in every backward, and mostly ``p.grad`` is None then."""

    def __init__(self, owner: weakref.ref, fqn: str, param: torch.Tensor,
                 view: torch.Tensor) -> None:
        self.owner, self.fqn, self.param, self.view = owner, fqn, param, view

    def __call__(self, grad_outputs: Any) -> None:
        if self.param.grad is self.view:
            owner = self.owner()
            if owner is not None:
                owner.before_accumulate(self.fqn)
