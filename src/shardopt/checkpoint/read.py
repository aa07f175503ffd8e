"""The one read engine of checkpoints: ``load``, ``verify`` and ``export`` all read through it.

:class:`DataFiles` opens a checkpoint's data files, cross-checks their headers with the
manifest and says which stored bytes fill a destination. :func:`read_verified` fills fresh
destinations (new Adam moments, RNG states, export buffers) at once, in one pass that
hash-checks each block as it reads it where the block layout allows (else verify, then
read); in-place destinations (existing tensors) are only verified, and filled by the
function it returns, which ``load`` runs once every rank found everything in order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..layout import Range
from .blocks import BlockFile, one_pass_ok, read_blocks, verify_blocks
from .index import ChunkIndex
from .manifest import Manifest
from .config import STAGING_BYTES
from .format import FormatError
from .storage import FileReader, read_scratch
from .transfer import FileSegment, Segment, read_segments


@dataclass(frozen=True)
class Read:
    """Stored bytes of ``file`` at ``file_start`` (``out.numel()`` elements of ``dtype``)
    fill ``out`` (1-D); ``in_place``: ``out`` existed before the read began."""

    file: FileReader
    file_start: int
    out: torch.Tensor
    dtype: torch.dtype
    in_place: bool

    def segment(self) -> Segment:
        return Segment(self.file_start, self.out, self.dtype)


class DataFiles:
    """Data files ``names`` of checkpoint ``m``, open, headers checked against the manifest."""

    def __init__(self, m: Manifest, names: Iterable[str]) -> None:
        self.readers: dict[str, FileReader] = {}
        stored = m.stored()
        chunks = []
        try:
            for name in names:
                reader = self.readers[name] = FileReader(m.path, m.files[name])
                found = reader.chunks(stored)
                if reader.record.kind != "rng":
                    chunks.extend(found)
        except BaseException:
            self.close()
            raise
        self.directory = m.path
        self.stored = stored
        self.scale_keys = frozenset(m.scale_keys())
        self.index = ChunkIndex(chunks)

    def reads(self, key: str, want: Range, out: torch.Tensor, in_place: bool) -> list[Read]:
        """What fills ``out`` (1-D) with elements ``want`` of stored tensor ``key``."""
        dtype = self.stored[key].dtype
        return [Read(self.readers[r.file], r.file_start, out.narrow(0, r.dest_start, r.numel),
                     dtype, in_place) for r in self.index.plan(key, want)]

    def check_scales(self, key: str, first: int, scales: torch.Tensor) -> None:
        """Raise :class:`FormatError`, naming the file, unless every scale of ``scales``
        (elements ``first`` on of the stored 8-bit moment scales ``key``) is finite and
        >= 0: a scale is its block's absolute maximum over the largest code, and a NaN,
        infinite or negative one makes the weights NaN one step after the load."""
        bad = (~torch.isfinite(scales) | (scales < 0)).nonzero()
        if not bad.numel():
            return
        i = int(bad[0, 0])
        file = self.index.plan(key, Range(first + i, first + i + 1))[0].file
        raise FormatError(f"{self.directory / file}: {key!r} holds the scale "
                          f"{scales[i].item()} for block {first + i} (8-bit moment scales are "
                          "finite and >= 0: the file is damaged or forged)")

    def rng_state(self, name: str, key: str) -> Read | None:
        """A whole uint8 tensor ``key`` of RNG file ``name`` into a new tensor (None if absent)."""
        reader = self.readers[name]
        for c in reader.header().chunks:
            if c.key == key and c.dtype == torch.uint8:
                return Read(reader, c.data_start, torch.empty(c.numel, dtype=torch.uint8),
                            torch.uint8, in_place=False)
        return None

    def keep_only(self, reads: list[Read]) -> None:
        """Close the files that none of ``reads`` touches."""
        used = {r.file.name for r in reads}
        for name in [n for n in self.readers if n not in used]:
            self.readers.pop(name).close()

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.readers = {}


def _blocks(f: FileReader) -> BlockFile:
    r = f.record
    return BlockFile(f.fd, f.path, list(r.hashes), r.block_bytes, r.size)


def _touched(f: FileReader, spans: Iterable[tuple[int, int]]) -> set[int]:
    """Blocks of ``f`` that byte spans ``[start, end)`` touch, and those of its header."""
    bb = f.record.block_bytes
    out: set[int] = set()
    for start, end in [(0, f.header_bytes), *spans]:
        blocks = Range(start, end).blocks(bb)
        out.update(range(blocks.start, blocks.end))
    return out


def _read(reads: list[Read], staging_bytes: int, threads: int) -> None:
    if not reads:
        return
    device = next((r.out.device for r in reads if r.out.is_cuda), torch.device("cpu"))
    casts = any(r.out.dtype != r.dtype for r in reads)
    read_segments([FileSegment(r.file.fd, r.file.path, r.segment()) for r in reads],
                  read_scratch(staging_bytes, device, casts, threads), threads)


def read_verified(reads: list[Read], *, verify: bool, threads: int,
                  staging_bytes: int = STAGING_BYTES,
                  whole: Iterable[FileReader] = ()) -> Callable[[], None]:
    """Fill the fresh reads now and verify every block the in-place ones need; return the
    function that then fills the in-place reads. Raises ``FormatError`` on a damaged block
    (fresh destinations may then hold partial data; in-place ones are untouched).

    With ``verify`` False nothing is hash-checked (sizes and headers still are).
    """
    fresh = [r for r in reads if not r.in_place]
    in_place = [r for r in reads if r.in_place]
    if verify:
        checked = _one_pass(fresh, staging_bytes, threads)
        fresh = [r for r in fresh if r.file.name not in checked]
        wanted: dict[str, tuple[FileReader, set[int]]] = {}
        for r in reads:
            # Blocks the one-pass read already checked are taken off below, so an in-place
            # read of a file that also had one is still verified.
            blocks = _touched(r.file, [(r.file_start, r.segment().file_end)])
            wanted.setdefault(r.file.name, (r.file, set()))[1].update(blocks)
        for f in whole:
            wanted[f.name] = (f, set(range(len(f.record.hashes))))
        verify_blocks([(_blocks(f), sorted(blocks - checked.get(name, set())))
                       for name, (f, blocks) in wanted.items()], threads)
    _read(fresh, staging_bytes, threads)
    return lambda: _read(in_place, staging_bytes, threads)


def _one_pass(fresh: list[Read], staging_bytes: int, threads: int) -> dict[str, set[int]]:
    """Read the fresh reads of every file whose blocks allow it in one verifying pass;
    return, per file so read, the blocks checked."""
    by_file: dict[str, list[Read]] = {}
    for r in fresh:
        by_file.setdefault(r.file.name, []).append(r)
    items, names = [], []
    for name, rs in by_file.items():
        f, segments = _blocks(rs[0].file), [r.segment() for r in rs]
        if one_pass_ok(segments, f.block_bytes, max(8, staging_bytes // 2)):
            items.append((f, segments))
            names.append(name)
    if not items:
        return {}
    # One block per thread is staged: at most ``staging_bytes`` in all.
    block = max(f.block_bytes for f, _ in items)
    done = read_blocks(items, max(1, min(threads, staging_bytes // block)))
    return dict(zip(names, done))


__all__ = ["DataFiles", "Read", "read_verified"]
