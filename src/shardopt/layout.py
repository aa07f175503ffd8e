"""Flat-buffer layout: which element of which buffer belongs to which param and which rank.

Pure arithmetic over named, frozen records, with no storage and no ``torch.distributed``; the
optimizer, the checkpoint layer and export read the same :class:`Layout`.

* Params are grouped by model dtype into one flat buffer per dtype (per DP group and dtype
  where params have several DP groups), in reverse registration order (roughly the order
  backward produces their gradients).
* Each buffer is cut into buckets at param boundaries, each padded to split into ``dp_size``
  equal shards of a multiple of ``align_numel`` elements.
* Rank ``r`` owns ``[r * S, (r + 1) * S)`` of every bucket (``S``: the shard size). Shards
  ignore param boundaries; each (param, rank) intersection is one contiguous range.
* A rank's state for a buffer is one flat "local" tensor: its shard of each bucket in turn.

Range names carry their coordinates: ``*_global`` in the whole buffer, ``*_local`` in the
rank's local tensor, ``*_param`` in the flattened param.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

# The per-param state of a shard, in the order state_dict() and checkpoints hold it.
STATE_NAMES = ("master_param", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Range:
    """Half-open ``[start, end)`` interval of elements."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"invalid range [{self.start}, {self.end})")

    @property
    def size(self) -> int:
        return self.end - self.start

    def intersect(self, other: Range) -> Range | None:
        start, end = max(self.start, other.start), min(self.end, other.end)
        return Range(start, end) if start < end else None

    def shift(self, offset: int) -> Range:
        return Range(self.start + offset, self.end + offset)

    def as_slice(self) -> slice:
        return slice(self.start, self.end)

    def blocks(self, block: int) -> Range:
        """The blocks of ``block`` elements (block ``k`` is ``[k * block, (k + 1) * block)``)
        that this range touches: none when it is empty."""
        first = self.start // block
        return Range(first, -(-self.end // block) if self.size else first)


@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know about one trainable param."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    whole: bool = False  # lies whole in one rank's shard (Muon: :func:`shardopt.muon.plan_layout`)
    dp_group: int = 0  # which of the optimizer's DP groups shards it

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParamSlot:
    """Where a whole param sits in its buffer."""

    fqn: str
    shape: tuple[int, ...]
    buffer_index: int
    bucket_index: int
    range_global: Range


@dataclass(frozen=True)
class Bucket:
    """A padded, evenly divisible run of a buffer; the unit of communication."""

    buffer_index: int
    index: int
    range_global: Range  # padded extent in the buffer
    numel_unpadded: int
    shard_numel: int
    param_fqns: tuple[str, ...]

    def shard_range_global(self, dp_rank: int) -> Range:
        start = self.range_global.start + dp_rank * self.shard_numel
        return Range(start, start + self.shard_numel)


@dataclass(frozen=True)
class ParamShard:
    """The part of one param that one rank owns (its slice of a shard)."""

    fqn: str
    dp_rank: int
    buffer_index: int
    bucket_index: int
    range_global: Range
    range_local: Range
    range_param: Range


@dataclass(frozen=True)
class BufferLayout:
    """One flat buffer of params of one model dtype."""

    index: int
    dtype: torch.dtype
    numel: int  # padded total
    buckets: tuple[Bucket, ...]
    params: tuple[ParamSlot, ...]
    whole: bool = False  # every param lies whole in one rank's shard (Muon's buffers)
    dp_group: int = 0
    dp_size: int = 1  # of its DP group: each bucket splits into this many shards

    @property
    def local_numel(self) -> int:
        """Elements each rank owns in this buffer (the same on every rank)."""
        return sum(b.shard_numel for b in self.buckets)

    def local_offset(self, bucket_index: int) -> int:
        return sum(b.shard_numel for b in self.buckets[:bucket_index])


@dataclass(frozen=True)
class Layout:
    """All buffers of one model for one data-parallel size."""

    dp_size: int
    buffers: tuple[BufferLayout, ...]

    @cached_property
    def slots(self) -> dict[str, ParamSlot]:
        return {p.fqn: p for buf in self.buffers for p in buf.params}

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(self.slots)

    def shards(self, dp_rank: int, group_ranks: Mapping[int, int] | None = None
               ) -> tuple[ParamShard, ...]:
        """Every (param, ``dp_rank``) intersection, in buffer then position order;
        ``group_ranks``: this rank's rank in each DP group (default: ``dp_rank`` in all)."""
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {self.dp_size}")
        out: list[ParamShard] = []
        for buf in self.buffers:
            rank = dp_rank if group_ranks is None else group_ranks[buf.dp_group]
            if not 0 <= rank < buf.dp_size:
                raise ValueError(f"dp_rank {rank} out of range for dp_size {buf.dp_size} of "
                                 f"DP group {buf.dp_group}")
            for bucket in buf.buckets:
                own = bucket.shard_range_global(rank)
                local_base = buf.local_offset(bucket.index) - own.start
                for fqn in bucket.param_fqns:
                    slot = self.slots[fqn]
                    hit = slot.range_global.intersect(own)
                    if hit is None:
                        continue
                    out.append(ParamShard(fqn, rank, buf.index, bucket.index, hit,
                                          hit.shift(local_base),
                                          hit.shift(-slot.range_global.start)))
        return tuple(out)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def build_layout(params: Sequence[ParamSpec], dp_size: int, bucket_numel: int,
                 align_numel: int = 64, param_align: int = 1,
                 group_sizes: Mapping[int, int] | None = None) -> Layout:
    """Lay ``params`` (in registration order) out for ``dp_size`` ranks, each buffer and the
    params in it in reverse registration order, so the first bucket fills first in backward.

    ``group_sizes`` (DP group index -> size; default ``{0: dp_size}``) gives each param's
    ``dp_group`` its size: buffers are per (DP group, dtype), so no bucket mixes groups.

    ``param_align`` > 1 (blockwise 8-bit state; it must divide ``align_numel``) starts every
    param at a multiple of it in its buffer, so every shard of a param starts on a multiple of
    it in the flattened param and each block of ``param_align`` elements lies on one rank.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    if align_numel < 1:
        raise ValueError(f"align_numel must be >= 1, got {align_numel}")
    if param_align < 1 or align_numel % param_align:
        raise ValueError(f"param_align ({param_align}) must be >= 1 and divide "
                         f"align_numel ({align_numel})")
    seen: set[str] = set()
    for p in params:
        if p.fqn in seen:
            raise ValueError(f"duplicate param name {p.fqn!r}")
        seen.add(p.fqn)
    sizes = {0: dp_size} if group_sizes is None else dict(group_sizes)
    for p in params:
        if sizes.get(p.dp_group, 0) < 1:
            raise ValueError(f"param {p.fqn!r} is in DP group {p.dp_group}, which has no size "
                             f"(group sizes {sizes})")
    by_dtype: dict[tuple[int, torch.dtype], list[ParamSpec]] = {}
    for p in reversed(params):
        by_dtype.setdefault((p.dp_group, p.dtype), []).append(p)

    buffers: list[BufferLayout] = []
    for buffer_index, ((dp_group, dtype), group) in enumerate(by_dtype.items()):
        group_size = sizes[dp_group]
        buckets: list[Bucket] = []
        slots: list[ParamSlot] = []
        cursor = 0
        for members in _bucket_members(group, bucket_numel):
            offset = cursor
            for spec in members:
                slots.append(ParamSlot(spec.fqn, spec.shape, buffer_index, len(buckets),
                                       Range(offset, offset + spec.numel)))
                offset = _round_up(offset + spec.numel, param_align)
            used = offset - cursor
            padded = _round_up(max(used, 1), group_size * align_numel)
            buckets.append(Bucket(buffer_index, len(buckets), Range(cursor, cursor + padded),
                                  used, padded // group_size, tuple(s.fqn for s in members)))
            cursor += padded
        buffers.append(BufferLayout(buffer_index, dtype, cursor, tuple(buckets), tuple(slots),
                                    dp_group=dp_group, dp_size=group_size))
    return Layout(dp_size, tuple(buffers))


def _bucket_members(group: list[ParamSpec], bucket_numel: int) -> list[list[ParamSpec]]:
    """``group`` cut at param boundaries into runs of at most ``bucket_numel`` elements (a
    param larger than that alone in its run)."""
    out: list[list[ParamSpec]] = []
    numel = 0
    for spec in group:
        if out and numel + spec.numel <= bucket_numel:
            out[-1].append(spec)
            numel += spec.numel
        else:
            out.append([spec])
            numel = spec.numel
    return out
