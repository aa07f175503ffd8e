"""The files of an asynchronous save, written by a process of their own (docs/async_save.md).

A :class:`WriterProcess` (:mod:`._writer_main`: no torch) maps the snapshot's shared memory
and writes, hashes and fsyncs the files through the one block writer, so writer threads do
not take the GIL from training; the save's thread sends the plan and sleeps until the answer.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..pinned import PinnedBuffer
from . import transfer
from .storage import Job, file_parts
from .transfer import Part, Parts

# Pieces outside the shared buffers (headers, the RNG state) travel in the request when no
# larger than this.
INLINE_BYTES = 16 << 20
_WORKER = str(Path(__file__).with_name("_writer_main.py"))
log = logging.getLogger("shardopt.checkpoint")


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
            status = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            status = "killed after 10 s without exiting"
        if status != 0:
            log.warning("the checkpoint writer process (pid %d) ended with status %s; the "
                        "checkpoints it committed are complete (verify with shardopt verify)",
                        self.proc.pid, status)


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

    def write_files(self, tmp: Path, jobs: Sequence[Job], block_bytes: int,
                    buffers: Sequence[PinnedBuffer]) -> dict[str, dict] | None:
        """Coordinator-free. Write ``jobs`` into ``tmp`` when every entry's bytes lie in
        ``buffers`` (shared) or are small; the files' records, or None (nothing written)
        when some cannot go that way (a device source, a dtype conversion)."""
        shared = [b for b in buffers if b.fd is not None]
        files = []
        for job in jobs:
            if any(e.source is not None and (e.source.dtype != e.dtype or e.source.is_cuda)
                   for e in job.entries):
                return None
            parts = file_parts(job.entries)
            for p in parts:
                if p.data is not None and _inside(p, shared) is None and p.nbytes > INLINE_BYTES:
                    return None
            files.append((job.name, parts))
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


def _inside(p: Part, buffers: Sequence[PinnedBuffer]) -> tuple[PinnedBuffer, int] | None:
    """The shared buffer that holds part ``p``'s bytes, and where in it."""
    ptr = p.data.data_ptr()
    for b in buffers:
        lo = b.tensor.data_ptr()
        if lo <= ptr and ptr + p.nbytes <= lo + b.tensor.numel() * b.tensor.element_size():
            return b, ptr - lo
    return None
