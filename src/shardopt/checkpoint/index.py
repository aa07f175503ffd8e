"""Chunk index: which stored bytes fill which elements of a stored tensor.

Pure overlap arithmetic over 1-D chunks (the model-space analogue of DCP's resharding): the
same code serves loading at the saved DP size and at any other. :mod:`.manifest` checks the
tiling.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

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
    """Stored chunks of every key, sorted by offset."""

    def __init__(self, chunks: Iterable[StoredChunk]) -> None:
        self._chunks: dict[str, list[StoredChunk]] = {}
        for c in chunks:
            self._chunks.setdefault(c.key, []).append(c)
        for cs in self._chunks.values():
            cs.sort(key=lambda c: c.offset)
        self._starts = {k: [c.offset for c in cs] for k, cs in self._chunks.items()}

    def plan(self, key: str, want: Range) -> list[ReadRequest]:
        """Requests that fill elements ``want`` of ``key`` (dest offsets relative to ``want``)."""
        if want.size == 0:
            return []
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
