"""The files of an asynchronous save, written by a process of their own.

Hashing and writing gigabytes from Python threads costs the training thread little CPU
but much waiting: every torch op releases the GIL and must take it back, and with a
writer thread per file wanting it too, a loop of small torch ops lost 20-65% of its time
while a background save of the ``1b`` state wrote to ``/dev/shm`` on the H200 host
(``benchmarks/writer_gil.py``). So an asynchronous save's host snapshot lives in shared
memory (:class:`~shardopt.pinned.PinnedBuffer` with ``shared=True``: a memfd mapping,
page-locked as before) and one writer process per training process
(:mod:`._writer_main`, which imports neither torch nor shardopt) maps it and writes,
hashes and fsyncs the files; the save's background thread only sends the plan (the files'
headers and where each piece of them lies in the buffers) and sleeps until the answer.

The process starts at the first asynchronous save that uses it and is reused. It checks
every 50 ms that its parent lives and exits when it does not, even mid-write (a killed
run's save is never committed anyway), and exits when the parent closes its end. A piece
the buffers do not hold (the RNG state, a few bytes) travels in the request. Anything
else the process cannot write (a source outside the snapshot, a dtype conversion) makes
:func:`write_files` return None, and the save's threads write it as a synchronous save
does.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

from ..pinned import PinnedBuffer
from . import _writer_main as protocol
from .storage import WriteEntry, file_parts

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

    def write(self, directory: Path, files: list[tuple[str, list, int]],
              block_bytes: int) -> dict[str, dict]:
        """Write ``files`` (name, parts ``(start, nbytes, src)``, size) into ``directory``;
        their records. ``src``: ``(buffer, byte offset)`` for a piece of a shared buffer,
        bytes, or None for zeros."""
        with self._lock:
            sock = self._start()
            try:
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
            except (OSError, EOFError) as e:
                self._close()
                raise OSError(f"the checkpoint writer process failed ({e!r}); it is "
                              "restarted at the next asynchronous save") from None
            finally:
                self._flush()
        if status != "ok":
            raise OSError(f"writing {directory}: {answer}")
        return answer


_PROCESS = WriterProcess()
atexit.register(_PROCESS.close)


def forget(buf: PinnedBuffer) -> None:
    _PROCESS.forget(buf)


def write_files(tmp: Path, jobs: Sequence[tuple[str, Sequence[WriteEntry]]], block_bytes: int,
                buffers: Sequence[PinnedBuffer]) -> dict[str, dict] | None:
    """Coordinator-free. Write ``jobs`` (file name, entries) into ``tmp`` with the writer
    process, when every entry's bytes lie in ``buffers`` (shared) or are small; return the
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
    return _PROCESS.write(tmp, files, block_bytes)


def available() -> bool:
    """Whether asynchronous saves can write through the process here (Linux: memfd, and
    descriptors passed over a socket)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")
