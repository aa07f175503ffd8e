"""Phase 2 of the schedule: the AdamW update of a rank's local shard, and which params it
updates at which step count.

The update runs torch's fused AdamW (the reference: low-precision moments through fp32
copies) or the Triton kernel (:mod:`.kernels`: one pass, moments widened in registers). As
``torch.optim.AdamW`` does, a param that got no gradient on any DP rank is left alone and its
own step count stays (``param_steps``, FQN -> updates applied). The common case keeps one
launch per (buffer, param group): :func:`next_steps` says per group whether all its params
are updated at one count; other groups are split by :func:`split`. ``got`` is the set of
FQNs that got a gradient on some rank in this step, or None for all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch

from . import kernels
from .layout import STATE_NAMES, ParamShard
from .shard_state import ShardState


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


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a step: buffer and param group, the step count, the launch table."""

    buffer_index: int
    group_index: int
    count: int
    table: kernels.ChunkTable


class Update:
    """The update path of one optimizer (``kernel``: ``"triton"`` or ``"torch"``) and what it
    caches between steps. ``param_groups``, ``group_shards`` (per group, the indices into
    ``state.shards`` of the shards AdamW updates: none for Muon's groups) and
    ``param_steps`` are the optimizer's."""

    def __init__(self, state: ShardState, kernel: str, param_groups: list[dict[str, Any]],
                 group_shards: Sequence[Sequence[int]], group_of: dict[str, int],
                 param_steps: dict[str, int]) -> None:
        self.state, self.kernel = state, kernel
        self.param_groups, self.group_shards = param_groups, group_shards
        self.group_of, self.param_steps = group_of, param_steps
        # The Triton kernel writes the model-dtype params; without clipping it also sums the
        # squared grads it reads, so the step needs no norm pass of its own (unless Muon's
        # buffers have grads the kernel does not read).
        self.writes_params = kernel == "triton"
        self.fuses_norm = (kernel == "triton" and not state.config.max_grad_norm
                           and not any(b.whole for b in state.layout.buffers))
        self.chunk_tables: dict[tuple[int, int], kernels.ChunkTable] | None = None
        self._subset_tables: dict[tuple[int, ...], kernels.ChunkTable] = {}
        self._views: list[list[list[torch.Tensor]]] | None = None
        self._views_of = -1  # the shard state's generation the views were taken at
        self._fp32_grads: dict[int, torch.Tensor] | None = None  # buffer -> fp32 grads read
        self._fixed: list[torch.Tensor | None] = []

    def run(self, grad_scale: torch.Tensor | None, steps: list[int | None],
            got: frozenset[str] | None) -> torch.Tensor | None:
        """Update every param this step updates (``steps`` from :func:`next_steps`) and, with
        :attr:`fuses_norm`, return the local sum of squared grads (a device scalar)."""
        if self.kernel == "triton":
            return self._triton(grad_scale, steps, got)
        self._torch(grad_scale, steps, got)
        return None

    def _triton(self, grad_scale: torch.Tensor | None, steps: list[int | None],
                got: frozenset[str] | None) -> torch.Tensor | None:
        # Two launches per (buffer, param group), or per (buffer, param group, step count)
        # for a group not updated whole at one count.
        state = self.state
        if self.chunk_tables is None:
            ids: dict[tuple[int, int], list[int]] = {}
            updated = {i for group_ids in self.group_shards for i in group_ids}
            for i, s in enumerate(state.shards):
                if i in updated:
                    ids.setdefault((s.buffer_index, self.group_of[s.fqn]), []).append(i)
            self.chunk_tables = {k: self._chunk_table(v) for k, v in ids.items()}
        launches = [Launch(bi, gi, steps[gi], table)
                    for (bi, gi), table in self.chunk_tables.items() if steps[gi] is not None]
        for gi, n in enumerate(steps):
            if n is None:
                parts = split(self.group_shards[gi], state.shards, self.param_steps, got)
                launches += [Launch(bi, gi, count, self._subset_table(tuple(ids)))
                             for (bi, count), ids in parts.items()]
        partials = None
        if self.fuses_norm:
            partials = torch.empty(sum(launch.table.num_blocks for launch in launches),
                                   dtype=torch.float32, device=state.device)
        moments = state.device_moments()
        assert moments is not None
        first = 0
        for launch in launches:
            bi, table = launch.buffer_index, launch.table
            group = self.param_groups[launch.group_index]
            main = state.main(bi)
            params = state.buffers.param_buffers[bi]
            kernels.adamw_(
                table, params if main is None else main, state.buffers.step_grads[bi],
                moments.exp_avg[bi], moments.exp_avg_sq[bi], None if main is None else params,
                main_global=main is None, lr=float(group["lr"]), beta1=group["betas"][0],
                beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"],
                step=launch.count, grad_scale=grad_scale,
                sum_sq=None if partials is None else partials[first:first + table.num_blocks])
            first += table.num_blocks
        return None if partials is None else partials.sum()

    def _chunk_table(self, shard_ids: Sequence[int]) -> kernels.ChunkTable:
        """The Triton launch table of ``shards[i]`` for ``i`` in ``shard_ids`` (one buffer)."""
        state = self.state
        parts = []
        for i in shard_ids:
            s = state.shards[i]
            buf = state.layout.buffers[s.buffer_index]
            local_base = buf.local_offset(s.bucket_index)
            global_base = buf.buckets[s.bucket_index].shard_range_global(
                state.buffers.dp[s.buffer_index].rank).start
            start = s.range_local.start - local_base
            parts.append(kernels.ChunkPart(local_base, global_base, start,
                                           start + s.range_local.size))
        return kernels.chunk_table(parts, state.device)

    def _subset_table(self, shard_ids: tuple[int, ...]) -> kernels.ChunkTable:
        # Cached: once a param skipped a step its group splits in every later step too.
        table = self._subset_tables.get(shard_ids)
        if table is None:
            if len(self._subset_tables) >= 256:  # patterns that keep changing (MoE): bounded
                self._subset_tables.clear()
            table = self._subset_tables[shard_ids] = self._chunk_table(shard_ids)
        return table

    def _torch(self, grad_scale: torch.Tensor | None, steps: list[int | None],
               got: frozenset[str] | None) -> None:
        # torch's fused AdamW on the fp32 main params of each param group (the params this
        # step updates, each at its own count); low-precision moments through fp32 copies.
        state = self.state
        shards = state.shards
        grads = self._grad_shards()
        work = None
        moments = state.device_moments()
        assert moments is not None
        if not state.config.lowprec_moments:
            views = self._state_views()
        else:
            work = ([m.to_fp32() for m in moments.exp_avg],
                    [m.to_fp32() for m in moments.exp_avg_sq])
            main_views = [state.view("master_param", s) for s in shards]
            views = [[[main_views[i] for i in idx]]
                     + [[w[shards[i].buffer_index][shards[i].range_local.as_slice()]
                         for i in idx] for w in work] for idx in self.group_shards]
        for gi, group in enumerate(self.param_groups):
            idx = self.group_shards[gi]
            main, exp_avg, exp_avg_sq = views[gi]
            grad = [grads[i] for i in idx]
            if steps[gi] is not None:
                counts = [steps[gi]] * len(idx)
            else:
                keep = [k for k, i in enumerate(idx) if got is None or shards[i].fqn in got]
                main, exp_avg, exp_avg_sq, grad = ([t[k] for k in keep]
                                                   for t in (main, exp_avg, exp_avg_sq, grad))
                counts = [self.param_steps[shards[idx[k]].fqn] + 1 for k in keep]
            if not counts:
                continue
            beta1, beta2 = group["betas"]
            step_of = {n: torch.tensor(float(n), device=state.device) for n in set(counts)}
            torch._fused_adamw_(
                main, grad, exp_avg, exp_avg_sq, [], [step_of[n] for n in counts],
                lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                maximize=False, grad_scale=grad_scale)
        if work is not None:
            for stored, wide in zip((moments.exp_avg, moments.exp_avg_sq), work):
                for moment, w in zip(stored, wide):
                    moment.store_(w)

    def _state_views(self) -> list[list[list[torch.Tensor]]]:
        # Per param group: views of main params, exp_avg, exp_avg_sq (cached until a record's
        # device tensor changes).
        state = self.state
        if self._views is None or self._views_of != state.generation:
            self._views = [
                [[state.view(name, state.shards[i]) for i in idx] for name in STATE_NAMES]
                for idx in self.group_shards]
            self._views_of = state.generation
        return self._views

    def _grad_shards(self) -> list[torch.Tensor]:
        # This rank's grad of each shard in fp32: views of the step's grads where they are
        # fp32; where they are the bf16/fp16 copy of an fp32 grad buffer, that buffer's part of
        # this rank, overwritten with the copy's values (p.grad counts); else fp32 copies.
        # Muon's buffers are left alone (:mod:`.muon_update` reads their grads itself).
        state, buffers = self.state, self.state.buffers
        if self._fp32_grads is None:
            self._fp32_grads = {}
            for bi, (step, accum) in enumerate(zip(buffers.step_grads, buffers.grad_buffers)):
                if step.dtype == torch.float32 or accum.dtype == torch.float32:
                    self._fp32_grads[bi] = step if step.dtype == torch.float32 else accum
            self._fixed = [self._fp32_grads[s.buffer_index][s.range_global.as_slice()]
                           if s.buffer_index in self._fp32_grads else None for s in state.shards]
        wide: dict[int, torch.Tensor] = {}
        for bi, step in enumerate(buffers.step_grads):
            buf = state.layout.buffers[bi]
            if step.dtype == torch.float32 or buf.whole:
                continue
            target = self._fp32_grads.get(bi)
            if target is None:
                wide[bi] = torch.empty(buf.local_numel, dtype=torch.float32, device=state.device)
            for b in buf.buckets:
                own = b.shard_range_global(state.buffers.dp[bi].rank)
                src = step.narrow(0, own.start, b.shard_numel)
                if target is not None:
                    target.narrow(0, own.start, b.shard_numel).copy_(src)
                else:
                    wide[bi].narrow(0, buf.local_offset(b.index), b.shard_numel).copy_(src)
        if not wide:
            return self._fixed
        return [wide[s.buffer_index][s.range_local.as_slice()] if s.buffer_index in wide else v
                for s, v in zip(state.shards, self._fixed)]
