"""Phase 2 of the schedule for Muon's params: the update of the matrices this rank owns.

Each Muon matrix lies whole in one rank's shard (:func:`.muon.plan_layout`), so once phase 1
has reduced the gradients that rank holds the matrix's full averaged gradient; it alone
updates the matrix, as ``torch.optim.Muon`` does: ``buf.lerp_(grad, 1 - momentum)``, the
Newton-Schulz orthogonalisation of ``grad.lerp(buf, momentum)`` (nesterov) or of ``buf``
in bf16, ``param.mul_(1 - lr * weight_decay)``, ``param.add_(update, alpha=-adjusted_lr)``,
on the fp32 main param. The matrices of one param group and one shape are orthogonalised
in one batch. Phase 3's all-gather gives every rank the new values; no rank computes
another's matrices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import muon
from .layout import ParamShard
from .moments import Moments, piece
from .shard_state import ShardState


def split_shards(group_shards: Sequence[Sequence[int]], param_groups: list[dict[str, Any]]
                 ) -> tuple[list[Sequence[int]], list[Sequence[int]]]:
    """Per param group, its shards (``group_shards``) for AdamW and for Muon: each gets the
    shards of its own groups and none of the other's."""
    muon_group = [muon.is_muon(g) for g in param_groups]
    return ([[] if m else ids for ids, m in zip(group_shards, muon_group)],
            [ids if m else [] for ids, m in zip(group_shards, muon_group)])


class MuonUpdate:
    """The Muon update of one optimizer. ``group_shards``: per param group, the indices into
    ``state.shards`` of the matrices this rank owns (none for AdamW's groups);
    ``writes_params``: also write the model-dtype params (the AdamW update does, so phase 3
    copies no main params into them)."""

    def __init__(self, state: ShardState, param_groups: list[dict[str, Any]],
                 group_shards: Sequence[Sequence[int]], writes_params: bool) -> None:
        self.state, self.param_groups, self.group_shards = state, param_groups, group_shards
        self.writes_params = writes_params

    def run(self, grad_scale: torch.Tensor | None, got: frozenset[str] | None) -> None:
        """Update every owned matrix that got a gradient on some rank (``got``: None for all),
        its gradient divided by ``grad_scale`` (clipping) where given."""
        if not any(self.group_shards):
            return
        moments = self.state.device_moments()
        assert moments is not None
        shards = self.state.shards
        for ids, group in zip(self.group_shards, self.param_groups):
            by_shape: dict[tuple[int, ...], list[ParamShard]] = {}
            for i in ids:
                if got is None or shards[i].fqn in got:
                    shape = self.state.layout.slots[shards[i].fqn].shape
                    by_shape.setdefault(shape, []).append(shards[i])
            for shape, matrices in by_shape.items():
                self._update(muon.settings_of(group), shape, matrices, moments, grad_scale)

    def _update(self, settings: muon.MuonSettings, shape: tuple[int, ...],
                matrices: list[ParamShard], moments: Moments,
                grad_scale: torch.Tensor | None) -> None:
        state = self.state
        params = [state.view("master_param", s).view(shape) for s in matrices]
        grads = [self._grad(s, grad_scale).view(shape) for s in matrices]
        bufs = [piece(moments.momentum_buffer[s.buffer_index], s.range_local).values.view(shape)
                for s in matrices]
        torch._foreach_lerp_(bufs, grads, 1 - settings.momentum)
        updates = torch._foreach_lerp(grads, bufs, settings.momentum) if settings.nesterov \
            else bufs
        batch = updates[0] if len(updates) == 1 else torch.stack(updates)
        ortho = muon.newton_schulz(batch, settings.ns_coefficients, settings.ns_steps,
                                   settings.eps)
        lr = settings.lr
        torch._foreach_mul_(params, 1 - lr * settings.weight_decay)
        step = muon.adjusted_lr(lr, settings.adjust_lr_fn, shape)
        for p, o in zip(params, [ortho] if ortho.dim() == 2 else ortho.unbind(0)):
            p.add_(o, alpha=-step)
        if self.writes_params:
            for s, p in zip(matrices, params):
                if state.main(s.buffer_index) is not None:
                    state.view("params", s).copy_(p.view(-1))

    def _grad(self, s: ParamShard, grad_scale: torch.Tensor | None) -> torch.Tensor:
        """The step's gradient of matrix ``s`` in fp32 (a view where it is fp32)."""
        g = self.state.buffers.step_grads[s.buffer_index][s.range_global.as_slice()].float()
        return g if grad_scale is None else g / grad_scale
