"""Threaded data movement between one rank's checkpoint files and its tensors.

Reads and writes are cut into pieces that several threads move at once
(:func:`io_threads`): ``preadv``/``pwritev`` and xxhash release the GIL, and one
thread cannot keep tmpfs or NVMe busy. Each thread owns one host scratch buffer (pinned when
device tensors are involved); a device piece is copied between it and the
device on the stream that was current when the :class:`Scratch` was made, so the
copies are ordered after the work that produced the tensors, and the thread waits
for that copy before it uses or reuses the buffer. Host memory is bounded: one
piece per thread.

* :func:`write_blocks` writes a file's parts (header bytes, host or device
  tensors, zeros) at their offsets, one hash block per job, and returns the
  blocks' xxh3-64 digests: the same as hashing the file front to back in blocks.
* :func:`read_segments` fills tensors from stored bytes: straight into host
  tensors of the stored dtype, through the scratch otherwise. It checks nothing;
  callers verify blocks first (see :mod:`.blocks`).
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import xxhash

from ..layout import Range
from ._writer_main import vectored
from .format import FormatError

# Most threads a rank moves checkpoint data on by default (io_threads()).
MAX_IO_THREADS = 16
# Largest piece one thread moves at a time (and the size of its scratch buffer).
PIECE_BYTES = 8 << 20


def io_threads(requested: int | None = None) -> int:
    """Threads a rank reads on, and files it writes at once: ``requested`` (validated by
    :class:`~.config.CheckpointConfig`), or by default the CPUs this process may run on
    shared among the node's ranks (``LOCAL_WORLD_SIZE``, as torchrun sets it), between 2
    and :data:`MAX_IO_THREADS`. On tmpfs the bandwidth grows with every thread up to 16
    (``benchmarks/probes/storage_scaling.py``); a disk saturates with a few, and more cost little."""
    if requested is not None:
        return requested
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(2, min(MAX_IO_THREADS, (cpus or 1) // local))


def host_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def preadv_exact(fd: int, views: list[memoryview], offset: int, path: str) -> None:
    """Fill ``views`` (in order) from consecutive bytes of ``fd`` at ``offset``."""
    vectored(os.preadv, fd, views, offset, FormatError(f"{path}: unexpected end of file"))


def pwritev_exact(fd: int, views: list[memoryview], offset: int, path: str) -> None:
    """Write ``views`` (in order) as consecutive bytes of ``fd`` at ``offset``."""
    vectored(os.pwritev, fd, views, offset, OSError(f"{path}: nothing written"))


def run_parallel(jobs: list, work: Callable, threads: int, scratch: Scratch | None = None) -> None:
    """``work(job, slot)`` for every job, on ``threads`` threads; ``slot`` is the thread's
    index (its own scratch). Jobs are dealt round-robin, so the threads move neighbouring
    pieces at the same time. After a failure the threads stop taking jobs; the error of the
    earliest failed job is raised once every thread has stopped and the device copies of
    ``scratch`` are done."""
    threads = max(1, min(threads, len(jobs)))
    errors: dict[int, BaseException] = {}

    def run(slot: int) -> None:
        for i in range(slot, len(jobs), threads):
            if errors:
                return
            try:
                work(jobs[i], slot)
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller's thread
                errors[i] = e
                return

    try:
        if threads == 1:
            run(0)
        else:
            # Plain threads, not an executor: an asynchronous save still running when the
            # script ends must finish, and executors refuse work once shutdown has begun.
            pool = [threading.Thread(target=run, args=(slot,), name=f"ckpt-io-{slot}")
                    for slot in range(threads)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
    finally:
        if scratch is not None:
            scratch.drain()
    if errors:
        raise errors[min(errors)]


class Scratch:
    """One host buffer of ``nbytes`` per thread, pinned when ``device`` is a GPU, and the
    event of the last device copy that used each. Copies run on the stream current (in
    the calling thread) when the scratch is made. The events are blocking: a thread that
    waits for its copy sleeps instead of spinning on a core (16 spinning writers of a
    background save took the cores the training loop launches its kernels from)."""

    def __init__(self, threads: int, nbytes: int, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self.threads = threads
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
            ev = torch.cuda.Event(blocking=True)  # a waiting thread sleeps, not spins
            ev.record(self.stream)
        self._events[slot] = ev

    def wait(self, slot: int) -> None:
        ev = self._events[slot]
        if ev is not None:
            ev.synchronize()
            self._events[slot] = None

    def drain(self) -> None:
        for slot in range(self.threads):
            self.wait(slot)


@dataclass(frozen=True)
class Part:
    """``nbytes`` of a file from byte ``start``: ``data`` (1-D uint8, host or device) or
    zeros when ``data`` is None."""

    start: int
    nbytes: int
    data: torch.Tensor | None

    @property
    def end(self) -> int:
        return self.start + self.nbytes


def block_ranges(blocks: Iterable[int], block_bytes: int, size: int) -> list[tuple[int, int, int]]:
    """``(block, first byte, end byte)`` of each of ``blocks`` of a ``size``-byte file."""
    return [(b, b * block_bytes, min((b + 1) * block_bytes, size)) for b in blocks]


def overlapping(parts: list[Part], starts: list[int], lo: int, hi: int
                ) -> list[tuple[Part, int, int]]:
    """``(part, first byte, end byte)`` of each of ``parts`` (sorted and contiguous;
    ``starts``: their starts) that holds bytes of ``[lo, hi)``, clipped to it."""
    out = []
    for p in parts[max(0, bisect.bisect_right(starts, lo) - 1):]:
        if p.start >= hi:
            break
        if p.end > lo:
            out.append((p, max(p.start, lo), min(p.end, hi)))
    return out


def write_blocks(fd: int, path: str, parts: list[Part], block_bytes: int,
                 scratch: Scratch | None, threads: int) -> list[str]:
    """Write ``parts`` (sorted, contiguous from byte 0) and return the xxh3-64 digest of
    each ``block_bytes`` block. Each job is one block: its pieces are gathered (device
    parts through the thread's scratch), hashed in order and written with ``pwritev``."""
    parts = [p for p in parts if p.nbytes]
    size = parts[-1].end if parts else 0
    starts = [p.start for p in parts]
    piece = min(block_bytes, scratch.nbytes if scratch is not None else PIECE_BYTES)
    zeros = torch.zeros(piece if any(p.data is None for p in parts) else 0, dtype=torch.uint8)
    if any(p.data is not None and p.data.is_cuda for p in parts) and (
            scratch is None or not scratch.cuda):
        raise AssertionError("device parts need a pinned scratch")
    jobs = block_ranges(range(Range(0, size).blocks(block_bytes).size), block_bytes, size)
    digests = [""] * len(jobs)

    def work(job, slot):
        b, start, end = job
        h = xxhash.xxh3_64()
        for pos in range(start, end, piece):
            stop = min(pos + piece, end)
            views, copies = [], []
            buf = scratch.take(slot) if scratch is not None else None
            for p, lo, hi in overlapping(parts, starts, pos, stop):
                if p.data is None:
                    views.append(host_bytes(zeros[:hi - lo]))
                elif p.data.is_cuda:
                    dst = buf[lo - pos:hi - pos]
                    copies.append((dst, p.data[lo - p.start:hi - p.start]))
                    views.append(host_bytes(dst))
                else:
                    views.append(host_bytes(p.data)[lo - p.start:hi - p.start])
            if copies:
                scratch.copy(slot, copies)
                scratch.wait(slot)
            for v in views:
                h.update(v)
            pwritev_exact(fd, views, pos, path)
        digests[b] = h.hexdigest()

    run_parallel(jobs, work, threads, scratch)
    return digests


@dataclass(frozen=True)
class Segment:
    """Stored bytes at ``file_start`` (``out.numel()`` elements of ``dtype``) fill ``out`` (1-D)."""

    file_start: int
    out: torch.Tensor
    dtype: torch.dtype

    @property
    def file_end(self) -> int:
        return self.file_start + self.out.numel() * self.dtype.itemsize

    @property
    def direct(self) -> bool:
        o = self.out
        return not o.is_cuda and o.dtype == self.dtype and o.is_contiguous()


@dataclass(frozen=True)
class FileSegment:
    """A :class:`Segment` of the file open as ``fd`` (``path`` names it in errors)."""

    fd: int
    path: str
    segment: Segment


def read_segments(items: list[FileSegment], scratch: Scratch | None, threads: int) -> None:
    """Fill every segment's ``out`` from its file, ``threads`` pieces at a time.

    Direct segments are read straight into their tensors; the others (device or
    casting destinations) need ``scratch``. Returns once every device copy is done.
    """
    piece = scratch.nbytes if scratch is not None else PIECE_BYTES
    jobs = []
    for it in items:
        s = it.segment
        size = s.dtype.itemsize
        per = max(1, piece // size)
        for first in range(0, s.out.numel(), per):
            n = min(per, s.out.numel() - first)
            jobs.append((it, s.file_start + first * size, s.out.narrow(0, first, n)))
    if scratch is None and any(not it.segment.direct for it in items):
        raise AssertionError("device or casting reads need a scratch")

    def work(job, slot):
        it, file_start, out = job
        dtype = it.segment.dtype
        if not out.is_cuda and out.dtype == dtype and out.is_contiguous():
            preadv_exact(it.fd, [host_bytes(out)], file_start, it.path)
            return
        buf = scratch.take(slot)[:out.numel() * dtype.itemsize]
        preadv_exact(it.fd, [host_bytes(buf)], file_start, it.path)
        scratch.copy(slot, [(out, buf.view(dtype))])

    run_parallel(jobs, work, threads, scratch)
