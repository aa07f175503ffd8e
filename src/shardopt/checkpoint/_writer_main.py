"""The writer process of asynchronous saves (see :mod:`.writer_process`): run as a script,
it imports neither torch nor shardopt, only the standard library and xxhash.

It maps the snapshot buffers the parent sends (file descriptors of shared memory, over
the socket), and for each write request writes the files it lists, each from its parts
(bytes sent along, pieces of the mapped buffers, zeros), hashing each block as it writes
it, fsyncs them and answers the blocks' digests, or the error. It exits within
``PARENT_POLL_S`` of its parent's death, even mid-write, and when the socket closes.

Messages, both ways: a JSON value and binary blobs (8-byte little-endian lengths of the
JSON and of each blob, then the bytes); no pickle, nothing executable crosses. A
``["map", id, nbytes]`` request is followed by one byte carrying the descriptor
(``SCM_RIGHTS``). In a write request a part's source is null (zeros), ``[buffer id, byte
offset]`` or ``{"blob": k}`` (the request's k-th blob).

A streamed write (``["stream", {...}]``, :func:`stream`) writes files whose bytes the parent
passes through a small mapped staging buffer, piece by piece: ``["pieces", [[file, start,
nbytes, slot], ...]]`` name filled slots, each answered ``["free", slot]`` once written (or
``["failed", why]`` once, after which pieces are freed unwritten); ``["end"]`` is answered
``["done", "ok", records]`` or ``["done", "error", why]``.
"""

import mmap
import os
import json
import queue
import socket
import struct
import sys
import threading
import time

import xxhash

PARENT_POLL_S = 0.05  # how often the process checks that its parent lives
_ZEROS = bytes(1 << 20)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def recv(sock: socket.socket) -> tuple:
    """A message: its JSON value and its blobs."""
    n, count = struct.unpack("<QQ", _recv_exact(sock, 16))
    obj = json.loads(_recv_exact(sock, n))
    blobs = []
    for _ in range(count):
        (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
        blobs.append(_recv_exact(sock, size))
    return obj, blobs


def send(sock: socket.socket, obj, blobs: list = ()) -> None:
    data = json.dumps(obj).encode()
    out = [struct.pack("<QQ", len(data), len(blobs)), data]
    for b in blobs:
        out += [struct.pack("<Q", len(b)), b]
    sock.sendall(b"".join(out))


# The most views one preadv/pwritev call takes: the system's, or the limit POSIX guarantees.
POSIX_IOV_MAX = 1024
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else POSIX_IOV_MAX


def vectored(call, fd: int, views: list, offset: int, stuck: Exception) -> None:
    """``call(fd, views, pos)`` (``os.preadv`` or ``os.pwritev``) until every view is done, at
    most :data:`IOV_MAX` views at a time; ``stuck`` (with the byte position added) when a
    call moves nothing. Also the threads' reads and writes (:mod:`.transfer`)."""
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


def write_file(path: str, parts: list, size: int, block_bytes: int, maps: dict,
               blobs: list) -> dict:
    """``parts``: ``[start, nbytes, src]`` sorted and contiguous from byte 0 (``src``: see
    the module's docstring)."""
    def view(part, lo: int, hi: int):
        start, _, src = part
        if src is None:
            return memoryview(_ZEROS)[:hi - lo]
        if isinstance(src, bytes):
            return memoryview(src)[lo - start:hi - start]
        buf, at = src
        return maps[buf][at + lo - start:at + hi - start]

    parts = [(start, nbytes, blobs[src["blob"]] if isinstance(src, dict) else src)
             for start, nbytes, src in parts]

    # Zeros longer than the zero block are cut into pieces of it.
    cut = []
    for start, nbytes, src in parts:
        step = len(_ZEROS) if src is None else max(nbytes, 1)
        cut += [(s, min(step, start + nbytes - s), src) for s in range(start, start + nbytes, step)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        hashes, i = [], 0
        for start in range(0, size, block_bytes):
            end = min(start + block_bytes, size)
            while cut[i][0] + cut[i][1] <= start:
                i += 1
            views, j = [], i
            while j < len(cut) and cut[j][0] < end:
                views.append(view(cut[j], max(cut[j][0], start), min(cut[j][0] + cut[j][1], end)))
                j += 1
            h = xxhash.xxh3_64()
            for v in views:
                h.update(v)
            vectored(os.pwritev, fd, views, start, OSError(f"{path}: nothing written"))
            hashes.append(h.hexdigest())
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": size, "block_bytes": block_bytes, "hashes": hashes}


def write_all(request: dict, maps: dict, blobs: list) -> dict:
    """Every file of the request at once, one thread each; the first error is raised."""
    records, errors = {}, []

    def one(name, parts, size):
        try:
            records[name] = write_file(os.path.join(request["dir"], name), parts, size,
                                       request["block_bytes"], maps, blobs)
        except BaseException as e:  # noqa: BLE001 - answered to the parent
            errors.append(f"{name}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=f) for f in request["files"]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise OSError("; ".join(errors))
    return records


class _StreamedFile:
    """One file of a streamed write, written by a thread of its own from the pieces queued
    for it, in order; each block's digest is taken as its last piece is written."""

    def __init__(self, path: str, size: int, block_bytes: int) -> None:
        self.path, self.size, self.block_bytes = path, size, block_bytes
        self.queue: queue.Queue = queue.Queue()
        self.hashes: list[str] = []
        self.fd: int | None = None
        self.at = 0  # the next byte expected
        self.hash = xxhash.xxh3_64()  # of the block being written

    def write(self, start: int, view: memoryview) -> None:
        if self.fd is None:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        end = start + len(view)
        if start != self.at or end > self.size or \
                start // self.block_bytes != (end - 1) // self.block_bytes:
            raise ValueError(f"piece [{start}, {end}) out of order or across a block "
                             f"(expected byte {self.at} of {self.size})")
        if start % self.block_bytes == 0:
            self.hash.reset()
        self.hash.update(view)
        vectored(os.pwritev, self.fd, [view], start, OSError(f"{self.path}: nothing written"))
        self.at = end
        if end % self.block_bytes == 0 or end == self.size:
            self.hashes.append(self.hash.hexdigest())

    def finish(self) -> dict:
        if self.fd is None:  # an empty file gets no piece
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        if self.at != self.size:
            raise ValueError(f"{self.at} of {self.size} bytes came")
        os.fsync(self.fd)
        return {"size": self.size, "block_bytes": self.block_bytes, "hashes": self.hashes}

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def stream(sock: socket.socket, request: dict, maps: dict, failed: dict) -> None:
    """Serve one streamed write (see the module's docstring) until its ``end``."""
    slot_bytes = request["slot_bytes"]
    files = [_StreamedFile(os.path.join(request["dir"], name), size, request["block_bytes"])
             for name, size in request["files"]]
    buf = request["buffer"]
    staging = maps.get(buf)
    errors: list[str] = [] if staging is not None else \
        [failed.get(buf, f"the staging buffer {buf} is not mapped")]
    lock = threading.Lock()

    def answer(msg) -> None:
        with lock:
            send(sock, msg)

    def fail(why: str) -> None:
        with lock:
            first = not errors
            errors.append(why)
            if first:
                send(sock, ["failed", why])

    def run(f: _StreamedFile) -> None:
        while True:
            piece = f.queue.get()
            if piece is None:
                break
            start, nbytes, slot = piece
            if not errors:
                try:
                    f.write(start, staging[slot * slot_bytes:slot * slot_bytes + nbytes])
                except BaseException as e:  # noqa: BLE001 - answered to the parent
                    fail(f"{os.path.basename(f.path)}: {type(e).__name__}: {e}")
            answer(["free", slot])

    if errors:
        answer(["failed", errors[0]])
    threads = [threading.Thread(target=run, args=(f,)) for f in files]
    for t in threads:
        t.start()
    records: dict[str, dict] = {}
    try:
        while True:
            msg, _ = recv(sock)
            if msg[0] == "end":
                break
            for i, start, nbytes, slot in msg[1]:
                files[i].queue.put((start, nbytes, slot))
    finally:
        for f in files:
            f.queue.put(None)
        for t in threads:
            t.join()
        for f, (name, _) in zip(files, request["files"]):
            try:
                if not errors:
                    records[name] = f.finish()
            except BaseException as e:  # noqa: BLE001
                errors.append(f"{name}: {type(e).__name__}: {e}")
            finally:
                f.close()
    answer(["done", "error", errors[0]] if errors else ["done", "ok", records])


def _watch(parent: int) -> None:
    """Exit at once when the parent is gone (reparented), even in the middle of a write:
    its save can never commit. (``PR_SET_PDEATHSIG`` would fire when the parent's thread
    that started this process ends, which is the first save's background thread.)"""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def main(fd: int, parent: int) -> None:
    threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    sock = socket.socket(fileno=fd)
    maps: dict = {}
    failed: dict = {}  # buffers whose mapping failed: the reason
    while True:
        try:
            msg, blobs = recv(sock)
        except EOFError:
            return
        kind = msg[0]
        if kind == "map":
            _, buf, nbytes = msg
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            try:
                maps[buf] = memoryview(mmap.mmap(fds[0], nbytes, prot=mmap.PROT_READ)) \
                    if nbytes else memoryview(b"")
            except OSError as e:  # answered at the write that needs it
                failed[buf] = f"mapping {nbytes} bytes of the snapshot failed: {e}"
            finally:
                os.close(fds[0])
        elif kind == "unmap":
            maps.pop(msg[1], None)
            failed.pop(msg[1], None)
        elif kind == "stream":
            try:
                stream(sock, msg[1], maps, failed)
            except (EOFError, OSError):  # the parent is gone
                return
        elif kind == "write":
            try:
                bad = [failed[b] for b in msg[1]["buffers"] if b in failed]
                if bad:
                    raise OSError(bad[0])
                send(sock, ["ok", write_all(msg[1], maps, blobs)])
            except BaseException as e:  # noqa: BLE001
                send(sock, ["error", f"{type(e).__name__}: {e}"])


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
