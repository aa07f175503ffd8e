"""Streaming file I/O for checkpoint data: bounded host staging, block hashes.

Writes stream each tensor into its file piece by piece (device tensors go
through a pair of pinned host buffers so the copy of piece ``i+1`` overlaps the
write of piece ``i``); nothing is serialised whole in memory. Reads go
straight into the destination tensor when it is on the host and of the stored
dtype, otherwise through the same bounded staging.

Files are opened for reading only if they are regular files reached without
following a symlink, and a header is trusted only after its length is bounded
(before anything is allocated) and its chunks match the manifest's.
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .blocks import Segment, host_bytes, one_pass_ok, preadv_exact, read_blocks, verify_blocks
from .format import BlockHasher, FileHeader, FormatError, StoredChunk, build_header, parse_header
from .planner import ReadRequest


@dataclass(frozen=True)
class WriteEntry:
    """A 1-D chunk to store: ``source`` (any device) or zeros when ``source`` is None."""

    key: str
    dtype: torch.dtype
    numel: int
    offset: int
    source: torch.Tensor | None


class _Staging:
    """Two pinned (when CUDA) host buffers used alternately for device <-> host copies."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        half = max(1 << 16, nbytes // 2)
        self.buffers = [torch.empty(half, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.nbytes = half


# Write and hash in pieces: a worker thread hashes piece k while this thread writes it
# (both release the GIL), so the piece is read from memory once for both.
_PIECE_BYTES = 4 << 20


class _HashingWriter:
    """Writes bytes to ``fd`` while a worker thread feeds them to a :class:`BlockHasher`."""

    def __init__(self, fd: int, hasher: BlockHasher, pool: ThreadPoolExecutor) -> None:
        self.fd, self.hasher, self.pool = fd, hasher, pool

    def write(self, data: memoryview) -> None:
        for start in range(0, len(data), _PIECE_BYTES):
            piece = data[start:start + _PIECE_BYTES]
            hashed = self.pool.submit(self.hasher.update, piece)
            try:
                while len(piece):
                    piece = piece[os.write(self.fd, piece):]
            finally:
                hashed.result()  # the buffer may be reused once this returns


def write_file(path: str, entries: Sequence[WriteEntry], block_bytes: int,
               staging_bytes: int, staging: _Staging | None = None) -> dict:
    """Write ``entries`` as one safetensors file at ``path`` and fsync it.

    Device tensors go through ``staging`` (pass one to share it between the files
    of a save; by default one of ``staging_bytes`` is made when needed).
    Returns ``{"size", "block_bytes", "hashes"}`` for the manifest.
    """
    header, _ = build_header([(e.key, e.dtype, e.numel, e.offset) for e in entries])
    hasher = BlockHasher(block_bytes)
    if staging is None and any(e.source is not None and e.source.is_cuda for e in entries):
        staging = _Staging(staging_bytes, pin=True)
    zero_bytes = max(1 << 16, staging_bytes // 2)
    zeros = torch.zeros(zero_bytes if any(e.source is None for e in entries) else 0,
                        dtype=torch.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hash") as pool:
            _write_entries(_HashingWriter(fd, hasher, pool), header, entries, staging, zeros)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": hasher.total, "block_bytes": block_bytes, "hashes": hasher.finish()}


def _write_entries(out: _HashingWriter, header: bytes, entries: Sequence[WriteEntry],
                   staging: _Staging | None, zeros: torch.Tensor) -> None:
    out.write(memoryview(header))
    for e in entries:
        if e.source is None:
            left = e.numel * e.dtype.itemsize
            while left:
                take = min(left, zeros.numel())
                out.write(host_bytes(zeros[:take]))
                left -= take
        elif not e.source.is_cuda:
            out.write(host_bytes(e.source.detach().to(e.dtype).contiguous()))
        else:
            assert staging is not None
            _write_device(out, e.source.detach().to(e.dtype), staging)


def _write_device(out: _HashingWriter, src: torch.Tensor, staging: _Staging) -> None:
    """Device -> pinned host -> file, copying piece i+1 while writing piece i."""
    flat = src.contiguous().view(torch.uint8)
    step = staging.nbytes
    pieces = [(i, min(step, flat.numel() - i)) for i in range(0, flat.numel(), step)]
    stream = torch.cuda.current_stream(src.device)

    def launch(k: int) -> None:
        start, n = pieces[k]
        buf = staging.buffers[k % 2]
        buf[:n].copy_(flat[start:start + n], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(stream)
        staging.events[k % 2] = ev

    if pieces:
        launch(0)
    for k, (_, n) in enumerate(pieces):
        staging.events[k % 2].synchronize()
        if k + 1 < len(pieces):
            launch(k + 1)
        out.write(host_bytes(staging.buffers[k % 2][:n]))


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


def _header_bound(record: dict) -> int:
    """Generous bound on the header of a file holding the manifest's chunks (keys appear
    twice, the second time JSON-escaped twice; one character can take 26 bytes)."""
    chunks = record.get("chunks", [["torch_cpu", 0, 0], ["torch_cuda", 0, 0]])
    return 4096 + sum(256 + 32 * len(key) for key, _, _ in chunks)


class FileReader:
    """One checkpoint data file, opened for reading and checked against its manifest entry."""

    def __init__(self, path: str, name: str, record: dict) -> None:
        self.path = path
        self.name = name
        self.record = record
        self.fd = open_regular(Path(path))
        self.header_bytes = 0
        size = os.fstat(self.fd).st_size
        if size != record["size"]:
            os.close(self.fd)
            raise FormatError(f"{path}: size is {size} bytes, the manifest says {record['size']}")
        self.size = size

    def close(self) -> None:
        os.close(self.fd)

    def header(self) -> FileHeader:
        raw_len = os.pread(self.fd, 8, 0)
        header = parse_header(raw_len, lambda n: os.pread(self.fd, n, 8), self.path, self.size,
                              _header_bound(self.record))
        self.header_bytes = header.header_bytes
        return header

    def chunks(self, dtypes: dict[str, torch.dtype]) -> list[StoredChunk]:
        """The file's chunks, after checking its header against the manifest.

        ``dtypes`` maps every key the manifest describes to its stored dtype.
        """
        header = self.header()
        found = sorted((c.key, c.offset, c.numel) for c in header.chunks)
        if found != sorted((k, o, n) for k, o, n in self.record["chunks"]):
            raise FormatError(f"{self.path}: header disagrees with the manifest's chunk list")
        for c in header.chunks:
            if c.key not in dtypes:
                raise FormatError(f"{self.path}: stores {c.key!r}, which the manifest does "
                                  "not describe")
            if c.dtype != dtypes[c.key]:
                raise FormatError(f"{self.path}: {c.key!r} is stored as {c.dtype}, "
                                  f"the manifest says {dtypes[c.key]}")
        return [StoredChunk(c.key, self.name, c.offset, c.numel, c.dtype, c.data_start)
                for c in header.chunks]

    def read_tensor(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """One whole small 1-D tensor by key (the RNG files)."""
        found = [c for c in self.header().chunks if c.key == key]
        if len(found) != 1 or found[0].dtype != dtype:
            raise FormatError(f"{self.path}: no {dtype} tensor {key!r}")
        out = torch.empty(found[0].numel, dtype=dtype)
        self._pread_exact(host_bytes(out), found[0].data_start)
        return out

    def _check_hash_count(self) -> list[str]:
        bb, hashes = self.record["block_bytes"], self.record["hashes"]
        if len(hashes) != -(-self.size // bb):
            raise FormatError(f"{self.path}: manifest lists {len(hashes)} block hashes, "
                              f"the file has {-(-self.size // bb)} blocks")
        return hashes

    def blocks_of(self, spans: Iterable[tuple[int, int]]) -> set[int]:
        """Blocks that byte spans ``[start, end)`` touch, and those of the header."""
        bb = self.record["block_bytes"]
        wanted: set[int] = set()
        for start, end in [(0, self.header_bytes), *spans]:
            if end > start:
                wanted.update(range(start // bb, (end - 1) // bb + 1))
        return wanted

    def verify(self, spans: Iterable[tuple[int, int]] | None = None,
               skip: set[int] | frozenset[int] = frozenset()) -> None:
        """Check the hashes of every block that byte spans ``[start, end)`` touch (all if
        None), except blocks in ``skip`` (already checked)."""
        hashes = self._check_hash_count()
        blocks = range(len(hashes)) if spans is None else self.blocks_of(spans)
        verify_blocks(self.fd, self.path, hashes, sorted(set(blocks) - skip),
                      self.record["block_bytes"], self.size)

    def read_fresh(self, segments: list[Segment], cuda: bool, max_block_bytes: int
                   ) -> set[int] | None:
        """Fill new tensors in one pass: every block the segments touch is read once, its
        hash checked, its bytes placed. Returns the checked blocks, or None (nothing read)
        when the blocks are too large or oddly sized for it (use verify + read_into)."""
        hashes = self._check_hash_count()
        bb = self.record["block_bytes"]
        if not one_pass_ok(segments, bb, max_block_bytes):
            return None
        return read_blocks(self.fd, self.path, hashes, segments, bb, self.size, cuda)

    def read_into(self, req: ReadRequest, dest: torch.Tensor, dtype: torch.dtype,
                  staging: _Staging | None) -> None:
        """Fill ``dest[req.dest_start : +req.numel]`` (1-D) from the stored ``dtype`` bytes."""
        out = dest.narrow(0, req.dest_start, req.numel)
        if not out.is_cuda and out.dtype == dtype and out.is_contiguous():
            self._pread_exact(host_bytes(out), req.file_start)
            return
        if staging is None:
            raise AssertionError("staging buffer required for device or casting reads")
        per = max(1, staging.nbytes // dtype.itemsize)
        done = 0
        k = 0
        while done < req.numel:
            n = min(per, req.numel - done)
            slot = k % 2
            if staging.events[slot] is not None:
                staging.events[slot].synchronize()
            buf = staging.buffers[slot][: n * dtype.itemsize]
            self._pread_exact(host_bytes(buf), req.file_start + done * dtype.itemsize)
            out.narrow(0, done, n).copy_(buf.view(dtype), non_blocking=out.is_cuda)
            if out.is_cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(out.device))
                staging.events[slot] = ev
            done += n
            k += 1

    def _pread_exact(self, view: memoryview, offset: int) -> None:
        preadv_exact(self.fd, [view], offset, self.path)


def make_staging(nbytes: int, cuda: bool) -> _Staging:
    return _Staging(nbytes, pin=cuda)


def sync_staging(staging: _Staging | None) -> None:
    if staging is None:
        return
    for ev in staging.events:
        if ev is not None:
            ev.synchronize()
