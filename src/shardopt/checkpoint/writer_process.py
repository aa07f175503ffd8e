"""The files of an asynchronous save, written by a process of their own (docs/async_save.md).

A :class:`WriterProcess` (:mod:`._writer_main`: no torch) maps the snapshot's shared memory
and writes, hashes and fsyncs the files through the one block writer, so writer threads do
not take the GIL from training; the save's thread sends the plan and sleeps until the answer.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..pinned import PinnedBuffer
from . import transfer
from .storage import MIN_SCRATCH_BYTES, WriteEntry, file_parts
from .transfer import Part, Parts

# Slots of a streamed write's staging buffer, for as many files written at once (at most
# io_threads(): 16).
STREAM_SLOTS = 16
# Pieces outside the shared buffers (headers, the RNG state) travel in the request when no
# larger than this.
INLINE_BYTES = 16 << 20
_WORKER = str(Path(__file__).with_name("_writer_main.py"))
# Jobs: (file name, its entries), as a save lists them.
Jobs = Sequence[tuple[str, Sequence[WriteEntry]]]


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of file ``file`` (its index) that one staging slot carries."""

    file: int
    start: int
    end: int


@dataclass
class _Link:
    """A running writer process and this side's socket to it (of process ``pid``)."""

    proc: subprocess.Popen
    sock: socket.socket
    pid: int

    def end(self) -> None:
        if os.getpid() != self.pid:  # a forked child: the process is the parent's
            return
        self.sock.close()  # the process sees EOF and exits
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class WriterProcess:
    """One writer process, started at the first write and restarted after a failure, and
    the shared buffers it maps. Thread-safe. Its owner holds it as long as the buffers it
    writes from; :meth:`close` ends the process (so do garbage collection and exit)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._link: _Link | None = None
        self._ended: weakref.finalize | None = None
        self._ids: weakref.WeakKeyDictionary[PinnedBuffer, int] = weakref.WeakKeyDictionary()
        self._next = 0
        self._pid = os.getpid()  # a forked child (a data loader worker) must not talk to it

    @functools.cached_property
    def available(self) -> bool:
        """Whether the process can write here (Linux: memfd, descriptors over a socket)."""
        return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")

    @property
    def pid(self) -> int | None:
        """The running process's id, or None."""
        return self._link.proc.pid if self._link is not None else None

    def _start(self) -> socket.socket:
        if os.getpid() != self._pid:  # forked: the socket and the process are the parent's
            if self._ended is not None:
                self._ended.detach()
            self._link = self._ended = None
            self._ids = weakref.WeakKeyDictionary()
            self._pid = os.getpid()
        if self._link is not None and self._link.proc.poll() is None:
            return self._link.sock
        self._close()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The script's directory is not put on sys.path (its modules' names would shadow).
        boot = ("import runpy, sys; sys.path[:1] = []; sys.argv[:1] = []; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", boot, _WORKER, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        self._link = _Link(proc, mine, os.getpid())
        self._ended = weakref.finalize(self, self._link.end)
        self._ids = weakref.WeakKeyDictionary()  # the old process's mappings went with it
        return mine

    def _close(self) -> None:
        if os.getpid() == self._pid and self._ended is not None:
            self._ended()
        self._link = self._ended = None

    def close(self) -> None:
        """End the process, if any; the next write starts a new one."""
        with self._lock:
            self._close()

    def forget(self, buf: PinnedBuffer) -> None:
        """Unmap ``buf`` in the process; call it before releasing a buffer it wrote from
        (its mapping would keep the memory alive while the process lives)."""
        with self._lock:
            i = self._ids.pop(buf, None)
            if i is not None and self._link is not None and os.getpid() == self._pid:
                try:
                    transfer.send(self._link.sock, ["unmap", i])
                except OSError:
                    pass  # the process is gone, and its mappings with it

    def _map(self, sock: socket.socket, buf: PinnedBuffer) -> int:
        i = self._ids.get(buf)
        if i is None:
            i, self._next = self._next, self._next + 1
            transfer.send(sock, ["map", i, buf.tensor.numel() * buf.tensor.element_size()])
            socket.send_fds(sock, [b"F"], [buf.fd])
            self._ids[buf] = i
        return i

    @contextlib.contextmanager
    def _talk(self) -> Iterator[socket.socket]:
        """The socket to the process (started if need be), under the lock. A failed
        exchange closes the process: a broken socket is raised as an :class:`OSError`
        saying so, anything else as it is."""
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

    def write_files(self, tmp: Path, jobs: Jobs, block_bytes: int,
                    buffers: Sequence[PinnedBuffer]) -> dict[str, dict] | None:
        """Coordinator-free. Write ``jobs`` into ``tmp`` when every entry's bytes lie in
        ``buffers`` (shared) or are small; the files' records, or None (nothing written)
        when some cannot go that way (a device source, a dtype conversion)."""
        shared = [b for b in buffers if b.fd is not None]
        files = []
        for name, entries in jobs:
            if any(e.source is not None and (e.source.dtype != e.dtype or e.source.is_cuda)
                   for e in entries):
                return None
            parts = file_parts(entries)
            for p in parts:
                if p.data is not None and _inside(p, shared) is None and p.nbytes > INLINE_BYTES:
                    return None
            files.append((name, parts))
        with self._talk() as sock:
            blobs: list[bytes] = []
            used: set[int] = set()  # the ids of the buffers this request reads

            def wire(p: Part) -> list:
                if p.data is None:
                    return [p.start, p.nbytes, None]
                inside = _inside(p, shared)
                if inside is None:
                    blobs.append(p.data.numpy().tobytes())
                    return [p.start, p.nbytes, {"blob": len(blobs) - 1}]
                buf, at = inside
                used.add(self._map(sock, buf))
                return [p.start, p.nbytes, [self._ids[buf], at]]

            request = [[name, [wire(p) for p in parts], Parts(parts).size]
                       for name, parts in files]
            transfer.send(sock, ["write", {"dir": str(tmp), "files": request,
                                           "block_bytes": block_bytes,
                                           "buffers": sorted(used)}], blobs)
            (status, answer), _ = transfer.recv(sock)
        if status != "ok":
            raise OSError(f"writing {tmp}: {answer}")
        return answer

    def stream_files(self, tmp: Path, jobs: Jobs, block_bytes: int, staging: PinnedBuffer,
                     slot_bytes: int) -> dict[str, dict] | None:
        """Coordinator-free. Write ``jobs`` into ``tmp`` through ``staging`` (shared,
        page-locked where the sources are on a GPU), cut into slots of ``slot_bytes``
        (:func:`stream_slots`); the files' records, or None (nothing written) when the
        buffer is not shared. The files' pieces are dealt round-robin, so every file's
        thread in the process has work; whenever half the slots are free they are filled
        (device bytes copied on the current stream, this thread asleep until they land)
        while the process writes the others."""
        if staging.fd is None:
            return None
        layouts = [Parts(file_parts(entries)) for _, entries in jobs]
        order = _stream_order([f.size for f in layouts], slot_bytes)
        ring = staging.tensor.view(torch.uint8)
        free = list(range(ring.numel() // slot_bytes))
        half = max(1, len(free) // 2)
        with self._talk() as sock:
            transfer.send(sock, ["stream", {
                "dir": str(tmp), "files": [[name, f.size] for (name, _), f in zip(jobs, layouts)],
                "block_bytes": block_bytes, "slot_bytes": slot_bytes,
                "buffer": self._map(sock, staging)}])
            failure, i = None, 0
            while i < len(order) and failure is None:
                while failure is None and len(free) < min(half, len(order) - i):
                    (kind, arg), _ = transfer.recv(sock)
                    if kind == "failed":
                        failure = arg
                    else:
                        free.append(arg)
                if failure is not None:
                    break
                batch, stream = [], None
                while free and i < len(order):
                    piece, slot, i = order[i], free.pop(), i + 1
                    at = slot * slot_bytes
                    stream = _fill(ring[at:at + piece.end - piece.start], layouts[piece.file],
                                   piece.start) or stream
                    batch.append([piece.file, piece.start, piece.end - piece.start, slot])
                if stream is not None:
                    landed = torch.cuda.Event(blocking=True)  # asleep, not spinning
                    landed.record(stream)
                    landed.synchronize()
                transfer.send(sock, ["pieces", batch])
            transfer.send(sock, ["end"])
            msg = None
            while msg is None or msg[0] != "done":  # the last slots' "free"s come first
                msg, _ = transfer.recv(sock)
        if msg[1] != "ok":
            raise OSError(f"writing {tmp}: {msg[2]}")
        return msg[2]


def _inside(p: Part, buffers: Sequence[PinnedBuffer]) -> tuple[PinnedBuffer, int] | None:
    """The shared buffer that holds part ``p``'s bytes, and where in it."""
    ptr = p.data.data_ptr()
    for b in buffers:
        lo = b.tensor.data_ptr()
        if lo <= ptr and ptr + p.nbytes <= lo + b.tensor.numel() * b.tensor.element_size():
            return b, ptr - lo
    return None


def stream_slots(staging_bytes: int, block_bytes: int) -> tuple[int, int]:
    """``(slot bytes, slots)`` of a streamed write's staging buffer of about
    ``staging_bytes``: :data:`STREAM_SLOTS` slots of at most a block (at least
    :data:`~.storage.MIN_SCRATCH_BYTES` each, and two slots)."""
    slot = max(MIN_SCRATCH_BYTES, min(block_bytes, staging_bytes // STREAM_SLOTS))
    return slot, max(2, staging_bytes // slot)


def _stream_order(sizes: list[int], slot_bytes: int) -> list[Piece]:
    """Every piece of files of ``sizes``, of at most ``slot_bytes``, the files' pieces
    dealt round-robin."""
    per_file = [[Piece(f, lo, min(lo + slot_bytes, size)) for lo in range(0, size, slot_bytes)]
                for f, size in enumerate(sizes)]
    return [p for row in itertools.zip_longest(*per_file) for p in row if p is not None]


def _fill(dst: torch.Tensor, layout: Parts, lo: int) -> torch.cuda.Stream | None:
    """Put bytes ``[lo, lo + len(dst))`` of a file into ``dst`` (a slot of the page-locked
    staging buffer): host bytes and zeros at once, device bytes by copies queued on the
    current stream, which is returned (None when nothing was queued)."""
    stream = None
    for cut in layout.cuts(lo, lo + dst.numel()):
        out, data = dst[cut.start - lo:cut.end - lo], cut.part.data
        if data is None:
            out.zero_()
        elif data.is_cuda:
            stream = torch.cuda.current_stream(data.device)
            out.copy_(data[cut.within], non_blocking=True)
        else:
            out.copy_(data[cut.within])
    return stream
