"""Checkpoint data files on the torch side: what a file holds, writing it, opening it to read.

:func:`write_parts` writes through the one block writer (:mod:`.transfer`), device bytes
through a small page-locked :class:`Scratch`. A file is read only if it is a regular file
reached without a symlink, its header once its length is bounded and its chunks match the
manifest's.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .format import FileHeader, FileRecord, StoredChunk, StoredTensor, build_header, parse_header
from .transfer import PIECE_BYTES, Part, Parts, cut_views, write_file as write_pieces
from ..errors import FormatError


@dataclass(frozen=True)
class WriteEntry:
    """A 1-D chunk to store: ``source`` (any device) or zeros when ``source`` is None."""

    key: str
    dtype: torch.dtype
    numel: int
    offset: int
    source: torch.Tensor | None


@dataclass(frozen=True)
class Job:
    """A data file of a rank and the entries it holds."""

    name: str
    entries: list[WriteEntry]


# A save splits a kind's bytes over files written side by side only into files of this size.
MIN_PART_BYTES = 64 << 20
# The smallest per-thread staging buffer: below it a copy's fixed cost dominates.
MIN_SCRATCH_BYTES = 64 << 10
# Bound on a safetensors header: a fixed part, and per chunk its JSON record plus its key,
# which appears twice, the second time JSON-escaped twice (one character can take 26 bytes).
HEADER_FIXED_BYTES = 4096
HEADER_CHUNK_BYTES = 256
HEADER_KEY_CHAR_BYTES = 32


def entry_bytes(entries: Sequence[WriteEntry]) -> int:
    return sum(e.numel * e.dtype.itemsize for e in entries)


def part_counts(sizes: dict[str, int], files: int, min_part: int | None = None
                ) -> dict[str, int]:
    """Into how many files to split each kind's ``sizes`` bytes: the largest file as small
    as ``files`` files in all allow (a save takes as long as its largest file), no more
    files than that needs, none under ``min_part`` (default :data:`MIN_PART_BYTES`) bytes
    once split, one at least per kind."""
    least = max(1, MIN_PART_BYTES if min_part is None else min_part)

    def counts(largest: int) -> dict[str, int]:
        return {k: max(1, min(-(-s // largest), s // least)) for k, s in sizes.items()}

    for largest in sorted({-(-s // n) for s in sizes.values() if s
                           for n in range(1, files + 1)}):
        c = counts(largest)
        if sum(c.values()) <= files:
            return c
    return dict.fromkeys(sizes, 1)


def split_entries(entries: Sequence[WriteEntry], parts: int) -> list[list[WriteEntry]]:
    """``entries`` in ``parts`` runs of about equal bytes, in order; a chunk that straddles
    a boundary is cut between two elements into two chunks. Runs are never empty."""
    total = entry_bytes(entries)
    out: list[list[WriteEntry]] = [[] for _ in range(parts)]
    i, filled = 0, 0
    for e in entries:
        size, first = e.dtype.itemsize, 0
        if e.numel == 0:
            out[i].append(e)
        while first < e.numel:
            room = e.numel - first
            if i < parts - 1:
                room = min(room, ((i + 1) * total // parts - filled) // size)
                if room <= 0:
                    i += 1
                    continue
            src = None if e.source is None else e.source.narrow(0, first, room)
            out[i].append(WriteEntry(e.key, e.dtype, room, e.offset + first, src))
            first += room
            filled += room * size
    return [run for run in out if run]


def host_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class Scratch:
    """One host buffer of ``nbytes`` per thread, pinned when ``device`` is a GPU, and the
    event of the last device copy into or out of each (on the stream current when the
    scratch is made; blocking events: a waiting thread sleeps, it does not spin)."""

    def __init__(self, threads: int, nbytes: int, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self.nbytes = nbytes
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
                        for _ in range(threads)]
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self._events: list[torch.cuda.Event | None] = [None] * threads

    def take(self, slot: int) -> torch.Tensor:
        """The thread's buffer, once no device copy uses it any more."""
        self.wait(slot)
        return self.buffers[slot]

    def copy(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``dst.copy_(src)`` for each pair; device copies are queued, not waited for."""
        if not self.cuda or not any(d.is_cuda or s.is_cuda for d, s in pairs):
            for dst, src in pairs:
                dst.copy_(src)
            return
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event(blocking=True)
            ev.record(self.stream)
        self._events[slot] = ev

    def wait(self, slot: int) -> None:
        ev = self._events[slot]
        if ev is not None:
            ev.synchronize()
            self._events[slot] = None

    def drain(self) -> None:
        for slot in range(len(self.buffers)):
            self.wait(slot)


def scratch_for(staging_bytes: int, device: torch.device, threads: int = 1) -> Scratch:
    """``threads`` buffers sharing ``staging_bytes`` (each at least
    :data:`MIN_SCRATCH_BYTES`) for moving bytes to or from ``device``."""
    return Scratch(threads, max(MIN_SCRATCH_BYTES, staging_bytes // threads), device)


def write_scratch(block_bytes: int, staging_bytes: int, device: torch.device) -> Scratch | None:
    """The pinned buffer a file's writes from ``device`` stage through (None on the host)."""
    return scratch_for(min(block_bytes, staging_bytes), device) if device.type == "cuda" else None


def file_parts(entries: Sequence[WriteEntry]) -> list[Part]:
    """The parts of the safetensors file of ``entries``: its header, then each entry's bytes
    (1-D uint8 views of its source in the stored dtype; None for zeros)."""
    header, starts = build_header(entries)
    parts = [Part(0, len(header), torch.frombuffer(bytearray(header), dtype=torch.uint8))]
    for e, start in zip(entries, starts):
        data = None
        if e.source is not None:
            data = e.source.detach().to(e.dtype).contiguous().view(-1)
            if data.numel() != e.numel:
                raise AssertionError(f"{e.key}: {data.numel()} elements, expected {e.numel}")
            data = data.view(torch.uint8)
        parts.append(Part(start, e.numel * e.dtype.itemsize, data))
    return parts


def write_parts(path: str, parts: Sequence[Part], block_bytes: int,
                scratch: Scratch | None) -> dict:
    """Write a new file of ``parts`` (host or device tensors, zeros; contiguous from byte 0)
    at ``path`` and fsync it; return its record. Device bytes go through ``scratch``."""
    layout = Parts([p if p.data is None or p.data.is_cuda else
                    Part(p.start, p.nbytes, host_bytes(p.data)) for p in parts])
    piece = min(block_bytes, scratch.nbytes if scratch is not None else PIECE_BYTES)
    if any(isinstance(p.data, torch.Tensor) for p in layout.parts) and (
            scratch is None or not scratch.cuda):
        raise AssertionError("device parts need a pinned scratch")

    def take(lo: int, hi: int) -> list[memoryview]:
        views, copies = [], []
        for cut in layout.cuts(lo, hi):
            if isinstance(cut.part.data, torch.Tensor):  # on the device
                dst = scratch.take(0)[cut.start - lo:cut.end - lo]
                copies.append((dst, cut.part.data[cut.within]))
                views.append(host_bytes(dst))
            else:
                views += cut_views(cut)
        if copies:
            scratch.copy(0, copies)
            scratch.wait(0)
        return views

    return write_pieces(path, layout.size, block_bytes, piece, take)


def write_file(path: str, entries: Sequence[WriteEntry], block_bytes: int,
               scratch: Scratch | None) -> dict:
    """Write ``entries`` as one safetensors data file at ``path`` (:func:`write_parts`)."""
    return write_parts(path, file_parts(entries), block_bytes, scratch)


def open_regular(path: Path) -> int:
    """Open ``path`` read-only: no symlinks, no FIFOs or devices. Returns the fd."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FormatError(f"missing file {path}") from None
    except OSError as e:
        if os.path.islink(path):
            raise FormatError(f"refusing {path}: it is a symlink") from None
        raise FormatError(f"cannot open {path}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FormatError(f"refusing {path}: not a regular file")
    return fd


def _header_bound(record: FileRecord) -> int:
    """Generous bound on the header of a file holding the manifest's chunks."""
    keys = ["torch_cpu", "torch_cuda"] if record.kind == "rng" else [c.key for c in record.chunks]
    return HEADER_FIXED_BYTES + sum(HEADER_CHUNK_BYTES + HEADER_KEY_CHAR_BYTES * len(key)
                                    for key in keys)


class FileReader:
    """One checkpoint data file, open and checked against its manifest record (:mod:`.read`
    moves and verifies its bytes)."""

    def __init__(self, directory: Path, record: FileRecord) -> None:
        self.path = str(directory / record.name)
        self.record = record
        self.fd = open_regular(Path(self.path))
        self.header_bytes = 0
        size = os.fstat(self.fd).st_size
        if size != record.size:
            os.close(self.fd)
            raise FormatError(f"{self.path}: size is {size} bytes, the manifest says "
                              f"{record.size}")

    @property
    def name(self) -> str:
        return self.record.name

    def close(self) -> None:
        os.close(self.fd)

    def header(self) -> FileHeader:
        raw_len = os.pread(self.fd, 8, 0)
        header = parse_header(raw_len, lambda n: os.pread(self.fd, n, 8), self.path,
                              self.record.size, _header_bound(self.record))
        self.header_bytes = header.header_bytes
        return header

    def chunks(self, stored: dict[str, StoredTensor]) -> list[StoredChunk]:
        """The file's chunks, after checking its header against the manifest: the same
        chunks as its record lists (RNG files: any), each of the dtype ``stored`` gives."""
        header = self.header()
        if self.record.kind == "rng":
            return list(header.chunks)
        found = sorted(c.record for c in header.chunks)
        if found != sorted(self.record.chunks):
            raise FormatError(f"{self.path}: header disagrees with the manifest's chunk list")
        for c in header.chunks:
            if c.dtype != stored[c.key].dtype:
                raise FormatError(f"{self.path}: {c.key!r} is stored as {c.dtype}, "
                                  f"the manifest says {stored[c.key].dtype}")
        return [StoredChunk(c.key, self.name, c.offset, c.numel, c.dtype, c.data_start)
                for c in header.chunks]
