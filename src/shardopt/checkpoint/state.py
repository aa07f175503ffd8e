"""Model-space view of one rank's state: what it saves and where what it loads goes.

Keyed by FQN, all flat 1-D: weights as ``"{fqn}"`` in the model dtype, ``"{fqn}.master_param"``
(fp32), ``"{fqn}.exp_avg"`` and ``"{fqn}.exp_avg_sq"`` in the moments' storage dtype (8-bit
codes with fp32 ``"{fqn}.exp_avg.scale"`` & co.), or for a Muon param
``"{fqn}.momentum_buffer"`` (fp32). A rank's chunks are its
:class:`~shardopt.layout.ParamShard` records (``shard_state.parallel.saved_shards``: one
copy of each replicated piece); a tensor-parallel param's count in its block of the global
tensor (``shard_state.parallel.blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from .. import muon
from ..boxes import Box
from ..config import GROUP_KEYS
from ..errors import CheckpointError
from ..layout import STATE_NAMES, Range
from ..moments import Moments
from ..optimizer import DistributedOptimizer
from .format import dtype_name, state_file_kind
from .manifest import MomentEncoding
from .storage import Job, WriteEntry


@dataclass(frozen=True)
class Destination:
    """Elements ``want`` of stored tensor ``key`` go into ``tensor`` (in place) or, for Adam
    moments (allocated once every check has passed), into slice ``range_local`` of the
    ``part`` (``"values"`` or ``"scales"``) of moment ``moment`` of buffer ``buffer_index``."""

    key: str
    want: Range
    tensor: torch.Tensor | None = None
    moment: str | None = None
    buffer_index: int = 0
    range_local: Range | None = None
    part: str = "values"
    block: Box | None = None  # ``want`` counts in this box of the global tensor

    def resolve(self, moments: Moments) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor
        assert self.moment is not None and self.range_local is not None
        m = moments.of(self.moment)[self.buffer_index]
        return getattr(m, self.part)[self.range_local.as_slice()]


def frozen_tensors(model: torch.nn.Module, opt: DistributedOptimizer,
                   check_model: bool = False) -> dict[str, torch.Tensor]:
    """State-dict tensors the optimizer does not own (frozen params, persistent buffers);
    with ``check_model``, ``shard_state.check_model`` on the params the same walk found."""
    sd = model.state_dict(keep_vars=True)
    if check_model:
        params: dict[int, tuple[str, torch.Tensor]] = {}  # named_parameters(): first name
        for fqn, t in sd.items():
            if isinstance(t, torch.nn.Parameter):
                params.setdefault(id(t), (fqn, t))
        opt.shard_state.check_model(model, params.values())
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for fqn, t in sd.items():
        if (isinstance(t, torch.Tensor) and fqn not in opt.layout.slots
                and fqn not in opt.shard_state.aliases and id(t) not in seen):
            if isinstance(t, DTensor):
                raise CheckpointError(f"tensor {fqn!r} is a DTensor that the optimizer does not "
                                      "train: checkpoints hold frozen tensors and buffers as "
                                      "plain tensors only")
            seen.add(id(t))
            out[fqn] = t
    return out


@dataclass(frozen=True)
class ParamFacts:
    """What of the manifest's ``params`` table can change after a save's call (steps,
    hyperparameters, frozen tensors), copied at the call; :func:`describe` builds the table."""

    steps: dict[str, int]
    groups: list[dict]
    frozen: dict[str, dict]  # the table's rows of the frozen tensors

    @classmethod
    def capture(cls, opt: DistributedOptimizer, frozen: dict[str, torch.Tensor]) -> ParamFacts:
        return cls(dict(opt.param_steps),
                   [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                     if k in GROUP_KEYS or (muon.is_muon(g) and k in SAVED_MUON_KEYS)}
                    for g in opt.param_groups],
                   {fqn: {"shape": list(t.shape), "dtype": dtype_name(t.dtype),
                          "trainable": False} for fqn, t in frozen.items()})


def describe(opt: DistributedOptimizer, facts: ParamFacts) -> dict[str, dict]:
    """Manifest ``params`` table: shape, dtype, trainable, step and hyperparameters per FQN."""
    table: dict[str, dict] = {}
    par = opt.shard_state.parallel
    for fqn, slot in opt.layout.slots.items():
        table[fqn] = {
            "shape": list(par.global_shapes[fqn]),
            "dtype": dtype_name(opt.layout.buffers[slot.buffer_index].dtype),
            "trainable": True,
            "step": facts.steps[fqn],
            "group": dict(facts.groups[opt.shard_state.group_of[fqn]]),
        }
        if fqn in par.placements:
            table[fqn]["placements"] = list(par.placements[fqn])
    return table | facts.frozen


def sources(opt: DistributedOptimizer, frozen: dict[str, torch.Tensor]
            ) -> dict[str, torch.Tensor]:
    """The flat tensors all that :func:`contents` writes views: ``shard_state.sources()``
    and (rank 0) the ``frozen`` tensors flattened (views where contiguous)."""
    out = opt.shard_state.sources()
    if opt.shard_state.dp.rank == 0:
        out.update({f"frozen.{fqn}": t.detach().reshape(-1) for fqn, t in frozen.items()})
    return out


def model_entries(opt: DistributedOptimizer, frozen: dict[str, torch.Tensor]
                  ) -> list[WriteEntry]:
    """Model weights this rank writes: its shards of trainable params, and (rank 0) the
    ``frozen`` tensors."""
    par = opt.shard_state.parallel
    out = [
        WriteEntry(s.fqn, opt.layout.buffers[s.buffer_index].dtype, s.range_param.size,
                   s.range_param.start, opt.shard_state.view("params", s), par.blocks.get(s.fqn))
        for s in par.saved_shards
    ]
    if opt.shard_state.dp.rank == 0:
        for fqn, t in frozen.items():
            out.append(WriteEntry(fqn, t.dtype, t.numel(), 0, t.detach().reshape(-1)))
    return out


# A Muon group's entries the manifest keeps beside the AdamW ones.
SAVED_MUON_KEYS = ("optimizer", *muon.MUON_KEYS)
MOMENTUM_ENCODING = MomentEncoding(torch.float32)  # Muon's momentum buffer


def encodings(opt: DistributedOptimizer) -> dict[str, MomentEncoding]:
    """How ``opt`` stores each Adam moment, as a checkpoint records it."""
    return {name: MomentEncoding.of(kind, name)
            for name, kind in opt.shard_state.moment_kinds.items()}


def param_encodings(opt: DistributedOptimizer, fqn: str) -> dict[str, MomentEncoding]:
    """How ``opt`` stores each moment param ``fqn`` has: Adam's, or Muon's momentum buffer."""
    adam = encodings(opt)
    return {name: adam.get(name, MOMENTUM_ENCODING)
            for name in opt.shard_state.moment_names[fqn]}


def optim_entries(opt: DistributedOptimizer, name: str) -> list[WriteEntry]:
    """Optimizer state ``name`` this rank writes, moments in their storage dtype (with
    their scales under ``"{fqn}.{name}.scale"``); moments are zeros before the first step."""
    out = []
    enc = encodings(opt).get(name, MOMENTUM_ENCODING if name == muon.MOMENTUM else None)
    st = opt.shard_state
    for s in st.parallel.saved_shards:
        if enc is not None and name not in st.moment_names[s.fqn]:
            continue  # Adam's moments of a Muon param, or the reverse
        r, block = s.range_param, st.parallel.blocks.get(s.fqn)
        if enc is None:  # the master param
            out.append(WriteEntry(f"{s.fqn}.{name}", torch.float32, r.size, r.start,
                                  st.view(name, s), block))
            continue
        m = st.moment(name, s) if st.has_moments else None
        out.append(WriteEntry(f"{s.fqn}.{name}", enc.dtype, r.size, r.start,
                              None if m is None else m.values, block))
        if enc.block:  # the piece starts on a block boundary (param_align): whole blocks
            check_quantized(opt, s.fqn)
            b = r.blocks(enc.block)
            out.append(WriteEntry(f"{s.fqn}.{name}.scale", torch.float32, b.size, b.start,
                                  None if m is None else m.scales))
    return out


def contents(opt: DistributedOptimizer, frozen: dict[str, torch.Tensor]) -> list[Job]:
    """Coordinator-free. What this rank writes of the state, by file kind."""
    out = {"model": model_entries(opt, frozen)}
    for name in (*STATE_NAMES, muon.MOMENTUM):
        out.setdefault(state_file_kind(name), []).extend(optim_entries(opt, name))
    return [Job(kind, entries) for kind, entries in out.items()]


def check_quantized(opt: DistributedOptimizer, fqn: str) -> None:
    """8-bit moments' scales count blocks of a flattened tensor: of the global tensor only."""
    if fqn in opt.shard_state.parallel.blocks:
        raise CheckpointError(f"param {fqn!r} is sharded by tensor or expert parallelism and "
                              "has 8-bit moments, whose scales checkpoints hold for whole "
                              "params only: use exp_avg_dtype / exp_avg_sq_dtype bfloat16 or "
                              "float32 for such params")


def destinations(model: torch.nn.Module, opt: DistributedOptimizer,
                 saved: dict[str, MomentEncoding]) -> list[Destination]:
    """Where this rank's loaded data goes: master params and frozen tensors in place, moments
    stored as ``opt`` stores them into tensors allocated later (the others: :mod:`.convert`).
    Trainable weights are not read: the master params rebuild them."""
    out = []
    for s in opt.shard_state.shards:
        block = opt.shard_state.parallel.blocks.get(s.fqn)
        out.append(Destination(f"{s.fqn}.master_param", s.range_param,
                               tensor=opt.shard_state.view("master_param", s), block=block))
        for name, enc in param_encodings(opt, s.fqn).items():
            if saved.get(name, enc) != enc:
                continue
            out.append(Destination(f"{s.fqn}.{name}", s.range_param, moment=name,
                                   buffer_index=s.buffer_index, range_local=s.range_local,
                                   block=block))
            if enc.block:
                check_quantized(opt, s.fqn)
                b = enc.block
                out.append(Destination(
                    f"{s.fqn}.{name}.scale", s.range_param.blocks(b), moment=name,
                    buffer_index=s.buffer_index, range_local=s.range_local.blocks(b),
                    part="scales"))
    for fqn, t in frozen_tensors(model, opt).items():
        if not t.is_contiguous():
            raise ValueError(f"tensor {fqn!r} is not contiguous and cannot be loaded in place")
        out.append(Destination(fqn, Range(0, t.numel()), tensor=t.detach().view(-1)))
    return out
