"""The files of an asynchronous save, written by a process of their own.

Hashing and writing gigabytes from Python threads costs the training thread little CPU
but much waiting: every torch op releases the GIL and must take it back, and with a
writer thread per file wanting it too, a loop of small torch ops loses a large share of its
time while a background save writes (``benchmarks/probes/writer_gil.py``; figures in
docs/async_save.md). So an asynchronous save's host snapshot lives in shared
memory (:class:`~shardopt.pinned.PinnedBuffer` with ``shared=True``: a memfd mapping,
page-locked) and a writer process (:mod:`._writer_main`, which imports neither torch nor
shardopt), one per optimizer's saves (held by :class:`.background.Saves`), maps it and
writes, hashes and fsyncs the files; the save's background thread only sends the plan (the
files' headers and where each piece of them lies in the buffers) and sleeps until the answer.

The process starts at the first asynchronous save that uses it and is reused by the next.
It checks every 50 ms that its parent lives and exits when it does not, even mid-write (a
killed run's save is never committed anyway), and exits when the parent closes its end
(when the optimizer goes or at exit, :mod:`.shutdown`). A piece the buffers do not hold (the
RNG state, a few bytes) travels in the request. Anything else the process cannot write (a
source outside the snapshot, a dtype conversion) makes :func:`write_files` return None, and
the save's threads write it as a synchronous save does.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ..pinned import PinnedBuffer
from . import _writer_main as protocol
from .storage import MIN_SCRATCH_BYTES, WriteEntry, file_parts
from .transfer import Part, overlapping

# Slots of a streamed write's staging buffer, for as many files written at once (at most
# io_threads(): 16).
STREAM_SLOTS = 16
# Pieces outside the shared buffers (headers, the RNG state) travel in the request when no
# larger than this.
INLINE_BYTES = 16 << 20
_WORKER = str(Path(__file__).with_name("_writer_main.py"))


class WriterProcess:
    """One writer process and the shared buffers it has mapped. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._ids: weakref.WeakKeyDictionary[PinnedBuffer, int] = weakref.WeakKeyDictionary()
        self._finalizers: dict[int, weakref.finalize] = {}  # id -> its unmapping, run once
        self._unmap: list[int] = []  # released buffers the process still maps
        self._next = 0
        self._pid = os.getpid()  # a forked child (a data loader worker) must not talk to it

    def _start(self) -> socket.socket:
        if os.getpid() != self._pid:  # forked: the socket and the process are the parent's
            self._sock = self._proc = None
            self._ids, self._finalizers, self._unmap = weakref.WeakKeyDictionary(), {}, []
            self._pid = os.getpid()
        if self._proc is not None and self._proc.poll() is None and self._sock is not None:
            return self._sock
        self._close()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The script's directory is not put on sys.path (its modules' names would shadow).
        boot = ("import runpy, sys; sys.path[:1] = []; sys.argv[:1] = []; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", boot, _WORKER, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        self._sock = mine
        for fin in self._finalizers.values():
            fin.detach()  # the old process's mappings went with it
        self._ids, self._finalizers, self._unmap = weakref.WeakKeyDictionary(), {}, []
        return mine

    def _close(self) -> None:
        if os.getpid() != self._pid:
            return
        if self._sock is not None:
            self._sock.close()  # the process sees EOF and exits
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._close()

    def forget(self, buf: PinnedBuffer) -> None:
        """Unmap ``buf`` in the process (called when it is released; a buffer collected
        without it is unmapped by its finalizer): a mapping would keep its memory alive."""
        i = self._ids.get(buf)
        fin = None if i is None else self._finalizers.get(i)
        if fin is not None:
            fin()

    def _dropped(self, i: int) -> None:
        """Queue the unmapping of buffer ``i``; send it now unless a write holds the lock
        (that write sends it when it ends). Never blocks: it may run in a finalizer."""
        if os.getpid() != self._pid:  # in a forked child: the mapping is the parent's
            return
        self._unmap.append(i)
        if self._lock.acquire(blocking=False):
            try:
                self._flush()
            finally:
                self._lock.release()

    def _flush(self) -> None:
        while self._unmap:
            i = self._unmap.pop()
            self._finalizers.pop(i, None)
            if self._sock is not None:
                try:
                    protocol.send(self._sock, ["unmap", i])
                except OSError:
                    pass

    def _map(self, sock: socket.socket, buf: PinnedBuffer) -> int:
        i = self._ids.get(buf)
        if i is None:
            i, self._next = self._next, self._next + 1
            nbytes = buf.tensor.numel() * buf.tensor.element_size()
            protocol.send(sock, ["map", i, nbytes])
            socket.send_fds(sock, [b"F"], [buf.fd])
            self._ids[buf] = i
            self._finalizers[i] = weakref.finalize(buf, self._dropped, i)
        return i

    @contextlib.contextmanager
    def _talk(self) -> Iterator[socket.socket]:
        """The socket to the process (started if need be), under the lock. A failed
        exchange closes the process (the next one starts a new one): a broken socket is
        raised as an :class:`OSError` saying so, anything else as it is."""
        with self._lock:
            sock = self._start()
            try:
                yield sock
            except (OSError, EOFError) as e:
                self._close()
                raise OSError(f"the checkpoint writer process failed ({e!r}); it is "
                              "restarted at the next asynchronous save") from None
            except BaseException:
                self._close()  # mid-exchange: what it would read next is unknown
                raise
            finally:
                self._flush()

    def write(self, directory: Path, files: list[tuple[str, list, int]],
              block_bytes: int) -> dict[str, dict]:
        """Write ``files`` (name, parts ``(start, nbytes, src)``, size) into ``directory``;
        their records. ``src``: ``(buffer, byte offset)`` for a piece of a shared buffer,
        bytes, or None for zeros."""
        with self._talk() as sock:
            ids: dict[int, int] = {}  # id(buffer) -> its id in the process, mapped now
            blobs: list[bytes] = []

            def wire(src):
                if isinstance(src, tuple):
                    buf, at = src
                    if id(buf) not in ids:
                        ids[id(buf)] = self._map(sock, buf)
                    return [ids[id(buf)], at]
                if isinstance(src, bytes):
                    blobs.append(src)
                    return {"blob": len(blobs) - 1}
                return None
            files = [[name, [[s, n, wire(src)] for s, n, src in parts], size]
                     for name, parts, size in files]
            protocol.send(sock, ["write", {"dir": str(directory), "files": files,
                                           "block_bytes": block_bytes,
                                           "buffers": list(ids.values())}], blobs)
            (status, answer), _ = protocol.recv(sock)
        if status != "ok":
            raise OSError(f"writing {directory}: {answer}")
        return answer

    def stream(self, directory: Path, files: list[tuple[str, list[Part], int]],
               block_bytes: int, staging: PinnedBuffer, slot_bytes: int) -> dict[str, dict]:
        """Write ``files`` (name, parts, size) into ``directory`` through ``staging``, cut
        into slots of ``slot_bytes``; their records. The files' pieces (none across a
        block) are dealt round-robin, so every file's thread in the process has work; the
        slots are filled (device parts copied on the current stream, this thread asleep
        until they land) whenever half of them are free, while the process writes the
        others. Copies, an event and a message per half ring: little of the GIL."""
        order = _stream_order([size for _, _, size in files], block_bytes, slot_bytes)
        parts = [[p for p in ps if p.nbytes] for _, ps, _ in files]
        starts = [[p.start for p in ps] for ps in parts]
        ring = staging.tensor.view(torch.uint8)
        free = list(range(ring.numel() // slot_bytes))
        half = max(1, len(free) // 2)
        with self._talk() as sock:
            protocol.send(sock, ["stream", {
                "dir": str(directory), "files": [[n, size] for n, _, size in files],
                "block_bytes": block_bytes, "slot_bytes": slot_bytes,
                "buffer": self._map(sock, staging)}])
            failure, i = None, 0
            while i < len(order) and failure is None:
                while len(free) < min(half, len(order) - i):
                    (kind, arg), _ = protocol.recv(sock)
                    if kind == "failed":
                        failure = arg
                        break
                    free.append(arg)
                if failure is not None:
                    break
                batch, stream = [], None
                while free and i < len(order):
                    f, lo, hi = order[i]
                    slot, i = free.pop(), i + 1
                    at = slot * slot_bytes
                    stream = _fill(ring[at:at + hi - lo], parts[f], starts[f], lo) or stream
                    batch.append([f, lo, hi - lo, slot])
                if stream is not None:
                    landed = torch.cuda.Event(blocking=True)  # asleep, not spinning
                    landed.record(stream)
                    landed.synchronize()
                protocol.send(sock, ["pieces", batch])
            protocol.send(sock, ["end"])
            msg = None
            while msg is None or msg[0] != "done":  # the last slots' "free"s come first
                msg, _ = protocol.recv(sock)
        if msg[1] != "ok":
            raise OSError(f"writing {directory}: {msg[2]}")
        return msg[2]


def _stream_order(sizes: list[int], block_bytes: int, slot_bytes: int
                  ) -> list[tuple[int, int, int]]:
    """``(file, first byte, end byte)`` of every piece of files of ``sizes``: each block cut
    into pieces of at most ``slot_bytes``, the files' pieces dealt round-robin."""
    per_file = [[(f, lo, min(lo + slot_bytes, block + block_bytes, size))
                 for block in range(0, size, block_bytes)
                 for lo in range(block, min(block + block_bytes, size), slot_bytes)]
                for f, size in enumerate(sizes)]
    return [piece for row in itertools.zip_longest(*per_file) for piece in row
            if piece is not None]


def _fill(dst: torch.Tensor, parts: list[Part], starts: list[int], lo: int
          ) -> torch.cuda.Stream | None:
    """Put bytes ``[lo, lo + len(dst))`` of a file of ``parts`` into ``dst`` (a slot of the
    page-locked staging buffer): host bytes and zeros at once, device bytes by copies
    queued on the current stream, which is returned (None when nothing was queued)."""
    stream = None
    for p, a, b in overlapping(parts, starts, lo, lo + dst.numel()):
        out = dst[a - lo:b - lo]
        if p.data is None:
            out.zero_()
        elif p.data.is_cuda:
            stream = torch.cuda.current_stream(p.data.device)
            out.copy_(p.data[a - p.start:b - p.start], non_blocking=True)
        else:
            out.copy_(p.data[a - p.start:b - p.start])
    return stream


def write_files(tmp: Path, jobs: Sequence[tuple[str, Sequence[WriteEntry]]], block_bytes: int,
                buffers: Sequence[PinnedBuffer], process: WriterProcess
                ) -> dict[str, dict] | None:
    """Coordinator-free. Write ``jobs`` (file name, entries) into ``tmp`` with the writer
    ``process``, when every entry's bytes lie in ``buffers`` (shared) or are small; return the
    files' records, or None (nothing written) when some cannot go that way."""
    spans = [(b.tensor.data_ptr(), b.tensor.numel() * b.tensor.element_size(), b)
             for b in buffers if b.fd is not None]
    files = []
    for name, entries in jobs:
        if any(e.source is not None and (e.source.dtype != e.dtype or e.source.is_cuda)
               for e in entries):
            return None
        parts, size = [], 0
        for p in file_parts(entries):
            src = None
            if p.data is not None:
                ptr = p.data.data_ptr()
                src = next(((b, ptr - lo) for lo, n, b in spans
                            if lo <= ptr and ptr + p.nbytes <= lo + n), None)
                if src is None:
                    if p.nbytes > INLINE_BYTES:
                        return None
                    src = p.data.numpy().tobytes()
            parts.append((p.start, p.nbytes, src))
            size = p.start + p.nbytes
        files.append((name, parts, size))
    return process.write(tmp, files, block_bytes)


def stream_slots(staging_bytes: int, block_bytes: int) -> tuple[int, int]:
    """``(slot bytes, slots)`` of a streamed write's staging buffer of about
    ``staging_bytes``: :data:`STREAM_SLOTS` slots of at most a block (at least
    :data:`~.storage.MIN_SCRATCH_BYTES` each, and two slots)."""
    slot = max(MIN_SCRATCH_BYTES, min(block_bytes, staging_bytes // STREAM_SLOTS))
    return slot, max(2, staging_bytes // slot)


def stream_files(tmp: Path, jobs: Sequence[tuple[str, Sequence[WriteEntry]]], block_bytes: int,
                 staging: PinnedBuffer, slot_bytes: int, process: WriterProcess
                 ) -> dict[str, dict] | None:
    """Coordinator-free. Write ``jobs`` into ``tmp`` with the writer ``process`` through
    ``staging`` (shared, page-locked where the sources are on a GPU; slots of ``slot_bytes``:
    :func:`stream_slots`) and return the files' records; None (nothing written) when the
    buffer is not shared."""
    if staging.fd is None:
        return None
    files = []
    for name, entries in jobs:
        parts = file_parts(entries)
        files.append((name, parts, parts[-1].end))
    return process.stream(tmp, files, block_bytes, staging, slot_bytes)


def available() -> bool:
    """Whether asynchronous saves can write through the process here (Linux: memfd, and
    descriptors passed over a socket)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")
