"""Chunk index: which stored bytes fill which elements of a stored tensor.

Pure overlap arithmetic over 1-D chunks (the model-space analogue of DCP's resharding): the
same code serves loading at the saved DP size and at any other. A key saved in
tensor-parallel blocks, or read into one, is matched as N-D boxes of its global tensor instead
(:mod:`shardopt.boxes`), for any change of DP, TP and EP. :mod:`.manifest` checks the tiling.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..boxes import Box, flat_boxes, runs
from ..layout import Range
from .format import StoredChunk


@dataclass(frozen=True)
class ReadRequest:
    """Copy ``numel`` elements at byte ``file_start`` of ``file`` to element ``dest_start`` of
    the destination."""

    file: str
    file_start: int
    numel: int
    dest_start: int


class ChunkIndex:
    """Stored chunks of every key, sorted by offset; ``shapes``: the global shape of each key."""

    def __init__(self, chunks: Iterable[StoredChunk],
                 shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        self._chunks: dict[str, list[StoredChunk]] = {}
        for c in chunks:
            self._chunks.setdefault(c.key, []).append(c)
        for cs in self._chunks.values():
            cs.sort(key=lambda c: c.offset)
        self._starts = {k: [c.offset for c in cs] for k, cs in self._chunks.items()}
        self._shapes = dict(shapes or {})
        self._boxed = {k for k, cs in self._chunks.items() if any(c.boxes for c in cs)}
        self._boxes: dict[str, list[tuple[StoredChunk, Box, int]]] = {}

    def plan(self, key: str, want: Range, block: Box | None = None) -> list[ReadRequest]:
        """Requests that fill elements ``want`` of ``key`` (dest offsets relative to ``want``);
        ``block``: ``want`` counts in that box of the global tensor (None: the whole)."""
        if want.size == 0:
            return []
        if block is not None or key in self._boxed:
            return self._plan_boxes(key, want, block)
        chunks = self._chunks[key]
        out = []
        for c in chunks[max(0, bisect.bisect_right(self._starts[key], want.start) - 1):]:
            if c.offset >= want.end:
                break
            hit = want.intersect(Range(c.offset, c.offset + c.numel))
            if hit is not None:
                out.append(ReadRequest(c.file, c.data_start + (hit.start - c.offset) *
                                       c.dtype.itemsize, hit.size, hit.start - want.start))
        return out

    def _plan_boxes(self, key: str, want: Range, block: Box | None) -> list[ReadRequest]:
        shape = self._shapes.get(key) or (sum(c.numel for c in self._chunks[key]),)
        stored = self._stored_boxes(key, shape)
        out, pos = [], 0
        for dest in flat_boxes(block or Box.whole(shape), want):
            for c, box, first in stored:
                for r in runs(box, dest):
                    out.append(ReadRequest(c.file, c.data_start + (first + r.src) *
                                           c.dtype.itemsize, r.numel, pos + r.dst))
            pos += dest.numel
        return out

    def _stored_boxes(self, key: str, shape: tuple[int, ...]
                      ) -> list[tuple[StoredChunk, Box, int]]:
        """Every stored box of ``key``: its chunk, and where its data starts in the chunk."""
        found = self._boxes.get(key)
        if found is None:
            found = self._boxes[key] = []
            for c in self._chunks[key]:
                boxes = c.boxes or flat_boxes(Box.whole(shape), Range(c.offset, c.offset + c.numel))
                first = 0
                for box in boxes:
                    found.append((c, box, first))
                    first += box.numel
        return found
