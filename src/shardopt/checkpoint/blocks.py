"""Hash-verified block reads: check stored blocks, or read, check and place them in one pass.

A data file is hashed in fixed-size blocks (xxh3-64 of each; :func:`~.transfer.write_blocks`).
Two ways to read it with verification:

* :func:`verify_blocks` reads blocks only to hash them (the bytes are then read
  again into their destinations, after every rank has verified everything):
  what tensors that already exist need, since nothing may be written into them
  before every check has passed.
* :func:`read_blocks` reads every block that :class:`Segment` s touch exactly
  once, scattering it with ``preadv`` straight into the destinations (host,
  stored dtype) or into a scratch buffer (gaps between segments, device or
  casting destinations), hashes what it read and then copies the staged parts
  on. It is only for tensors nothing else can see yet: on a mismatch they hold
  partial data and the caller discards them.

Both read and hash ``READ_THREADS`` blocks at a time, on as many threads
(``preadv`` and ``xxhash`` release the GIL), which a single reader on fast
storage (tmpfs, NVMe) cannot saturate. Host memory is bounded: one scratch
buffer of one piece or block per thread.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import xxhash

from .format import FormatError
from .transfer import IO_THREADS, Scratch, Segment, host_bytes, preadv_exact, run_parallel

# verify_blocks reads in pieces of at most this size; read_blocks handles blocks up
# to twice the staging (``max_block_bytes``) and leaves larger ones to two passes.
PIECE_BYTES = 4 << 20
# Blocks read (and hashed) at once; xxhash and preadv release the GIL. Host memory is one
# piece (verify) or one block (one-pass reads) per thread.
READ_THREADS = IO_THREADS


def _mismatch(path: str, start: int, end: int) -> FormatError:
    return FormatError(f"{path}: content hash mismatch in bytes [{start}, {end}) "
                       "(the file is damaged)")


def block_ranges(blocks: Iterable[int], block_bytes: int, size: int) -> list[tuple[int, int, int]]:
    return [(b, b * block_bytes, min((b + 1) * block_bytes, size)) for b in blocks]


def verify_blocks(fd: int, path: str, hashes: list[str], blocks: Iterable[int],
                  block_bytes: int, size: int) -> None:
    """Hash-check ``blocks`` of the file, reading each once (``READ_THREADS`` at a time)."""
    jobs = block_ranges(blocks, block_bytes, size)
    if not jobs:
        return
    piece = min(PIECE_BYTES, block_bytes, size)
    bufs = [memoryview(bytearray(piece)) for _ in range(min(READ_THREADS, len(jobs)))]

    def work(job, slot):
        b, start, end = job
        buf, h = bufs[slot], xxhash.xxh3_64()
        for pos in range(start, end, piece):
            n = min(piece, end - pos)
            preadv_exact(fd, [buf[:n]], pos, path)
            h.update(buf[:n])
        if h.hexdigest() != hashes[b]:
            raise _mismatch(path, start, end)

    run_parallel(jobs, work, len(bufs))


def one_pass_ok(segments: list[Segment], block_bytes: int, max_block_bytes: int) -> bool:
    """Whether :func:`read_blocks` can take these segments: bounded blocks whose edges
    fall between elements (data is 8-byte aligned) and segments that do not overlap."""
    if block_bytes % 8 or block_bytes > max_block_bytes:
        return False
    spans = sorted((s.file_start, s.file_end) for s in segments)
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def read_blocks(fd: int, path: str, hashes: list[str], segments: list[Segment],
                block_bytes: int, size: int) -> set[int]:
    """Read, hash-check and place every block ``segments`` touch; return those blocks.

    Check :func:`one_pass_ok` first. On a mismatch ``FormatError`` is raised and
    the segments' tensors hold partial data.
    """
    segments = sorted((s for s in segments if s.out.numel()), key=lambda s: s.file_start)
    by_block: dict[int, list[Segment]] = {}
    for s in segments:
        for b in range(s.file_start // block_bytes, (s.file_end - 1) // block_bytes + 1):
            by_block.setdefault(b, []).append(s)
    jobs = block_ranges(sorted(by_block), block_bytes, size)
    if not jobs:
        return set()
    device = next((s.out.device for s in segments if s.out.is_cuda), None)
    scratch = Scratch(min(READ_THREADS, len(jobs)), block_bytes, device)

    def layout(b: int, start: int, end: int, raw: torch.Tensor):
        """The iovecs that cover [start, end) and the staged copies to make afterwards."""
        views, copies, pos = [], [], start
        for s in by_block[b]:
            lo, hi = max(s.file_start, start), min(s.file_end, end)
            if lo > pos:
                views.append(host_bytes(raw[pos - start:lo - start]))
            if s.direct:
                views.append(host_bytes(s.out)[lo - s.file_start:hi - s.file_start])
            else:
                views.append(host_bytes(raw[lo - start:hi - start]))
                first = (lo - s.file_start) // s.dtype.itemsize
                copies.append((s.out.narrow(0, first, (hi - lo) // s.dtype.itemsize),
                               raw[lo - start:hi - start].view(s.dtype)))
            pos = hi
        if end > pos:
            views.append(host_bytes(raw[pos - start:end - start]))
        return views, copies

    def work(job, slot):
        b, start, end = job
        views, copies = layout(b, start, end, scratch.take(slot))
        preadv_exact(fd, list(views), start, path)
        h = xxhash.xxh3_64()
        for v in views:
            h.update(v)
        if h.hexdigest() != hashes[b]:
            raise _mismatch(path, start, end)
        if copies:
            scratch.copy(slot, copies)

    try:
        run_parallel(jobs, work, scratch.threads)
    finally:
        scratch.drain()
    return set(by_block)
