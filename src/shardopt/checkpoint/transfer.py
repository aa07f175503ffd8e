"""The one block writer of checkpoint files (:class:`FileWriter`), the threads data moves on,
and the writer process's messages.

Standard library and xxhash only: the writer process (:mod:`._writer_main`) loads this file
without torch. Blocking saves, the writer process and export all write through it.
"""

from __future__ import annotations

import bisect
import json
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

# Most threads a rank moves checkpoint data on by default (io_threads()).
MAX_IO_THREADS = 16
# Largest piece one thread moves at a time (and the size of its scratch buffer).
PIECE_BYTES = 8 << 20
# The most views one preadv/pwritev call takes: the system's, or the limit POSIX guarantees.
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def io_threads(requested: int | None = None) -> int:
    """Threads a rank reads on, and files it writes at once: ``requested``, or the CPUs this
    process may run on shared among the node's ranks (``LOCAL_WORLD_SIZE``), between 2 and
    :data:`MAX_IO_THREADS` (docs/format.md: tmpfs bandwidth grows up to 16 writers)."""
    if requested is not None:
        return requested
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(2, min(MAX_IO_THREADS, (cpus or 1) // local))


def vectored(call: Callable, fd: int, views: list, offset: int, stuck: Exception) -> None:
    """``call(fd, views, pos)`` (``os.preadv`` or ``os.pwritev``) until every view is done, at
    most :data:`IOV_MAX` views at a time; ``stuck`` (with the byte position) when a call
    moves nothing."""
    views = [v for v in views if len(v)]
    pos = offset
    while views:
        n = call(fd, views[:IOV_MAX], pos)
        if n <= 0:
            raise type(stuck)(f"{stuck} at byte {pos}")
        pos += n
        while views and n >= len(views[0]):  # drop what was moved (a short call: part)
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def pwritev_exact(fd: int, views: list, offset: int, path: str) -> None:
    """Write ``views`` (in order) as consecutive bytes of ``fd`` at ``offset``."""
    vectored(os.pwritev, fd, views, offset, OSError(f"{path}: nothing written"))


def run_parallel(jobs: list, work: Callable[[Any, int], None], threads: int,
                 finish: Callable[[], None] | None = None) -> None:
    """``work(job, slot)`` for every job on ``threads`` threads (``slot``: the thread's index),
    dealt round-robin. After a failure the threads take no more jobs; the earliest failed
    job's error is raised once every thread has stopped and ``finish`` has run."""
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
        # Plain threads, not an executor: an asynchronous save still running when the
        # script ends must finish, and executors refuse work once shutdown has begun.
        pool = [threading.Thread(target=run, args=(slot,), name=f"ckpt-io-{slot}")
                for slot in range(1, threads)]
        for t in pool:
            t.start()
        run(0)
        for t in pool:
            t.join()
    finally:
        if finish is not None:
            finish()
    if errors:
        raise errors[min(errors)]


@dataclass(frozen=True)
class Part:
    """``nbytes`` of a file from byte ``start``: ``data`` (bytes sliced by byte: a memoryview,
    a 1-D uint8 tensor) or zeros when ``data`` is None."""

    start: int
    nbytes: int
    data: Any

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass(frozen=True)
class Cut:
    """Bytes ``[start, end)`` of a file, all in ``part``; ``within``: where in its ``data``."""

    part: Part
    start: int
    end: int

    @property
    def within(self) -> slice:
        return slice(self.start - self.part.start, self.end - self.part.start)


class Parts:
    """A file's parts, sorted and contiguous from byte 0 (empty ones dropped)."""

    def __init__(self, parts: Sequence[Part]) -> None:
        self.parts = [p for p in parts if p.nbytes]
        self.starts = [p.start for p in self.parts]
        self.size = self.parts[-1].end if self.parts else 0

    def cuts(self, lo: int, hi: int) -> list[Cut]:
        """The parts' bytes in ``[lo, hi)``, in order."""
        out = []
        for p in self.parts[max(0, bisect.bisect_right(self.starts, lo) - 1):]:
            if p.start >= hi:
                break
            if p.end > lo:
                out.append(Cut(p, max(p.start, lo), min(p.end, hi)))
        return out


_ZEROS = memoryview(bytes(1 << 20))


def cut_views(cut: Cut) -> list[memoryview]:
    """The bytes of a cut whose part's data is bytes (a memoryview) or zeros (None)."""
    data = cut.part.data
    if data is not None:
        return [data[cut.within]]
    n = cut.end - cut.start
    return [_ZEROS[:min(len(_ZEROS), n - i)] for i in range(0, n, len(_ZEROS))]


class FileWriter:
    """A new file of ``size`` bytes at ``path``, written front to back: :meth:`write` takes
    the next bytes and hashes each ``block_bytes`` block as they pass; :meth:`finish`
    fsyncs and returns the manifest's record ``{"size", "block_bytes", "hashes"}``."""

    def __init__(self, path: str, size: int, block_bytes: int) -> None:
        self.path, self.size, self.block_bytes = path, size, block_bytes
        self.hashes: list[str] = []
        self.at = 0  # the next byte expected
        self._hash = xxhash.xxh3_64()  # of the block being written
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def write(self, start: int, views: Sequence[memoryview]) -> None:
        end = start + sum(len(v) for v in views)
        if start != self.at or end > self.size:
            raise ValueError(f"bytes [{start}, {end}) out of order (expected byte {self.at} "
                             f"of {self.size})")
        for v in views:
            while len(v):
                take = v[:self.block_bytes - self.at % self.block_bytes]
                self._hash.update(take)
                self.at += len(take)
                v = v[len(take):]
                if self.at % self.block_bytes == 0 or self.at == self.size:
                    self.hashes.append(self._hash.hexdigest())
                    self._hash.reset()
        pwritev_exact(self._fd, list(views), start, self.path)

    def finish(self) -> dict:
        if self.at != self.size:
            raise ValueError(f"{self.path}: {self.at} of {self.size} bytes came")
        os.fsync(self._fd)
        return {"size": self.size, "block_bytes": self.block_bytes, "hashes": self.hashes}

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_file(path: str, size: int, block_bytes: int, piece_bytes: int,
               take: Callable[[int, int], list[memoryview]]) -> dict:
    """Write the file whose bytes ``[lo, hi)`` ``take(lo, hi)`` gives, in pieces of at most
    ``piece_bytes``, through a :class:`FileWriter`; return its record."""
    writer = FileWriter(path, size, block_bytes)
    try:
        for lo in range(0, size, piece_bytes):
            writer.write(lo, take(lo, min(lo + piece_bytes, size)))
        return writer.finish()
    finally:
        writer.close()


# Messages to and from the writer process, both ways: a JSON value and binary blobs (8-byte
# little-endian lengths of the JSON and of each blob, then the bytes); nothing executable.
def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def recv(sock: socket.socket) -> tuple[Any, list[bytes]]:
    """A message: its JSON value and its blobs."""
    n, count = struct.unpack("<QQ", _recv_exact(sock, 16))
    obj = json.loads(_recv_exact(sock, n))
    return obj, [_recv_exact(sock, struct.unpack("<Q", _recv_exact(sock, 8))[0])
                 for _ in range(count)]


def send(sock: socket.socket, obj: Any, blobs: Sequence[bytes] = ()) -> None:
    data = json.dumps(obj).encode()
    out = [struct.pack("<QQ", len(data), len(blobs)), data]
    for b in blobs:
        out += [struct.pack("<Q", len(b)), b]
    sock.sendall(b"".join(out))
