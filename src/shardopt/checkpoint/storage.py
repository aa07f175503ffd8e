"""Checkpoint data files: writing them with block hashes, opening and checking them for reads.

Writes place each tensor's bytes at its offset in the file, several hash blocks
at a time (:func:`~.transfer.write_blocks`); device tensors go through small
pinned per-thread buffers, so nothing is serialised whole in memory. Reads are
:mod:`.read`'s.

Files are opened for reading only if they are regular files reached without
following a symlink, and a header is trusted only after its length is bounded
(before anything is allocated) and its chunks match the manifest's.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .format import (FileHeader, FileRecord, FormatError, StoredChunk, StoredTensor, build_header,
                     parse_header)
from .transfer import Part, Scratch, write_blocks


@dataclass(frozen=True)
class WriteEntry:
    """A 1-D chunk to store: ``source`` (any device) or zeros when ``source`` is None."""

    key: str
    dtype: torch.dtype
    numel: int
    offset: int
    source: torch.Tensor | None


# A save splits a kind's bytes over several files (to write them side by side) only into
# files of at least this size.
MIN_PART_BYTES = 64 << 20


def entry_bytes(entries: Sequence[WriteEntry]) -> int:
    return sum(e.numel * e.dtype.itemsize for e in entries)


def part_counts(sizes: dict[str, int], files: int, min_part: int | None = None
                ) -> dict[str, int]:
    """Into how many files to split each kind's ``sizes`` bytes: the largest file as small
    as ``files`` files in all allow (a save takes as long as its largest file), with no
    more files than that needs, none under ``min_part`` bytes (default
    :data:`MIN_PART_BYTES`) once split, and one file at least per kind."""
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


# Threads per file of a save: one thread copies, hashes and writes each block in turn. The
# kernel serialises writes to one file, so a second thread per file only adds contention
# (measured in benchmarks/probes/checkpoint_tuning.py).
FILE_THREADS = 1
# The smallest per-thread staging buffer: below it a copy's fixed cost dominates.
MIN_SCRATCH_BYTES = 64 << 10
# Bound on a safetensors header: a fixed part, and per chunk its JSON record plus its key,
# which appears twice, the second time JSON-escaped twice (one character can take 26 bytes).
HEADER_FIXED_BYTES = 4096
HEADER_CHUNK_BYTES = 256
HEADER_KEY_CHAR_BYTES = 32


def write_file(path: str, entries: Sequence[WriteEntry], block_bytes: int,
               scratch: Scratch | None, threads: int = FILE_THREADS) -> dict:
    """Write ``entries`` as one safetensors file at ``path`` and fsync it.

    Blocks are written and hashed ``threads`` at a time; device tensors go
    through ``scratch`` (pinned, one buffer per thread).
    Returns ``{"size", "block_bytes", "hashes"}`` for the manifest.
    """
    parts = file_parts(entries)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        hashes = write_blocks(fd, path, parts, block_bytes, scratch, threads)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": parts[-1].end, "block_bytes": block_bytes, "hashes": hashes}


def file_parts(entries: Sequence[WriteEntry]) -> list[Part]:
    """The parts of the safetensors file holding ``entries``: its header, then each entry's
    bytes (1-D uint8 views of its source in the stored dtype; None for zeros)."""
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


def write_scratch(block_bytes: int, staging_bytes: int, device: torch.device,
                  threads: int = FILE_THREADS) -> Scratch | None:
    """The pinned per-thread buffers (``staging_bytes`` in all) that the writes of one file
    from ``device`` stage through (None on the host)."""
    if device.type != "cuda":
        return None
    return Scratch(threads, max(MIN_SCRATCH_BYTES, min(block_bytes, staging_bytes // threads)), device)


def read_scratch(staging_bytes: int, device: torch.device, casts: bool,
                 threads: int) -> Scratch | None:
    """The per-thread buffers (``staging_bytes`` in all) that reads into ``device`` tensors
    (or casting reads) on ``threads`` threads need."""
    if device.type != "cuda" and not casts:
        return None
    return Scratch(threads, max(MIN_SCRATCH_BYTES, staging_bytes // threads), device)


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
    """One checkpoint data file, opened for reading and checked against its manifest record;
    :mod:`.read` moves and verifies its bytes."""

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
