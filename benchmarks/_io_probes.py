"""Measurement tools of the checkpoint benchmark: storage bandwidth, page cache, phase timers.

* :func:`raw_bandwidth` (run on every rank at once): a plain sequential write of ``nbytes`` with
  ``os.write`` from one pinned 32 MiB buffer (the size of one half of shardopt's staging) and an
  ``fsync``, then a read back with ``os.preadv`` into the same buffer, after evicting the file from
  the page cache. That is what one checkpoint writer thread per rank can get from the storage.
  Also the pinned device-to-host and host-to-device copy bandwidth of the rank's GPU.
* :func:`evict` / :func:`cached_fraction`: ``posix_fadvise(DONTNEED)`` after the data is on disk
  (no root needed, unlike ``drop_caches``) and ``mincore`` to report how much of a checkpoint was
  still in the page cache when a load started. On tmpfs (/dev/shm) the page cache *is* the storage:
  eviction does nothing and the fraction stays 1.
* :class:`Probe` / :func:`hook_shardopt`: timing wrappers installed around shardopt's checkpoint
  internals from outside (no change to ``src/``), splitting a save or load into phases. Hooks whose
  target no longer exists are skipped and listed, so a refactor of the library degrades the phase
  table instead of breaking the benchmark.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

CHUNK_BYTES = 32 << 20


# ----------------------------------------------------------------------------- files
def files_under(path: Path) -> list[Path]:
    return sorted(p for p in Path(path).rglob("*") if p.is_file())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in files_under(path))


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` (for writers that do not, before eviction)."""
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict(path: Path) -> None:
    """Drop the (clean) cached pages of every file under ``path`` from the page cache."""
    for p in files_under(path) if Path(path).is_dir() else [Path(path)]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = None


def _mincore_pages(path: Path) -> tuple[int, int]:
    """(resident pages, total pages) of one file, by ``mincore`` on a read-only mapping."""
    global _libc
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            resident = sum(1 for b in bytes(vec) if b & 1)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return resident, pages


def cached_fraction(path: Path) -> float | None:
    """Fraction of the pages of the files under ``path`` that are in the page cache."""
    try:
        resident = total = 0
        for p in files_under(path) if Path(path).is_dir() else [Path(path)]:
            r, t = _mincore_pages(p)
            resident += r
            total += t
        return resident / total if total else None
    except OSError:
        return None


# ----------------------------------------------------------------------------- raw bandwidth
def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def raw_bandwidth(directory: Path, rank: int, nbytes: int, cuda: bool, evict_cache: bool
                  ) -> dict[str, Any]:
    """Collective (barriers). Sequential write + fsync and read of ``nbytes`` by this rank."""
    buf = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=cuda)
    buf.copy_(torch.randint(0, 256, (CHUNK_BYTES,), dtype=torch.uint8))
    view = memoryview(buf.numpy())
    path = Path(directory) / f"raw-{rank:05d}.bin"
    nbytes = (nbytes // CHUNK_BYTES) * CHUNK_BYTES
    _barrier()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            mv = view[: min(left, CHUNK_BYTES)]
            while len(mv):
                n = os.write(fd, mv)
                mv = mv[n:]
                left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    write_own_s = time.perf_counter() - t0
    _barrier()
    write_s = time.perf_counter() - t0
    if evict_cache:
        evict(path)
    cached = cached_fraction(path)
    _barrier()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        while off < nbytes:
            n = os.preadv(fd, [view[: min(CHUNK_BYTES, nbytes - off)]], off)
            if n <= 0:
                raise OSError(f"short read of {path} at {off}")
            off += n
    finally:
        os.close(fd)
    read_own_s = time.perf_counter() - t0
    _barrier()
    read_s = time.perf_counter() - t0
    path.unlink()
    return {"bytes": nbytes, "write_s": write_s, "read_s": read_s, "write_own_s": write_own_s,
            "read_own_s": read_own_s, "cached_fraction_before_read": cached}


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 3
                   ) -> dict[str, float]:
    """Pinned host <-> device copy bandwidth (bytes/s, best of ``repeats``)."""
    if device.type != "cuda":
        return {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        out[f"{name}_bytes_per_s"] = nbytes / best
    return out


# ----------------------------------------------------------------------------- phase timers
class Probe:
    """Inclusive timers (a stack of named phases) and leaf timers attributed to the top phase."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stack: list[str] = []
        self.times: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def reset(self) -> None:
        self.times.clear()
        self.counts.clear()

    def snapshot(self) -> dict[str, float]:
        return dict(self.times)

    def inclusive(self, name: str, fn: Callable, sync: bool = False) -> Callable:
        def wrapper(*args, **kwargs):
            self.stack.append(name)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if sync and self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.stack.pop()
                self.times[name] += time.perf_counter() - t0
                self.counts[name] += 1
        wrapper.__wrapped__ = fn
        return wrapper

    def leaf(self, name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = f"{self.stack[-1] if self.stack else '-'}/{name}"
                self.times[key] += time.perf_counter() - t0
                self.counts[key] += 1
        wrapper.__wrapped__ = fn
        return wrapper


class _TimedOs:
    """Stands in for the ``os`` module inside one module: times the I/O calls, forwards the rest."""

    def __init__(self, probe: Probe) -> None:
        self._probe = probe
        for name in ("write", "fsync", "pread", "preadv"):
            setattr(self, name, probe.leaf(f"os.{name}", getattr(os, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


class _TimedXxhash:
    """Stands in for the ``xxhash`` module inside one module: times every hashing call."""

    def __init__(self, probe: Probe) -> None:
        import xxhash

        self._mod = xxhash
        self._probe = probe

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._mod, name)
        if not callable(real):
            return real
        if name.endswith(("digest",)):  # one-shot functions: xxh3_64_hexdigest(data)
            return self._probe.leaf("hash", real)
        probe = self._probe

        def make(*args, **kwargs):  # hasher objects: time update(); the rest is instant
            h = probe.leaf("hash", real)(*args, **kwargs)
            return _TimedHasherObject(h, probe)
        return make


class _TimedHasherObject:
    def __init__(self, h: Any, probe: Probe) -> None:
        self._h = h
        self.update = probe.leaf("hash", h.update)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._h, name)


@contextlib.contextmanager
def hook_shardopt(probe: Probe) -> Iterator[dict[str, list[str]]]:
    """Install the phase hooks for the duration of the block; yields which hooks are active."""
    import importlib

    from shardopt import optimizer as opt_mod

    mods = {}
    for name in ("io", "storage", "commit", "format"):
        try:
            mods[name] = importlib.import_module(f"shardopt.checkpoint.{name}")
        except ImportError:
            pass
    undo: list[Callable[[], None]] = []
    report: dict[str, list[str]] = {"active": [], "missing": []}

    def patch(owner: Any, attr: str, make: Callable[[Any], Any], label: str) -> None:
        if owner is None or not hasattr(owner, attr):
            report["missing"].append(label)
            return
        old = getattr(owner, attr)
        setattr(owner, attr, make(old))
        undo.append(lambda: setattr(owner, attr, old))
        report["active"].append(label)

    io, storage, commit = mods.get("io"), mods.get("storage"), mods.get("commit")
    # save
    patch(io, "_write_rank_files", lambda f: probe.inclusive("files", f), "io._write_rank_files")
    patch(io, "_manifest_text", lambda f: probe.inclusive("manifest", f), "io._manifest_text")
    patch(commit, "commit", lambda f: probe.inclusive("commit", f), "commit.commit")
    patch(commit, "begin", lambda f: probe.inclusive("begin", f), "commit.begin")
    # load
    patch(io, "_prepare", lambda f: probe.inclusive("prepare", f), "io._prepare")
    fr = getattr(storage, "FileReader", None)
    patch(fr, "verify", lambda f: probe.inclusive("verify", f), "FileReader.verify")
    patch(fr, "read_into", lambda f: probe.inclusive("read_into", f), "FileReader.read_into")
    patch(storage, "sync_staging", lambda f: probe.inclusive("read_into", f),
          "storage.sync_staging")
    patch(opt_mod.DistributedOptimizer, "_adopt_loaded_state",
          lambda f: probe.inclusive("adopt", f, sync=True), "DistributedOptimizer._adopt_loaded_state")
    # both
    patch(io, "_agree", lambda f: probe.inclusive("agree", f), "io._agree")
    # leaves
    patch(storage, "os", lambda m: _TimedOs(probe), "storage.os")
    # Hashing is timed where xxhash is called (BlockHasher and friends call into it).
    patch(storage, "xxhash", lambda m: _TimedXxhash(probe), "storage.xxhash")
    patch(mods.get("format"), "xxhash", lambda m: _TimedXxhash(probe), "format.xxhash")
    if probe.device.type == "cuda":
        event = torch.cuda.Event

        class _TimedEvent(event):  # type: ignore[misc, valid-type]
            synchronize = probe.leaf("cuda_event_wait", event.synchronize)

        patch(torch.cuda, "Event", lambda _: _TimedEvent, "torch.cuda.Event")
    try:
        yield report
    finally:
        for u in reversed(undo):
            u()


def save_phases(t: dict[str, float], total: float) -> dict[str, float]:
    """Named save phases (seconds) from a probe snapshot of one save."""
    files = t.get("files", 0.0)
    d2h = t.get("files/cuda_event_wait", 0.0)
    hashing = t.get("files/hash", 0.0)
    write = t.get("files/os.write", 0.0)
    fsync = t.get("files/os.fsync", 0.0)
    out = {
        "d2h_wait": d2h,
        "hash": hashing,
        "write": write,
        "fsync": fsync,
        "files_other": files - d2h - hashing - write - fsync,
        "begin": t.get("begin", 0.0),
        "manifest": t.get("manifest", 0.0),
        "commit": t.get("commit", 0.0),
        "agree": t.get("agree", 0.0),
    }
    out["unattributed"] = total - files - out["begin"] - out["manifest"] - out["commit"] - \
        out["agree"]
    return out


def load_phases(t: dict[str, float], total: float) -> dict[str, float]:
    """Named load phases (seconds) from a probe snapshot of one load."""
    verify = t.get("verify", 0.0)
    read_into = t.get("read_into", 0.0)
    read = t.get("read_into/os.preadv", 0.0) + t.get("read_into/os.pread", 0.0)
    h2d = t.get("read_into/cuda_event_wait", 0.0)
    verify_read = t.get("verify/os.pread", 0.0) + t.get("verify/os.preadv", 0.0)
    out = {
        "header_plan": t.get("prepare", 0.0) - verify,
        "verify_read": verify_read,
        "verify_hash": t.get("verify/hash", 0.0),
        "verify_other": verify - verify_read - t.get("verify/hash", 0.0),
        "read": read,
        "h2d_wait": h2d,
        "read_other": read_into - read - h2d,
        "all_gather": t.get("adopt", 0.0),
        "agree": t.get("agree", 0.0),
    }
    out["unattributed"] = total - t.get("prepare", 0.0) - read_into - out["all_gather"] - \
        out["agree"]
    return out
