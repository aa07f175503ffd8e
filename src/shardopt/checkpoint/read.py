"""The one read engine of checkpoints: ``load``, ``verify`` and ``export`` all read through it.

:class:`DataFiles` opens a checkpoint's data files and says which stored bytes fill a
destination (:class:`Read`); :func:`read_verified` reads and hash-checks them. Every read is
a list of :class:`_Job`\\ s (a byte span, the destinations in it, the digest it must have)
that :func:`_run` runs on several threads; docs/format.md says what is verified when.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import xxhash

from ..layout import Range
from .config import STAGING_BYTES
from .index import ChunkIndex
from .manifest import Manifest
from .storage import FileReader, Scratch, host_bytes, scratch_for
from .transfer import PIECE_BYTES, run_parallel, vectored
from ..errors import FormatError


@dataclass(frozen=True)
class Read:
    """Stored bytes of ``file`` at ``file_start`` (``out.numel()`` elements of ``dtype``)
    fill ``out`` (1-D); ``in_place``: ``out`` existed before the read began."""

    file: FileReader
    file_start: int
    out: torch.Tensor
    dtype: torch.dtype
    in_place: bool = False

    @property
    def file_end(self) -> int:
        return self.file_start + self.out.numel() * self.dtype.itemsize

    @property
    def direct(self) -> bool:
        """Whether the bytes can be read straight into ``out``."""
        o = self.out
        return not o.is_cuda and o.dtype == self.dtype and o.is_contiguous()

    def blocks(self) -> Range:
        """The blocks of its file the read touches."""
        return Range(self.file_start, self.file_end).blocks(self.file.record.block_bytes)


@dataclass(frozen=True)
class _Job:
    """Bytes ``[start, end)`` of ``file`` into the parts of ``reads`` they hold (the rest to
    scratch); ``digest``: the xxh3-64 the bytes must have (a whole block), or None."""

    file: FileReader
    start: int
    end: int
    reads: tuple[Read, ...]
    digest: str | None


def preadv_exact(fd: int, views: list[memoryview], offset: int, path: str) -> None:
    """Fill ``views`` (in order) from consecutive bytes of ``fd`` at ``offset``."""
    vectored(os.preadv, fd, views, offset, FormatError(f"{path}: unexpected end of file"))


def _layout(job: _Job, raw: torch.Tensor | None, lo: int, hi: int):
    """The views that cover ``[lo, hi)`` of ``job`` and the staged copies to make after."""
    views, copies, pos = [], [], lo
    for r in job.reads:
        a, b = max(r.file_start, lo), min(r.file_end, hi)
        if a > pos:
            views.append(host_bytes(raw[pos - lo:a - lo]))
        if r.direct:
            views.append(host_bytes(r.out)[a - r.file_start:b - r.file_start])
        else:
            first = (a - r.file_start) // r.dtype.itemsize
            copies.append((r.out.narrow(0, first, (b - a) // r.dtype.itemsize),
                           raw[a - lo:b - lo], r.dtype))
            views.append(host_bytes(raw[a - lo:b - lo]))
        pos = b
    if hi > pos:
        views.append(host_bytes(raw[pos - lo:hi - lo]))
    return views, copies


def _typed(staged: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Staged bytes as ``dtype``. After an odd-sized int8 chunk a wider one starts off its
    alignment in the file, and so in the scratch buffer: such bytes are realigned first."""
    if staged.storage_offset() % dtype.itemsize:
        staged = staged.clone()
    return staged.view(dtype)


def _run(jobs: list[_Job], threads: int, scratch: Scratch | None) -> None:
    """Every job on ``threads`` threads: ``preadv`` into host destinations of the stored
    dtype, the rest (gaps, device or casting destinations) into the thread's scratch, then
    copied on. A job without reads goes in pieces of the scratch. ``FormatError`` when a
    digest differs; returns once every device copy is done."""
    def work(job: _Job, slot: int) -> None:
        raw = scratch.take(slot) if scratch is not None else None
        step = scratch.nbytes if scratch is not None and not job.reads else job.end - job.start
        h, copies = xxhash.xxh3_64(), []
        for lo in range(job.start, job.end, step):
            views, copies = _layout(job, raw, lo, min(lo + step, job.end))
            preadv_exact(job.file.fd, views, lo, job.file.path)
            if job.digest is not None:
                for v in views:
                    h.update(v)
        if job.digest is not None and h.hexdigest() != job.digest:
            raise FormatError(f"{job.file.path}: content hash mismatch in bytes [{job.start}, "
                              f"{job.end}) (the file is damaged)")
        if copies:
            scratch.copy(slot, [(out, _typed(staged, dtype)) for out, staged, dtype in copies])

    run_parallel(jobs, work, threads, scratch.drain if scratch is not None else None)


def _block_job(f: FileReader, b: int, reads: tuple[Read, ...] = ()) -> _Job:
    bb = f.record.block_bytes
    return _Job(f, b * bb, min((b + 1) * bb, f.record.size), reads, f.record.hashes[b])


def verify_blocks(items: Iterable[tuple[FileReader, Iterable[int]]], threads: int) -> None:
    """Hash-check the given blocks of each file, reading each once, ``threads`` at a time."""
    jobs = [_block_job(f, b) for f, blocks in items for b in blocks]
    if jobs:
        # Half a piece: hashed right after it is read, it is still in the CPU cache.
        piece = min(PIECE_BYTES // 2, max(j.end - j.start for j in jobs))
        _run(jobs, threads, Scratch(min(threads, len(jobs)), piece))


def one_pass_ok(reads: list[Read], block_bytes: int, max_block_bytes: int) -> bool:
    """Whether :func:`read_blocks` can take these reads of one file: bounded blocks whose
    edges fall between elements (data is 8-byte aligned) and reads that do not overlap."""
    if block_bytes % 8 or block_bytes > max_block_bytes:
        return False
    spans = sorted((r.file_start, r.file_end) for r in reads)
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def read_blocks(reads: list[Read], threads: int) -> dict[str, set[int]]:
    """Read, hash-check and place every block the reads touch, ``threads`` blocks at a
    time; return those blocks by file path. Check :func:`one_pass_ok` first. On a mismatch
    ``FormatError`` is raised and the destinations hold partial data."""
    by_block: dict[tuple[str, int], list[Read]] = {}
    files = {}
    for r in sorted((r for r in reads if r.out.numel()), key=lambda r: r.file_start):
        files[r.file.path] = r.file
        blocks = r.blocks()
        for b in range(blocks.start, blocks.end):
            by_block.setdefault((r.file.path, b), []).append(r)
    touched: dict[str, set[int]] = {r.file.path: set() for r in reads}
    jobs = []
    for (path, b), rs in sorted(by_block.items()):
        touched[path].add(b)
        jobs.append(_block_job(files[path], b, tuple(rs)))
    if jobs:
        device = next((r.out.device for r in reads if r.out.is_cuda), None)
        block = max(f.record.block_bytes for f in files.values())
        _run(jobs, threads, Scratch(min(threads, len(jobs)), block, device))
    return touched


def read_plain(reads: list[Read], staging_bytes: int, threads: int) -> None:
    """Fill every read's ``out`` unchecked, in pieces of at most a scratch buffer
    (``staging_bytes`` over the threads)."""
    device = next((r.out.device for r in reads if r.out.is_cuda), torch.device("cpu"))
    scratch = None
    if device.type == "cuda" or not all(r.direct for r in reads):
        scratch = scratch_for(staging_bytes, device, threads)
    piece = scratch.nbytes if scratch is not None else PIECE_BYTES
    jobs = []
    for r in reads:
        per = max(1, piece // r.dtype.itemsize)
        for first in range(0, r.out.numel(), per):
            n = min(per, r.out.numel() - first)
            start = r.file_start + first * r.dtype.itemsize
            part = Read(r.file, start, r.out.narrow(0, first, n), r.dtype)
            jobs.append(_Job(r.file, start, part.file_end, (part,), None))
    _run(jobs, threads, scratch)


class DataFiles:
    """Data files ``names`` of checkpoint ``m``, open, headers checked against the manifest."""

    def __init__(self, m: Manifest, names: Iterable[str]) -> None:
        self.readers: dict[str, FileReader] = {}
        self.stored = m.stored()
        chunks = []
        try:
            for name in names:
                reader = self.readers[name] = FileReader(m.path, m.files[name])
                found = reader.chunks(self.stored)
                if reader.record.kind != "rng":
                    chunks.extend(found)
        except BaseException:
            self.close()
            raise
        self.directory = m.path
        self.scale_keys = frozenset(m.scale_keys())
        self.index = ChunkIndex(chunks)

    def reads(self, key: str, want: Range, out: torch.Tensor, in_place: bool) -> list[Read]:
        """What fills ``out`` (1-D) with elements ``want`` of stored tensor ``key``."""
        dtype = self.stored[key].dtype
        return [Read(self.readers[r.file], r.file_start, out.narrow(0, r.dest_start, r.numel),
                     dtype, in_place) for r in self.index.plan(key, want)]

    def check_scales(self, key: str, first: int, scales: torch.Tensor) -> None:
        """Raise :class:`FormatError`, naming the file, unless every scale of ``scales``
        (elements ``first`` on of stored 8-bit moment scales ``key``) is finite and >= 0."""
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
                            torch.uint8)
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


def read_verified(reads: list[Read], *, verify: bool, threads: int,
                  staging_bytes: int = STAGING_BYTES,
                  whole: Iterable[FileReader] = ()) -> Callable[[], None]:
    """Fill the fresh reads now (in one verifying pass where the blocks allow) and verify
    every block the in-place ones need and every block of the files ``whole``; return the
    function that then fills the in-place reads. ``FormatError`` on a damaged block leaves
    in-place destinations untouched. ``verify`` False: no hash is checked."""
    fresh = [r for r in reads if not r.in_place]
    in_place = [r for r in reads if r.in_place]
    if verify:
        by_file: dict[str, list[Read]] = {}
        for r in fresh:
            by_file.setdefault(r.file.name, []).append(r)
        one_pass = [r for rs in by_file.values()
                    if one_pass_ok(rs, rs[0].file.record.block_bytes, max(8, staging_bytes // 2))
                    for r in rs]
        checked: dict[str, set[int]] = {}
        if one_pass:  # one block per thread is staged: at most ``staging_bytes`` in all
            block = max(r.file.record.block_bytes for r in one_pass)
            checked = read_blocks(one_pass, max(1, min(threads, staging_bytes // block)))
        fresh = [r for r in fresh if r.file.path not in checked]
        wanted: dict[str, tuple[FileReader, set[int]]] = {}
        for r in reads:  # each read's blocks and those of its file's header
            header = Range(0, r.file.header_bytes).blocks(r.file.record.block_bytes)
            wanted.setdefault(r.file.name, (r.file, set()))[1].update(
                range(header.start, header.end), range(r.blocks().start, r.blocks().end))
        for f in whole:
            wanted[f.name] = (f, set(range(len(f.record.hashes))))
        verify_blocks([(f, sorted(blocks - checked.get(f.path, set())))
                       for f, blocks in wanted.values()], threads)
    if fresh:
        read_plain(fresh, staging_bytes, threads)
    return lambda: read_plain(in_place, staging_bytes, threads) if in_place else None
