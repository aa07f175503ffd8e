"""Chunk index: which stored bytes fill which elements of a stored tensor.

Pure overlap arithmetic over 1-D chunks (the model-space analogue of DCP's resharding): the same
code serves loading at the saved DP size and at any other. :mod:`.manifest` checks the tiling.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from ..layout import Range
from .format import StoredChunk


@dataclass(frozen=True)
class ReadRequest:
    """Copy ``numel`` elements at byte ``file_start`` of ``file`` to element ``dest_start``."""

    key: str
    file: str
    file_start: int
    numel: int
    dest_start: int  # element offset in the destination tensor


class ChunkIndex:
    """Stored chunks of every key, sorted by offset."""

    def __init__(self, chunks: Iterable[StoredChunk]) -> None:
        by_key: dict[str, list[StoredChunk]] = {}
        for c in chunks:
            by_key.setdefault(c.key, []).append(c)
        for cs in by_key.values():
            cs.sort(key=lambda c: c.offset)
        self._chunks = by_key
        self._starts = {k: [c.offset for c in cs] for k, cs in by_key.items()}

    def plan(self, key: str, want: Range) -> list[ReadRequest]:
        """Requests that fill elements ``want`` of ``key`` (dest offsets relative to ``want``)."""
        if want.size == 0:
            return []
        chunks = self._chunks[key]
        i = max(0, bisect.bisect_right(self._starts[key], want.start) - 1)
        out = []
        while i < len(chunks) and chunks[i].offset < want.end:
            c = chunks[i]
            hit = want.intersect(Range(c.offset, c.offset + c.numel))
            if hit is not None:
                out.append(ReadRequest(
                    key=key,
                    file=c.file,
                    file_start=c.data_start + (hit.start - c.offset) * c.dtype.itemsize,
                    numel=hit.size,
                    dest_start=hit.start - want.start,
                ))
            i += 1
        return out
