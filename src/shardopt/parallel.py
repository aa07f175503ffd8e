"""Params in a model-parallel world: DTensor params, each param's data-parallel group, and how
many ranks of the world hold each element of a param.

A param is a plain tensor, replicated over every rank outside its DP group, or a DTensor on
its own mesh (``parallelize_module``): the optimizer lays out, reduces and updates its local
tensor only, over the param's DP group (``process_group``, or ``dp_group_fn(fqn, param)``).
Each element of a param lies in one DP rank's shard of each copy of the local tensor, and the
world holds ``copies = world_size / (dp_size * shards)`` such copies, ``shards`` being the
number of pieces the DTensor's ``Shard`` placements cut it into (1 for a plain param). The
global grad norm weighs each element by ``1 / copies``, so the world counts it once
(docs/optimizer.md, "Tensor and expert parallelism").

A checkpoint stores each element once: of the ranks that hold the same block (the DTensor's
local box of the global tensor; the whole tensor for a plain param), those of the DP group
of the lowest world rank write it (``ParamParallel.writes``).

:func:`plan` is collective over the world (one exchange of each rank's blocks and problems).
A model of plain params with no ``dp_group_fn`` has no plan: it takes the data-parallel path.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import comm
from .boxes import Box
from .errors import UsageError
from .layout import Layout, ParamShard, ParamSpec

DPGroupFn = Callable[[str, torch.nn.Parameter], Any]  # (fqn, param) -> ProcessGroup


@dataclass(frozen=True)
class ParamParallel:
    """How one param is spread over the world."""

    fqn: str
    dp_group: int  # index into ParallelPlan.groups
    copies: int  # ranks of the world whose DP shards together hold each element once
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    placements: tuple[str, ...]  # of the DTensor's mesh dims; () for a plain param
    block: Box  # this rank's local tensor in the global tensor
    writes: bool = True  # this rank's DP shard of it goes into checkpoints

    @property
    def whole(self) -> bool:
        """Whether the local tensor is the whole global tensor (not sharded by the mesh)."""
        return self.local_shape == self.global_shape


@dataclass(frozen=True)
class ParallelPlan:
    """The DP groups of one optimizer (index 0: ``process_group``) and every param's record."""

    groups: tuple[comm.DPGroup, ...]
    world: comm.DPGroup
    params: dict[str, ParamParallel]

    def group_sizes(self) -> dict[int, int]:
        return {i: g.size for i, g in enumerate(self.groups)}

    def specs(self, named: Sequence[tuple[str, torch.nn.Parameter]]) -> list[ParamSpec]:
        """The layout's view of ``named``: local shapes, each in its DP group."""
        return [ParamSpec(fqn, self.params[fqn].local_shape, p.dtype,
                          dp_group=self.params[fqn].dp_group) for fqn, p in named]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (``t`` itself for a plain tensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_data_ptr(t: torch.Tensor) -> int:
    """Where the local tensor of ``t`` starts (a DTensor's own ``data_ptr()`` is 0)."""
    return local_tensor(t).data_ptr()


def bind_local(p: torch.nn.Parameter, view: torch.Tensor) -> None:
    """Make ``view`` (the local shape) the storage ``p`` reads and writes: its ``.data`` for a
    plain param, the local tensor of a DTensor param (torch has no public setter for it)."""
    if isinstance(p, DTensor):
        p._local_tensor = view
    else:
        p.data = view


def face(p: torch.nn.Parameter, view: torch.Tensor) -> torch.Tensor:
    """What ``p.grad`` is when it is ``view`` (the local shape): ``view`` itself for a plain
    param, a DTensor of ``p``'s mesh and placements over it for a DTensor param."""
    if not isinstance(p, DTensor):
        return view
    return DTensor.from_local(view, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def plan(named: Sequence[tuple[str, torch.nn.Parameter]], dp: comm.DPGroup,
         dp_group_fn: DPGroupFn | None) -> ParallelPlan | None:
    """Collective over the world when a plan is made. None for plain params without
    ``dp_group_fn``; else each param's DP group and copies, checked on every rank: every rank
    raises :class:`UsageError` (naming the ranks and the FQN) if any rank finds a param it
    cannot place or the ranks hold different params."""
    if dp_group_fn is None and not any(isinstance(p, DTensor) for _, p in named):
        return None
    world = comm.DPGroup.resolve(None)
    groups = [dp]
    error, params = None, {}
    try:
        for fqn, p in named:
            index = _group_index(groups, dp_group_fn(fqn, p) if dp_group_fn else None, fqn)
            params[fqn] = _record(fqn, p, index, groups[index].size, world.size)
        if dp.size == 1 and any(g.size > 1 for g in groups):
            raise UsageError("a dp_group_fn group has several ranks but process_group has one: "
                             "pass the data-parallel group of the dense params as process_group")
    except Exception as e:  # noqa: BLE001 - reported to every rank by agree (dp_group_fn's too)
        error = e
    rows = sorted((f, r.copies, r.global_shape, r.placements) for f, r in params.items())
    digest = hashlib.sha256(repr([f for f, _ in named] + rows).encode()).hexdigest()
    blocks = {f: r.block.offsets for f, r in params.items() if not r.whole}
    payloads, problems = comm.agree(world, error, (digest, blocks))
    if problems:
        raise UsageError(problems)
    if len({d for d, _ in payloads}) > 1:
        raise UsageError("ranks of the world hold different params (FQNs, global shapes or "
                         "placements differ): build the same model on every rank, each "
                         "parallelised with the same plan")
    members = [_members(g) for g in groups]
    for fqn, r in params.items():
        same = [w for w, (_, b) in enumerate(payloads) if b.get(fqn) == blocks.get(fqn)]
        params[fqn] = dataclasses.replace(r, writes=min(same) in members[r.dp_group])
    return ParallelPlan(tuple(groups), world, params)


def muon_problem(named: Sequence[tuple[str, torch.nn.Parameter]], muon: set[int]) -> str | None:
    """Why a model-parallel plan cannot train these params, or None: Muon orthogonalises a
    whole matrix, which a TP/EP shard or a second DP group does not lay out."""
    fqn = next((f for f, p in named if id(p) in muon), None)
    if fqn is None:
        return None
    return (f"param {fqn!r} is in a Muon param group, which DistributedOptimizer trains with "
            "data parallelism only (no DTensor params, no dp_group_fn): give it AdamW")


def _members(dp: comm.DPGroup) -> frozenset[int]:
    """The world ranks of ``dp``."""
    if dp.group is None:  # the default group is the world (one rank without a process group)
        return frozenset(range(dp.size))
    return frozenset(dist.get_process_group_ranks(dp.group))


def _group_index(groups: list[comm.DPGroup], group: Any, fqn: str) -> int:
    """The index of ``group`` (None: ``process_group``) in ``groups``, appended if new."""
    if group is None:
        return 0
    if not isinstance(group, dist.ProcessGroup):
        raise UsageError(f"dp_group_fn returned {type(group).__name__} for param {fqn!r}; it "
                         "returns a ProcessGroup (mesh['dp'].get_group()) or None")
    for i, g in enumerate(groups):
        if g.group is group or (i == 0 and g.group is None and group is dist.group.WORLD):
            return i
    groups.append(comm.DPGroup.resolve(group))
    return len(groups) - 1


def _record(fqn: str, p: torch.nn.Parameter, dp_group: int, dp_size: int,
            world_size: int) -> ParamParallel:
    shards, placements = 1, ()
    if isinstance(p, DTensor):
        placements = tuple(repr(pl) for pl in p.placements)
        for dim, pl in enumerate(p.placements):
            if pl.is_partial():
                raise UsageError(f"param {fqn!r} has a Partial placement: a param holds "
                                 "values, not pending sums; use Shard or Replicate")
            if pl.is_shard():
                shards *= p.device_mesh.size(dim)
    copies = world_size // (dp_size * shards)
    if copies < 1 or copies * dp_size * shards != world_size:
        raise UsageError(
            f"param {fqn!r}: its DP group of {dp_size} ranks and its {shards} shards "
            f"({placements or 'a plain tensor'}) do not tile the world of {world_size} ranks; "
            "a param's DP group holds one copy of its local tensor, orthogonal to the mesh "
            "dims it is sharded on")
    local = tuple(local_tensor(p).shape)
    block = Box.whole(local)
    if isinstance(p, DTensor):
        chunk = p.__create_chunk_list__()[0]  # the DTensor's own answer, as DCP asks it
        block = Box(tuple(chunk.offsets), tuple(chunk.sizes))
        if block.lengths != local:
            raise UsageError(f"param {fqn!r}: its local tensor {list(local)} is not one box "
                             f"of its global tensor ({placements}); use Shard or Replicate")
    return ParamParallel(fqn, dp_group, copies, local, tuple(p.shape), placements, block)



@dataclass(frozen=True)
class Facts:
    """What the layers above the optimizer read of its plan (``opt.shard_state.parallel``):
    whether there is one; the shards this rank stores in checkpoints (one copy of each
    replicated piece); each param's global shape; each TP/EP-sharded param's local box of
    its global tensor; the DTensors' placements."""

    model_parallel: bool
    saved_shards: tuple[ParamShard, ...]
    global_shapes: Mapping[str, tuple[int, ...]]
    blocks: Mapping[str, Box]
    placements: Mapping[str, tuple[str, ...]]


def facts(plan: ParallelPlan | None, shards: tuple[ParamShard, ...], layout: Layout) -> Facts:
    if plan is None:
        shapes = {f: s.shape for f, s in layout.slots.items()}
        return Facts(False, shards, MappingProxyType(shapes), MappingProxyType({}),
                     MappingProxyType({}))
    return Facts(True, tuple(s for s in shards if plan.params[s.fqn].writes),
                 MappingProxyType({f: r.global_shape for f, r in plan.params.items()}),
                 MappingProxyType({f: r.block for f, r in plan.params.items() if not r.whole}),
                 MappingProxyType({f: r.placements for f, r in plan.params.items()
                                   if r.placements}))
