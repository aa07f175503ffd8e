"""N-D boxes of a param's global tensor: pure arithmetic, no storage, no ``torch.distributed``.

A rank that holds a tensor-parallel block of a param (a :class:`Box` of its global tensor)
owns a flat range of that block's row-major elements; :func:`flat_boxes` turns that range
into at most ``2 * ndim - 1`` boxes of the global tensor, in row-major order of the range.
:func:`runs` says which elements of one box's row-major data are which of another's, in
runs contiguous in both: what a load copies when the layout (DP, TP or EP) changed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .layout import Range


@dataclass(frozen=True)
class Box:
    """Elements ``[offsets[d], offsets[d] + lengths[d])`` along every dim ``d``."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths) or min(self.offsets + self.lengths,
                                                         default=0) < 0:
            raise ValueError(f"invalid box {self.offsets} + {self.lengths}")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    def intersect(self, other: Box) -> Box | None:
        """The common elements, or None when there are none."""
        lo = tuple(map(max, self.offsets, other.offsets))
        hi = tuple(map(min, self.ends, other.ends))
        if any(a >= b for a, b in zip(lo, hi)):
            return None
        return Box(lo, tuple(b - a for a, b in zip(lo, hi)))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.offsets) and all(e <= s for e, s in zip(self.ends, shape))

    def to_json(self) -> list[list[int]]:
        return [list(self.offsets), list(self.lengths)]


def flat_boxes(block: Box, want: Range) -> list[Box]:
    """Elements ``want`` of ``block``'s row-major flattening, as boxes of the tensor ``block``
    lies in (global coordinates), in row-major order: each a contiguous run of ``want``."""
    if want.end > block.numel:
        raise ValueError(f"range [{want.start}, {want.end}) is outside a block of "
                         f"{block.numel} elements")
    if want.size == 0:
        return []
    return [Box(tuple(o + a for o, a in zip(block.offsets, b.offsets)), b.lengths)
            for b in _split(block.lengths, want.start, want.end)]


def _split(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """``[start, end)`` (non-empty) of the row-major flattening of ``shape`` as boxes."""
    if len(shape) <= 1:
        return [Box((start,), (end - start,))] if shape else [Box((), ())]
    row = math.prod(shape[1:])
    first, last = start // row, (end - 1) // row
    if first == last:  # within one row: that row's piece, one dim down
        return [_prefixed(first, b) for b in _split(shape[1:], start - first * row,
                                                      end - first * row)]
    out: list[Box] = []
    whole_from, whole_to = -(-start // row), end // row  # rows taken whole
    if start % row:
        out += [_prefixed(first, b) for b in _split(shape[1:], start % row, row)]
    if whole_to > whole_from:
        out.append(Box((whole_from,) + (0,) * (len(shape) - 1),
                       (whole_to - whole_from,) + shape[1:]))
    if end % row:
        out += [_prefixed(last, b) for b in _split(shape[1:], 0, end % row)]
    return out


def _prefixed(index: int, box: Box) -> Box:
    return Box((index,) + box.offsets, (1,) + box.lengths)


@dataclass(frozen=True)
class Run:
    """``numel`` elements at row-major position ``src`` of a source box's data and ``dst``
    of a destination box's."""

    src: int
    dst: int
    numel: int


def runs(src: Box, dst: Box) -> Iterator[Run]:
    """The elements ``src`` and ``dst`` (boxes of one tensor) share, as runs contiguous in
    both boxes' row-major data, in row-major order."""
    hit = src.intersect(dst)
    if hit is None:
        return
    ndim = len(hit.lengths)
    inner = ndim  # dims from here on are whole in src, dst and hit: one run spans them
    while inner > 0 and src.lengths[inner - 1] == dst.lengths[inner - 1] == hit.lengths[inner - 1]:
        inner -= 1
    split = max(inner - 1, 0)  # the dim a run advances along, then the whole inner dims
    numel = math.prod(hit.lengths[split:])
    src_strides, dst_strides = _strides(src.lengths), _strides(dst.lengths)
    for index in itertools.product(*(range(n) for n in hit.lengths[:split])):
        point = [o + i for o, i in zip(hit.offsets, index)] + list(hit.offsets[split:])
        yield Run(_position(point, src, src_strides), _position(point, dst, dst_strides), numel)


def _strides(lengths: tuple[int, ...]) -> list[int]:
    out, step = [], 1
    for n in reversed(lengths):
        out.append(step)
        step *= n
    return out[::-1]


def _position(point: Sequence[int], box: Box, strides: Sequence[int]) -> int:
    return sum((p - o) * s for p, o, s in zip(point, box.offsets, strides))


def disjoint_cover(boxes: Sequence[Box], shape: Sequence[int]) -> str | None:
    """Why ``boxes`` do not tile ``shape`` exactly once (None when they do): a box outside
    it, two overlapping, or elements left uncovered."""
    for b in boxes:
        if not b.within(shape):
            return f"box {b.to_json()} lies outside shape {list(shape)}"
    ordered = sorted((b for b in boxes if b.numel), key=lambda b: b.offsets)
    for i, a in enumerate(ordered):  # a sweep along dim 0: only boxes that start before a ends
        for b in ordered[i + 1:]:
            if b.offsets and b.offsets[0] >= a.ends[0]:
                break
            if a.intersect(b) is not None:
                return f"boxes {a.to_json()} and {b.to_json()} overlap"
    covered = sum(b.numel for b in ordered)
    if covered != math.prod(shape):
        return f"boxes cover {covered} of {math.prod(shape)} elements"
    return None
