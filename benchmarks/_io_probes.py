"""Measurement tools of the checkpoint benchmark: storage bandwidth, page cache, phase timers.

* :func:`raw_bandwidth` (run on every rank at once): what the storage gives one rank while
  every rank writes, the bar a save and a load are held to. Each test writes ``nbytes`` (the
  bytes a save writes per rank) in pieces of one size dealt round-robin to ``t`` threads, each
  thread its own new file (the kernel lets a file take one writer at a time; a new file, so
  no test rewrites pages an earlier one allocated) with ``os.pwrite`` from its own (pinned, on
  a GPU host) buffer, ``fsync`` s it, and reads it back with ``os.preadv`` after the files are
  evicted from the page cache. Every thread count and piece size asked for, each repeated;
  the best test is the bar. Also the pinned device-to-host and host-to-device copy bandwidth
  of the rank's GPU.
* :func:`evict` / :func:`cached_fraction`: ``posix_fadvise(DONTNEED)`` after the data is on disk
  (no root needed, unlike ``drop_caches``) and ``mincore`` to report how much of a checkpoint was
  still in the page cache when a load started. On tmpfs (/dev/shm) the page cache *is* the storage:
  eviction does nothing and the fraction stays 1.
* :class:`Probe` / :func:`hook_shardopt`: timing wrappers installed around shardopt's checkpoint
  internals from outside (no change to ``src/``), splitting a save or load into phases. Hooks whose
  target no longer exists are skipped and listed, so a refactor of the library degrades the phase
  table instead of breaking the benchmark. The library overlaps work with worker threads (a save
  hashes a piece while writing it; a load reads the next piece while hashing one), so the probe
  keeps threads apart: :func:`save_phases` / :func:`load_phases` give the calling thread's
  phases, which add up to the measured total (the thread's waits on its workers among them),
  and the workers' busy time separately, as overlapped time that adds nothing to the total.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

CHUNK_BYTES = 32 << 20
try:  # the library's thread count (files written at once), which the threaded raw test uses
    from shardopt.checkpoint.transfer import io_threads
except ImportError:
    def io_threads() -> int:
        return 4


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


def evict(path: Path) -> bool:
    """Drop the (clean) cached pages of every file under ``path`` from the page cache, then
    the whole clean page cache where this process may (root: ``drop_caches``), for pages
    fadvise leaves behind. Returns whether ``drop_caches`` was done."""
    for p in files_under(path) if Path(path).is_dir() else [Path(path)]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


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


def mount_of(path: Path) -> dict[str, str]:
    """Filesystem type and source of the mount holding ``path`` (longest /proc/mounts prefix)."""
    best = {"mount": "", "fstype": "?", "source": "?"}
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            source, mount, fstype = line.split()[:3]
            if str(path).startswith(mount) and len(mount) >= len(best["mount"]):
                best = {"mount": mount, "fstype": fstype, "source": source}
    except OSError:
        pass
    return best


# ----------------------------------------------------------------------------- raw bandwidth
def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """Collective. ``fn`` between barriers: (this rank's own seconds, seconds until every rank
    is done), both from the same start, which every rank leaves the first barrier at."""
    _barrier()
    t0 = time.perf_counter()
    fn()
    own = time.perf_counter() - t0
    _barrier()
    return own, time.perf_counter() - t0


def _random_buffer(cuda: bool, nbytes: int = CHUNK_BYTES) -> memoryview:
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    return memoryview(buf.numpy())


def _pwrite_all(fd: int, mv: memoryview, off: int) -> None:
    while len(mv):
        n = os.pwrite(fd, mv, off)
        if n <= 0:
            raise OSError(f"short write at {off}")
        mv, off = mv[n:], off + n


def _pread_all(fd: int, mv: memoryview, off: int) -> None:
    while len(mv):
        n = os.preadv(fd, [mv], off)
        if n <= 0:
            raise OSError(f"short read at {off}")
        mv, off = mv[n:], off + n


def _raw_pass(path: Path, pieces: int, threads: int, cuda: bool, evict_cache: bool,
              piece_bytes: int = CHUNK_BYTES, views: list[memoryview] | None = None
              ) -> dict[str, Any]:
    """Collective. Write ``pieces`` pieces of ``piece_bytes`` on ``threads`` threads, each
    thread its own new file (``path`` itself for one thread; a file takes one writer at a
    time) from its own buffer (``views[t]``, at least ``piece_bytes`` long; random ones are
    made when not given), ``fsync`` each file, evict them when ``evict_cache``, and read them
    back the same way. The files are removed afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    if views is None:
        views = [_random_buffer(cuda, piece_bytes) for _ in range(threads)]
    views = [v[:piece_bytes] for v in views[:threads]]
    files = [path] if threads == 1 else [path.with_name(f"{path.stem}-{t}{path.suffix}")
                                         for t in range(threads)]
    for f in files:
        f.unlink(missing_ok=True)  # a new file: no pages left from an earlier test
    counts = [len(range(t, pieces, threads)) for t in range(threads)]

    def on_threads(flags: int, move: Callable[[int, memoryview, int], None], sync: bool):
        def mine(t: int) -> None:
            fd = os.open(files[t], flags, 0o644)
            try:
                for i in range(counts[t]):
                    move(fd, views[t], i * piece_bytes)
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)

        def run() -> None:
            if threads == 1:
                mine(0)
            else:
                for f in [pool.submit(mine, t) for t in range(threads)]:
                    f.result()
        return run

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="raw-io") as pool:
        started = threading.Barrier(threads)  # every thread exists before the timer starts
        for f in [pool.submit(started.wait) for _ in range(threads)]:
            f.result()
        write_own, write = _timed(on_threads(os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                             _pwrite_all, True))
        dropped = False
        if evict_cache:
            for f in files:
                dropped = evict(f) or dropped
        cached = [cached_fraction(f) for f in files]
        read_own, read = _timed(on_threads(os.O_RDONLY, _pread_all, False))
    for f in files:
        f.unlink()
    known = [c for c in cached if c is not None]
    return {"write_s": write, "read_s": read, "write_own_s": write_own, "read_own_s": read_own,
            "bytes": pieces * piece_bytes, "drop_caches": dropped,
            "cached_fraction_before_read": sum(known) / len(known) if known else None}


def raw_bandwidth(directory: Path, rank: int, nbytes: int, cuda: bool, evict_cache: bool,
                  threads: list[int], piece_bytes: list[int], repeats: int
                  ) -> list[dict[str, Any]]:
    """Collective (barriers). Write + fsync and read of ``nbytes`` by this rank, once per
    repeat, thread count and piece size (:func:`_raw_pass`; repeats outermost, so that the
    settings see the machine alike), each into new files. One record per test: its settings,
    ``*_s`` until every rank was done (between barriers), ``*_own_s`` this rank alone, and
    the fraction of the files still cached before the read."""
    big = max(piece_bytes)
    views = [_random_buffer(cuda, big) for _ in range(max(threads))]  # made once, outside timing
    out = []
    for rep in range(repeats):
        for t in threads:
            for pb in piece_bytes:
                name = f"raw-{rank:05d}-r{rep}-t{t}-p{pb >> 20}.bin"
                test = _raw_pass(Path(directory) / name, max(1, nbytes // pb), t, cuda,
                                 evict_cache, pb, views)
                out.append({"rep": rep, "threads": t, "piece_bytes": pb,
                            "cpus_allowed": cpus_allowed(), **test})
    return out


def cpus_allowed() -> int | None:
    """CPUs this process may run on: fewer than the host has (a launcher's or a library's
    affinity) caps how many threads copy data at once, for the raw test and a save alike."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


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
    """Wall-clock timers of one save or load, split by thread so that overlapped work is not
    counted twice.

    * Phases (:meth:`inclusive`): a stack of named phases per thread; a phase's time includes
      the phases it calls.
    * Leaves (:meth:`leaf`): one blocking call (``os.write``, a hash update, a wait on a
      worker), keyed ``"{phase}/{name}"`` by the innermost phase of the calling thread. A leaf
      reached from inside another leaf of the same thread is not timed again, so the leaves of
      a phase never sum to more than the phase.
    * Worker tasks (:meth:`task`): a function handed to a worker thread from inside a phase.
      Its time is ``"{phase}/bg/busy"`` and the leaves it reaches are ``"{phase}/bg/{name}"``:
      time that overlaps the phase, not part of it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()  # worker and caller add at the same time
        self._local = threading.local()  # .stack, .in_leaf, .bg_phase

    def reset(self) -> None:
        with self._lock:
            self.times.clear()
            self.counts.clear()

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.times)

    def _add(self, key: str, seconds: float) -> None:
        with self._lock:
            self.times[key] += seconds
            self.counts[key] += 1

    def _stack(self) -> list[str]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _where(self) -> str:
        """The phase a leaf of the calling thread belongs to."""
        bg = getattr(self._local, "bg_phase", None)
        if bg is not None:
            return f"{bg}/bg"
        stack = self._stack()
        return stack[-1] if stack else "-"

    def inclusive(self, name: str, fn: Callable, sync: bool = False) -> Callable:
        def wrapper(*args, **kwargs):
            stack = self._stack()
            stack.append(name)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if sync and self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                stack.pop()
                self._add(name, time.perf_counter() - t0)
        wrapper.__wrapped__ = fn
        return wrapper

    def leaf(self, name: str, fn: Callable) -> Callable:
        local = self._local

        def wrapper(*args, **kwargs):
            if getattr(local, "in_leaf", False):
                return fn(*args, **kwargs)
            local.in_leaf = True
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                local.in_leaf = False
                self._add(f"{self._where()}/{name}", time.perf_counter() - t0)
        wrapper.__wrapped__ = fn
        return wrapper

    def task(self, fn: Callable) -> Callable:
        """``fn`` as run by a worker thread: timed as overlapping the caller's current phase
        (call this in the thread that submits the task)."""
        local = self._local
        # A task submitted by a worker (a pool inside a pool) overlaps the same phase.
        phase = getattr(local, "bg_phase", None) or (self._stack()[-1] if self._stack() else "-")

        def run(*args, **kwargs):
            local.bg_phase = phase
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                local.bg_phase = None
                self._add(f"{phase}/bg/busy", time.perf_counter() - t0)
        return run


class _TimedOs:
    """Stands in for the ``os`` module inside one module: times the I/O calls, forwards the rest."""

    def __init__(self, probe: Probe) -> None:
        for name in ("write", "fsync", "pread", "preadv", "pwritev"):
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
        if name.endswith("digest"):  # one-shot functions: xxh3_64_hexdigest(data)
            return self._probe.leaf("hash", real)
        probe = self._probe

        def make(*args, **kwargs):  # hasher objects: time update(); the rest is instant
            return _TimedMethod(probe.leaf("hash", real)(*args, **kwargs), "update", "hash", probe)
        return make


class _TimedMethod:
    """Stands in for ``obj``: its method ``method`` is timed as leaf ``name``, the rest forwarded
    (a hasher's ``update``; a worker future's ``result``, the caller waiting on the worker)."""

    def __init__(self, obj: Any, method: str, name: str, probe: Probe) -> None:
        self._obj = obj
        setattr(self, method, probe.leaf(name, getattr(obj, method)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._obj, name)


def _timed_pool(probe: Probe, real: type) -> type:
    """A ``ThreadPoolExecutor`` whose tasks are :meth:`Probe.task` s and whose futures time
    the caller's waits."""

    class TimedPool(real):  # type: ignore[misc, valid-type]
        def submit(self, fn, /, *args, **kwargs):
            future = super().submit(probe.task(fn), *args, **kwargs)
            return _TimedMethod(future, "result", "worker_wait", probe)
    return TimedPool


@contextlib.contextmanager
def hook_shardopt(probe: Probe) -> Iterator[dict[str, list[str]]]:
    """Install the phase hooks for the duration of the block; yields which hooks are active.

    Functions are patched where they are looked up: a module attribute for module-level
    functions called by name, the class for methods, and the ``os`` / ``xxhash`` /
    ``ThreadPoolExecutor`` names of the modules that do the I/O, hashing and threading.
    """
    import importlib

    from shardopt import optimizer as opt_mod
    from shardopt import shard_state as shard_state_mod

    mods = {}
    for name in ("save", "load", "read", "agree", "storage", "blocks", "transfer", "commit",
                 "format"):
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

    def phase(owner: Any, attr: str, name: str, label: str, sync: bool = False) -> None:
        patch(owner, attr, lambda f: probe.inclusive(name, f, sync=sync), label)

    save, load, read = mods.get("save"), mods.get("load"), mods.get("read")
    storage, blocks = mods.get("storage"), mods.get("blocks")
    transfer = mods.get("transfer")
    commit = mods.get("commit")
    # save
    phase(save, "write_rank_files", "files", "save.write_rank_files")
    phase(save, "_manifest_text", "manifest", "save._manifest_text")
    phase(commit, "commit", "commit", "commit.commit")
    phase(commit, "begin", "begin", "commit.begin")
    # load (the read engine calls the names it imported)
    phase(load, "_prepare", "prepare", "load._prepare")
    phase(shard_state_mod.ShardState, "load_target", "alloc_moments", "ShardState.load_target")
    phase(read, "verify_blocks", "verify", "read.verify_blocks")
    phase(read, "read_blocks", "read_fresh", "read.read_blocks")
    phase(read, "read_segments", "read_into", "read.read_segments")
    phase(opt_mod.ShardStateAccess, "adopt", "adopt", "ShardStateAccess.adopt", sync=True)
    # both
    phase(save, "agree", "agree", "save.agree")
    phase(load, "agree", "agree", "load.agree")
    # leaves: system calls, hashing, worker threads (the reads and writes run on them)
    for label, mod in (("storage", storage), ("transfer", transfer), ("commit", commit)):
        patch(mod, "os", lambda m: _TimedOs(probe), f"{label}.os")
    for label, mod in (("format", mods.get("format")), ("blocks", blocks),
                       ("transfer", transfer)):
        patch(mod, "xxhash", lambda m: _TimedXxhash(probe), f"{label}.xxhash")
    for label, mod in (("transfer", transfer),):
        patch(mod, "ThreadPoolExecutor", lambda c: _timed_pool(probe, c),
              f"{label}.ThreadPoolExecutor")
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


# ----------------------------------------------------------------------------- phase tables
def _rest(whole: float, *parts: float) -> float:
    """``whole`` minus its parts; float noise below a nanosecond is not a negative phase."""
    rest = whole - sum(parts)
    return 0.0 if -1e-9 < rest < 0 else rest


def save_phases(t: dict[str, float], total: float) -> tuple[dict[str, float], dict[str, float]]:
    """Phases of one save from a probe snapshot: (critical path, overlapped), in seconds.

    Critical path (the calling thread; adds up to ``total``): waiting for the writer threads
    (``write_wait``: a thread per file, with helpers; they copy device pieces to pinned memory,
    hash and ``pwritev`` them and ``fsync`` the files), the directory's ``fsync``, the rest of
    file writing (entries, buffers, Python), then temp dir, manifest, commit and the cross-rank
    agreements; ``other`` is the rest.

    Overlapped, summed over the writer threads (so it can exceed the wall time): their
    device-to-host waits, ``pwritev`` and hashing.
    """
    files = t.get("files", 0.0)
    out = {"write_wait": t.get("files/worker_wait", 0.0),
           "fsync": t.get("files/os.fsync", 0.0)}
    out["files_other"] = _rest(files, *out.values())
    for name in ("begin", "manifest", "commit", "agree"):
        out[name] = t.get(name, 0.0)
    out["other"] = _rest(total, files, out["begin"], out["manifest"], out["commit"],
                         out["agree"])
    overlapped = {"writers_d2h_wait": t.get("files/bg/cuda_event_wait", 0.0),
                  "writers_pwritev": t.get("files/bg/os.pwritev", 0.0),
                  "writers_hash": t.get("files/bg/hash", 0.0)}
    return out, overlapped


def load_phases(t: dict[str, float], total: float) -> tuple[dict[str, float], dict[str, float]]:
    """Phases of one load from a probe snapshot: (critical path, overlapped), in seconds.

    Critical path (the calling thread; adds up to ``total``):

    * ``header_plan``: manifest, headers, checks, planning, reading the RNG state;
    * ``alloc_moments``: new moment tensors (a load into an optimizer without moments);
    * ``fresh_*``: the one verifying pass that reads moments into new tensors: waiting for
      the reader threads, waiting for host-to-device copies, the rest;
    * ``verify_*``: hash-checking the blocks that go into existing tensors: waiting for the
      reader threads, the rest;
    * ``read_wait``, ``h2d_wait``, ``read_other``: reading into existing tensors after every
      rank agreed (on the reader threads; the caller waits for them, then for the last
      host-to-device copies);
    * ``all_gather`` (publishing the loaded params), ``agree``, ``other``.

    Overlapped: the reader threads' busy time (``*_read_busy``, summed over threads).
    """
    prepare, alloc = t.get("prepare", 0.0), t.get("alloc_moments", 0.0)
    fresh, verify = t.get("read_fresh", 0.0), t.get("verify", 0.0)
    read_into = t.get("read_into", 0.0)
    out = {"header_plan": _rest(prepare, alloc, fresh, verify), "alloc_moments": alloc}
    for name, key in (("fresh", "read_fresh"), ("verify", "verify")):
        parts = {f"{name}_read_wait": t.get(f"{key}/worker_wait", 0.0)}
        if name == "fresh":  # verify only hashes; the one pass also copies to the device
            parts["fresh_h2d_wait"] = t.get("read_fresh/cuda_event_wait", 0.0)
        out.update(parts)
        out[f"{name}_other"] = _rest(t.get(key, 0.0), *parts.values())
    out["read_wait"] = t.get("read_into/worker_wait", 0.0)
    out["h2d_wait"] = t.get("read_into/cuda_event_wait", 0.0)
    out["read_other"] = _rest(read_into, out["read_wait"], out["h2d_wait"])
    out["all_gather"] = t.get("adopt", 0.0)
    out["agree"] = t.get("agree", 0.0)
    out["other"] = _rest(total, prepare, read_into, out["all_gather"], out["agree"])
    overlapped = {"fresh_read_busy": t.get("read_fresh/bg/busy", 0.0),
                  "verify_read_busy": t.get("verify/bg/busy", 0.0),
                  "read_busy": t.get("read_into/bg/busy", 0.0)}
    return out, overlapped
