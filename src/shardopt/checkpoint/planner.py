"""Read planning: which stored bytes fill which destination elements.

Pure overlap arithmetic over 1-D chunks (the model-space analogue of
``torch.distributed.checkpoint``'s resharding): the same code serves loading
at the saved DP size and at any other.
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
    """Stored chunks of every key, sorted by offset; validates that they tile each tensor."""

    def __init__(self, chunks: Iterable[StoredChunk], numels: dict[str, int]) -> None:
        by_key: dict[str, list[StoredChunk]] = {}
        for c in chunks:
            by_key.setdefault(c.key, []).append(c)
        for key, cs in by_key.items():
            cs.sort(key=lambda c: c.offset)
            if key not in numels:
                raise ValueError(f"stored tensor {key!r} is not described by the manifest")
            pos = 0
            for c in cs:
                if c.offset != pos:
                    what = "overlap" if c.offset < pos else "gap"
                    raise ValueError(f"stored chunks of {key!r} have a {what} at element {pos} "
                                     f"(file {c.file})")
                pos += c.numel
            if pos != numels[key]:
                raise ValueError(f"stored chunks of {key!r} cover {pos} of {numels[key]} elements")
        for key, n in numels.items():
            if n and key not in by_key:
                raise ValueError(f"no stored data for {key!r}")
        self._chunks = by_key
        self._starts = {k: [c.offset for c in cs] for k, cs in by_key.items()}

    def keys(self) -> Iterable[str]:
        return self._chunks.keys()

    def chunks(self, key: str) -> list[StoredChunk]:
        return self._chunks.get(key, [])

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
