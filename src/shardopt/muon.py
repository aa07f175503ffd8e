"""Muon: its settings, its Newton-Schulz iteration, and which DP rank owns each matrix.

Pure math and planning, no ``torch.distributed`` (docs/optimizer.md, "Muon").

* :class:`MuonSettings`: the hyperparameters of a Muon param group, named and defaulted as
  ``torch.optim.Muon``'s; :func:`group_settings` checks what ``param_group_fn`` returns.
* :func:`newton_schulz`: torch's quintic iteration in bf16, on a batch of same-shape matrices.
* :func:`plan_layout`: the flat-buffer layout with every Muon matrix whole in one rank's
  shard. Owners are chosen greedily, largest Newton-Schulz cost (``max(M, N) * min(M, N)**2``)
  first, each to the rank with the least cost so far. Per buffer, matrices of one size form
  rounds of one matrix per rank (no padding); rounds fill buckets in the order backward
  completes them; what is left over (fewer such matrices on some ranks) shares a last bucket,
  padded to its fullest rank.
* :func:`muon_groups`: the usual split, as a ``param_group_fn``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .config import group_value
from .layout import Bucket, BufferLayout, Layout, ParamSlot, ParamSpec, Range, build_layout

MUON = "muon"
ADAMW = "adamw"
OPTIMIZERS = (ADAMW, MUON)
MOMENTUM = "momentum_buffer"  # the one state tensor of a Muon param, as torch names it
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


@dataclass(frozen=True, kw_only=True)
class MuonSettings:
    """Hyperparameters of a Muon param group (``torch.optim.Muon``'s names and defaults)."""

    lr: float = 1e-3
    """Learning rate, scaled per matrix by ``adjust_lr_fn``."""
    weight_decay: float = 0.1
    """Decoupled: each step multiplies the param by ``1 - lr * weight_decay``."""
    momentum: float = 0.95
    """Coefficient of the momentum buffer (``buf.lerp_(grad, 1 - momentum)``)."""
    nesterov: bool = True
    """Orthogonalise ``grad.lerp(buf, momentum)`` instead of the buffer itself."""
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    """``(a, b, c)`` of the quintic Newton-Schulz polynomial."""
    eps: float = 1e-7
    """Lower bound of the Frobenius norm the iteration divides by."""
    ns_steps: int = 5
    """Newton-Schulz iterations (fewer than 100, as torch requires)."""
    adjust_lr_fn: str | None = None
    """``None`` or ``"original"``: ``lr * sqrt(max(1, A / B))``; ``"match_rms_adamw"``:
    ``lr * 0.2 * sqrt(max(A, B))`` for an ``A x B`` matrix."""

    def __post_init__(self) -> None:
        for key in ("lr", "weight_decay", "momentum", "eps"):
            if group_value(key, getattr(self, key)) is None:
                raise ValueError(f"{key}={getattr(self, key)!r}: Muon takes a finite number >= 0")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"nesterov={self.nesterov!r}: Muon takes True or False")
        coefficients = self.ns_coefficients
        if not (isinstance(coefficients, (list, tuple)) and len(coefficients) == 3 and all(
                isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
                for c in coefficients)):
            raise ValueError(f"ns_coefficients={coefficients!r}: Muon takes three finite numbers")
        object.__setattr__(self, "ns_coefficients", tuple(float(c) for c in coefficients))
        steps = self.ns_steps
        if not (isinstance(steps, int) and not isinstance(steps, bool) and 0 <= steps < 100):
            raise ValueError(f"ns_steps={steps!r}: Muon takes an int in [0, 100)")
        if self.adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn={self.adjust_lr_fn!r}: Muon takes one of "
                             f"{list(ADJUST_LR_FNS)}")

    def group(self) -> dict[str, Any]:
        """The param-group entries of these settings, ``"optimizer": "muon"`` first."""
        return {"optimizer": MUON, **dataclasses.asdict(self)}


MUON_KEYS = tuple(f.name for f in dataclasses.fields(MuonSettings))


def is_muon(group: Mapping[str, Any]) -> bool:
    """Whether a param group (or a group's saved hyperparameters) is Muon's."""
    return group.get("optimizer") == MUON


def settings_of(group: Mapping[str, Any]) -> MuonSettings:
    """The Muon settings a param group, a state dict's or a manifest's holds; ``ValueError``
    naming the key when one is missing or out of range."""
    missing = [k for k in MUON_KEYS if k not in group]
    if missing:
        raise ValueError(f"a Muon param group lacks {missing}")
    return MuonSettings(**{k: group[k] for k in MUON_KEYS})


def group_settings(fqn: str, p: torch.Tensor, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The param-group entries ``param_group_fn`` asked for with ``"optimizer": "muon"``:
    its Muon settings over the defaults, checked. ``ValueError`` naming ``fqn`` for a param
    that is not 2-D, an unknown key or a value Muon cannot take."""
    if p.dim() != 2:
        raise ValueError(f"param_group_fn gave optimizer='muon' for param {fqn!r} of shape "
                         f"{tuple(p.shape)}: Muon orthogonalises 2-D matrices only; leave "
                         "vectors, scalars and higher-dimensional params to AdamW")
    unknown = sorted(set(overrides) - set(MUON_KEYS))
    if unknown:
        raise ValueError(f"param_group_fn returned unknown keys {unknown} for Muon param "
                         f"{fqn!r}; allowed: {['optimizer', *MUON_KEYS]}")
    try:
        return MuonSettings(**overrides).group()
    except ValueError as e:
        raise ValueError(f"param_group_fn gave param {fqn!r}: {e}") from None


# ------------------------------------------------------------------------- the math
def newton_schulz(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of each matrix of ``x`` (2-D, or a batch of
    same-shape matrices), in bf16 as torch computes it: per matrix, the same operations in
    the same order (a batch by ``bmm``, whose results on CPU are the per-matrix ones). A new
    bf16 tensor; ``x`` is left as it is."""
    a, b, c = coefficients
    y = x.to(torch.bfloat16, copy=True)  # ``x`` stays as it is
    tall = x.size(-2) > x.size(-1)
    if tall:
        y = y.mT
    if y.dim() == 2:
        y.div_(y.norm().clamp(min=eps))
        for _ in range(steps):
            gram = y @ y.T
            update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            y = torch.addmm(y, update, y, beta=a)
    else:
        # Each matrix's own norm, as the per-matrix path reduces it.
        norms = torch.stack([m.norm() for m in y.unbind(0)]).clamp(min=eps)
        y.div_(norms.view(-1, 1, 1))
        for _ in range(steps):
            gram = torch.bmm(y, y.mT)
            update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            y = torch.baddbmm(y, update, y, beta=a)
    return y.mT if tall else y


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """The learning rate of an ``A x B`` matrix, as torch.optim.Muon scales it."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def ns_cost(shape: Sequence[int]) -> int:
    """Newton-Schulz work of a matrix, up to a constant: ``max(M, N) * min(M, N)**2``."""
    big, small = max(shape), min(shape)
    return big * small * small


# ------------------------------------------------------------------------ the layout
def assign_owners(specs: Sequence[ParamSpec], dp_size: int) -> dict[str, int]:
    """FQN -> the DP rank that owns it: largest :func:`ns_cost` first (ties: more elements,
    then later-registered), each to the rank with the least cost so far (ties: lowest rank)."""
    load = [0] * dp_size
    owner = {}
    order = sorted(range(len(specs)), key=lambda i: (-ns_cost(specs[i].shape),
                                                      -specs[i].numel, -i))
    for i in order:
        rank = min(range(dp_size), key=lambda r: (load[r], r))
        load[rank] += ns_cost(specs[i].shape)
        owner[specs[i].fqn] = rank
    return owner


def rank_costs(layout: Layout) -> list[int]:
    """Each rank's Newton-Schulz work: the :func:`ns_cost` of the matrices it owns."""
    out = []
    for rank in range(layout.dp_size):
        whole = [s for s in layout.shards(rank) if layout.buffers[s.buffer_index].whole]
        out.append(sum(ns_cost(layout.slots[s.fqn].shape) for s in whole))
    return out


def plan_layout(specs: Sequence[ParamSpec], dp_size: int, bucket_numel: int,
                align_numel: int = 64, param_align: int = 1) -> Layout:
    """:func:`~shardopt.layout.build_layout` of the specs that are not ``whole``, then one
    buffer per dtype of the ``whole`` ones (Muon's), each whole in its owner's shard."""
    seen: set[str] = set()
    for s in specs:
        if s.fqn in seen:
            raise ValueError(f"duplicate param name {s.fqn!r}")
        seen.add(s.fqn)
    base = build_layout([s for s in specs if not s.whole], dp_size, bucket_numel, align_numel,
                        param_align)
    whole = [s for s in specs if s.whole]
    if not whole:
        return base
    owner = assign_owners(whole, dp_size)
    position = {s.fqn: i for i, s in enumerate(whole)}
    by_dtype: dict[torch.dtype, list[ParamSpec]] = {}
    for s in reversed(whole):  # backward order, as every buffer
        by_dtype.setdefault(s.dtype, []).append(s)
    buffers = list(base.buffers)
    for dtype, group in by_dtype.items():
        runs = _bucket_runs(group, owner, position, dp_size, bucket_numel)
        buffers.append(_owner_buffer(len(buffers), dtype, runs, align_numel))
    return Layout(dp_size, tuple(buffers))


def _bucket_runs(group: list[ParamSpec], owner: Mapping[str, int], position: Mapping[str, int],
                 dp_size: int, bucket_numel: int) -> list[list[list[ParamSpec]]]:
    """Per bucket, per rank, the matrices (in backward order) it holds (module docstring)."""
    by_size: dict[int, list[list[ParamSpec]]] = {}
    for s in group:
        by_size.setdefault(s.numel, [[] for _ in range(dp_size)])[owner[s.fqn]].append(s)
    rounds: list[list[ParamSpec]] = []
    rest: list[list[ParamSpec]] = [[] for _ in range(dp_size)]
    for per_rank in by_size.values():
        full = min(map(len, per_rank))
        rounds += [[mine[k] for mine in per_rank] for k in range(full)]
        for r, mine in enumerate(per_rank):
            rest[r] += mine[full:]
    # The round whose earliest-registered matrix is latest completes first in backward.
    rounds.sort(key=lambda members: -min(position[s.fqn] for s in members))
    runs: list[list[list[ParamSpec]]] = []
    filled = 0
    for members in rounds:
        size = sum(s.numel for s in members)
        if not runs or filled + size > bucket_numel:
            runs.append([[] for _ in range(dp_size)])
            filled = 0
        for r, s in enumerate(members):
            runs[-1][r].append(s)
        filled += size
    if any(rest):
        runs.append(rest)
    return runs


def _owner_buffer(index: int, dtype: torch.dtype, runs: list[list[list[ParamSpec]]],
                  align_numel: int) -> BufferLayout:
    """Buffer ``index``: per bucket, rank ``r``'s matrices back to back from the start of its
    shard, every shard as long as the fullest one's (rounded up to ``align_numel``)."""
    dp_size = len(runs[0])
    buckets: list[Bucket] = []
    slots: list[ParamSlot] = []
    cursor = 0
    for per_rank in runs:
        used = [sum(s.numel for s in mine) for mine in per_rank]
        shard = -(-max(max(used), 1) // align_numel) * align_numel
        for r, mine in enumerate(per_rank):
            offset = cursor + r * shard
            for s in mine:
                slots.append(ParamSlot(s.fqn, s.shape, index, len(buckets),
                                       Range(offset, offset + s.numel)))
                offset += s.numel
        fqns = tuple(s.fqn for mine in per_rank for s in mine)
        buckets.append(Bucket(index, len(buckets), Range(cursor, cursor + dp_size * shard),
                              sum(used), shard, fqns))
        cursor += dp_size * shard
    return BufferLayout(index, dtype, cursor, tuple(buckets), tuple(slots), dp_size=dp_size,
                        whole=True)


# ---------------------------------------------------------------- the usual split
HEAD_NAMES = ("lm_head", "head", "output")


def muon_groups(model: torch.nn.Module, **settings: Any
                ) -> Callable[[str, torch.nn.Parameter], dict[str, Any]]:
    """A ``param_group_fn``: Muon (``settings`` over its defaults) for every 2-D param but
    the embeddings' (``nn.Embedding``) and the output head's (the module
    ``model.get_output_embeddings()`` returns, else a child of ``model`` named ``lm_head``,
    ``head`` or ``output``); AdamW (the optimizer config) for the rest: norms, biases,
    embeddings, the head and params of other dimensions."""
    MuonSettings(**settings)  # an unknown key or a bad value raises here
    adamw = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            adamw.update(map(id, module.parameters(recurse=False)))
    get_head = getattr(model, "get_output_embeddings", None)
    heads = [get_head()] if callable(get_head) else []
    heads += [m for name, m in model.named_children() if name in HEAD_NAMES]
    for head in heads:
        if isinstance(head, torch.nn.Module):
            adamw.update(map(id, head.parameters()))
    group = {"optimizer": MUON, **settings}

    def param_group_fn(fqn: str, p: torch.nn.Parameter) -> dict[str, Any]:
        return dict(group) if p.dim() == 2 and id(p) not in adamw else {}
    return param_group_fn


__all__ = ["ADAMW", "MOMENTUM", "MUON", "MUON_KEYS", "MuonSettings", "adjusted_lr",
           "assign_owners", "group_settings", "is_muon", "muon_groups", "newton_schulz",
           "ns_cost", "plan_layout", "rank_costs", "settings_of"]
