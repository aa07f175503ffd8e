"""The snapshot of what one rank's asynchronous save writes: the state at the call, copied
while training goes on.

Adam state and params change only inside ``step()`` (and ``load_state_dict``,
``offload()``, ``reload_model_params()``, re-seeding written params), and each of those
first runs the optimizer's state-write hook
(:meth:`~shardopt.optimizer.DistributedOptimizer.register_state_write_hook`). A save
registers one (:class:`Drain`) until its copies are taken, so every byte it writes is
the state at the call.

Where the copy goes (``CheckpointConfig.snapshot``):

* ``"host"`` (default): one host buffer per dtype, exactly the bytes of this rank's entries
  (a tensor saved under two keys is copied once), reused while the sizes stay; shared
  memory (memfd) the writer process maps where it can run; page-locked in segments just
  ahead of the first copy into each (:meth:`~shardopt.pinned.PinnedBuffer.lock_to`), so
  locking gigabytes stalls nothing. The background thread drains the state into it from
  where it lives, in pieces of :data:`PIECE_BYTES` with :data:`IN_FLIGHT` in flight on a
  side stream, so that a small device-to-host read of the training loop (``.item()``)
  never queues behind gigabytes. When a write comes first, the hook copies what is not yet
  drained into spare device memory (device-to-device, a few large copies queued before the
  write) and the drain goes on from there; where that memory cannot be had, the hook waits
  on the host until the drain ends.
* ``"device_staged"``: spare GPU memory, copied device-to-device at the call; the
  background thread streams it to the files through one small page-locked staging buffer
  (:meth:`Snapshot.staging`), so the host holds no copy of the state.

Off CUDA the same drain runs with plain copies, the hook's spare memory on the host.

What is copied: runs of adjacent elements of the few flat tensors the state lives in (a
rank's shard of each bucket is contiguous), not one copy per param and state. A later save
whose state lives in tensors of the same names, sizes and dtypes repeats those copies from
wherever the tensors are now (:meth:`Snapshot.retake`); anything else plans anew.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from .. import pinned
from ..optimizer import DistributedOptimizer
from .storage import WriteEntry

# The drain's piece size and how many pieces it keeps in flight (read at each save).
PIECE_BYTES = 4 << 20
IN_FLIGHT = 1

log = logging.getLogger("shardopt.checkpoint")


@dataclass(frozen=True)
class Job:
    """A data file of a rank and the entries it holds."""

    name: str
    entries: list[WriteEntry]


@dataclass(frozen=True)
class Copy:
    """Bytes ``src`` to be copied into ``dst`` (1-D uint8 views of one size); ``into``: the
    host buffer ``dst`` lies in, page-locked by the drain just ahead of the copy."""

    dst: torch.Tensor
    src: torch.Tensor
    into: pinned.PinnedBuffer | None = None


class Drain:
    """The copies of one snapshot: those issued at the call, and the rest, issued by the
    background thread (:meth:`run`) in pieces; while any source is still to be read, the
    optimizer's state-write hook (:meth:`attach`). Thread-safe."""

    def __init__(self, copies: list[Copy], device: torch.device,
                 stream: torch.cuda.Stream | None, on_wait: Callable[[], None]) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.piece_bytes, self.in_flight = PIECE_BYTES, IN_FLIGHT
        self.finished = threading.Event()  # every copy done (or the drain failed)
        self._copies = copies  # not yet issued, in order
        self._offset = 0  # bytes of the first of them already issued
        self._flight: collections.deque[torch.cuda.Event] = collections.deque()
        self._stream, self._on_wait = stream, on_wait
        self._lock = threading.Lock()
        self._handle: RemovableHandle | None = None
        self._spares: list[torch.Tensor] = []  # copies of sources that could change
        self._ready = None
        if self.cuda:  # the sources are final once the work queued so far has run
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(device))
            stream.wait_event(self._ready)

    def issue_now(self, count: int) -> None:
        """Issue the first ``count`` copies whole, now; the current stream waits for them."""
        with self._lock:
            for c in self._copies[:count]:
                self._copy(c.dst, c.src)
            del self._copies[:count]
            if self._flight:
                torch.cuda.current_stream(self.device).wait_event(self._flight[-1])

    def keep_now(self, count: int) -> None:
        """Take the sources of the first ``count`` copies now, into spare memory (the drain
        goes on from there), or by :meth:`issue_now` where it cannot be had."""
        with self._lock:
            if not count or self._move(count, host=False):
                return
        self.issue_now(count)

    def attach(self, opt: DistributedOptimizer) -> None:
        """Guard ``opt``'s state until every copy has read it."""
        self._handle = opt.register_state_write_hook(self._before_write)

    def run(self) -> None:
        """Coordinator-free; the background thread. Issue the rest in pieces (at most
        :attr:`piece_bytes`, none across a segment of its host buffer) and return when
        every copy is done; the hook goes then, and if this raises."""
        if self.cuda:  # the host buffers are page-locked for this device's context
            torch.cuda.set_device(self.device)
        try:
            while True:
                while len(self._flight) >= self.in_flight:
                    self._flight[0].synchronize()  # asleep: a blocking event
                    with self._lock:
                        self._flight.popleft()
                with self._lock:
                    if not self._copies:
                        break
                    into, end, _ = self._next()
                self._prepare(into, end)  # outside the lock: the hook never waits for it
                with self._lock:
                    self._issue()
        finally:
            self.close()

    def close(self) -> None:
        """Wait for the copies in flight, drop the hook and the spare memory."""
        for event in list(self._flight):
            event.synchronize()
        with self._lock:
            self._flight.clear()
            self._copies, self._spares = [], []
            handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()
        self.finished.set()

    def _prepare(self, into: pinned.PinnedBuffer | None, end: int) -> None:
        """Page-lock the next piece's host buffer through byte ``end`` (CUDA)."""
        if into is not None and self.cuda:
            into.lock_to(end)

    def _next(self) -> tuple[pinned.PinnedBuffer | None, int, int]:
        """The next piece: its host buffer, the byte of it where the piece ends, its bytes."""
        c = self._copies[0]
        n = min(self.piece_bytes, c.dst.numel() - self._offset)
        if c.into is None:
            return None, 0, n
        at = c.dst.data_ptr() - c.into.tensor.data_ptr() + self._offset
        n = min(n, (at // pinned.SEGMENT_BYTES + 1) * pinned.SEGMENT_BYTES - at)
        return c.into, at + n, n

    def _issue(self) -> None:
        if not self._copies:
            return
        c, (_, _, n) = self._copies[0], self._next()
        lo, hi = self._offset, self._offset + n
        self._copy(c.dst[lo:hi], c.src[lo:hi])
        self._offset = hi
        if hi == c.dst.numel():
            self._copies.pop(0)
            self._offset = 0

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not self.cuda:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event(blocking=True)  # waited on asleep, not spinning
        event.record(self._stream)
        self._flight.append(event)

    def _before_write(self, host: bool) -> None:
        """The state-write hook: what is not yet issued is copied into spare memory now
        (on the current stream, which then waits for the pieces in flight; the host too
        where ``host``) and drained from there; without spare memory the host waits."""
        with self._lock:
            if self._handle is None:  # the drain ended meanwhile
                return
            if self._move(len(self._copies), host):
                handle, self._handle = self._handle, None
                handle.remove()
                return
        self._on_wait()
        self.finished.wait()

    def _move(self, count: int, host: bool) -> bool:
        """Copy what the first ``count`` copies not yet issued read into spare memory, on
        the current stream (after the pieces in flight, which still read it), and drain
        those from there; False where the memory cannot be had."""
        copies = self._copies[:count]
        spare = _spare(sum(c.src.numel() for c in copies) - self._offset, self.device)
        if spare is None:
            return False
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        if stream is not None:
            stream.wait_event(self._ready)
            for event in self._flight:
                stream.wait_event(event)
        at, moved = 0, []
        for i, c in enumerate(copies):
            lo = self._offset if i == 0 else 0
            part = spare[at:at + c.src.numel() - lo]
            part.copy_(c.src[lo:], non_blocking=self.cuda)
            moved.append(Copy(c.dst[lo:], part, c.into))
            at += part.numel()
        self._copies[:count], self._offset = moved, 0
        self._spares.append(spare)
        if stream is not None:
            done = torch.cuda.Event()
            done.record(stream)
            self._stream.wait_event(done)  # the next pieces read the spare copy
            if host:
                done.synchronize()
        return True


def _spare(nbytes: int, device: torch.device) -> torch.Tensor | None:
    """``nbytes`` of spare memory on ``device``, or None where they cannot be had."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        return None


class Snapshot:
    """Reused buffers for one optimizer's asynchronous saves (one at a time). ``forget``:
    told of each shared buffer released (the writer process unmaps it)."""

    def __init__(self, device: torch.device, shared: bool,
                 forget: Callable[[pinned.PinnedBuffer], None]) -> None:
        self.device, self.shared, self._forget = device, shared, forget
        self.cuda = device.type == "cuda"
        self.on_device = False  # where the buffers are: spare device memory, or the host
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self._host: dict[torch.dtype, pinned.PinnedBuffer] = {}
        self._staging: pinned.PinnedBuffer | None = None  # device_staged saves stream through it
        self._stream: torch.cuda.Stream | None = None
        self._plan: _Plan | None = None  # the last take, to repeat with the same buffers
        self._waits_logged = False

    def nbytes(self) -> int:
        """Memory the snapshot holds (kept between saves), on the device or the host."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def host_nbytes(self) -> int:
        """Host memory kept between saves: the host buffers, or the :meth:`staging` buffer."""
        return sum(b.nbytes for b in self.host_buffers())

    def host_buffers(self) -> list[pinned.PinnedBuffer]:
        """The host buffers the entries of the last take lie in (shared memory the writer
        process can map), or the staging buffer of a device snapshot."""
        if self.on_device:
            return [self._staging] if self._staging is not None else []
        return list(self._host.values())

    def staging(self, nbytes: int) -> pinned.PinnedBuffer:
        """A page-locked, shared host buffer of ``nbytes`` that ``"device_staged"`` saves
        stream the device copy through, kept and reused while the size stays."""
        if self._staging is None or self._staging.nbytes != nbytes:
            self._release([self._staging] if self._staging is not None else [])
            self._staging = pinned.PinnedBuffer(nbytes, torch.uint8, shared=self.shared,
                                                lock=self.cuda)
        return self._staging

    def release(self) -> None:
        """Free every buffer (after the copies queued into them)."""
        if self._stream is not None:
            self._stream.synchronize()
        self._release([*self._host.values(), *([self._staging] if self._staging else [])])
        self._buffers, self._host, self._plan, self._staging = {}, {}, None, None

    def _release(self, buffers: Collection[pinned.PinnedBuffer]) -> None:
        for buf in set(buffers):
            if buf.fd is not None:
                self._forget(buf)  # the process's mapping would keep the memory
            buf.release()

    def log_wait(self) -> None:
        if not self._waits_logged:
            self._waits_logged = True
            log.info("no spare device memory for the rest of an asynchronous save's snapshot: "
                     "the state's next write waits for the snapshot's copies")

    def retake(self, sources: dict[str, torch.Tensor], on_device: bool = False,
               hot: Collection[int] = ()) -> tuple[list[Job], Drain] | None:
        """Coordinator-free. The jobs of the last :meth:`take` and a drain of its copies
        anew from ``sources`` (the flat tensors the state lives in now, by name: see
        ``checkpoint.state.sources``), when they have the names, sizes and dtypes they had
        then; else None. Builds no per-param views. ``hot``: as for :meth:`take`."""
        plan = self._plan
        if plan is None or plan.key != _key(sources, on_device and self.cuda):
            return None
        pairs = [(self._buffers[r.dtype][r.at:r.at + r.numel],
                  sources[r.name].narrow(0, r.offset, r.numel)) for r in plan.runs]
        return plan.jobs, self._drain(pairs, hot)

    def take(self, jobs: Sequence[Job], on_device: bool = False,
             sources: dict[str, torch.Tensor] | None = None, hot: Collection[int] = ()
             ) -> tuple[list[Job], Drain]:
        """Coordinator-free. The jobs with the buffers (in device memory with ``on_device``
        and a GPU, else on the host) as their sources, and the :class:`Drain` that fills
        them. Each run of adjacent or overlapping elements of one storage is one copy;
        with ``sources`` the runs are recorded as pieces of them, for :meth:`retake`.
        ``hot``: the storages (addresses) that work queued after the call may write without
        going through the optimizer (module buffers a forward updates in place, BatchNorm's
        running statistics): copied at the call, and the current stream waits for them."""
        unique: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        for job in jobs:
            for e in job.entries:
                if e.source is not None:
                    unique.setdefault(_identity(e.source), e.source)
        runs = _runs(unique.values())
        sizes: dict[torch.dtype, int] = {}
        for run in runs:
            sizes[run.dtype] = sizes.get(run.dtype, 0) + run.numel
        self._allocate(sizes, on_device and self.cuda)
        offsets = dict.fromkeys(sizes, 0)
        pairs, copies = [], {}
        for run in runs:
            pos = offsets[run.dtype]
            offsets[run.dtype] = pos + run.numel
            dst = self._buffers[run.dtype][pos:pos + run.numel]
            pairs.append((dst, run.source()))
            for key, src in run.members:
                at = src.storage_offset() - run.start
                copies[key] = dst[at:at + src.numel()]
        out = [Job(job.name, [e if e.source is None else dataclasses.replace(
                   e, source=copies[_identity(e.source)]) for e in job.entries])
               for job in jobs]
        self._plan = None if sources is None else _Plan.of(runs, sources, out,
                                                           self.on_device)
        return out, self._drain(pairs, hot)

    def _allocate(self, sizes: dict[torch.dtype, int], on_device: bool) -> None:
        if {d: t.numel() for d, t in self._buffers.items()} == sizes and \
                on_device == self.on_device:
            return
        self.release()
        self.on_device = on_device
        for dtype, numel in sizes.items():
            if on_device:
                self._buffers[dtype] = torch.empty(numel, dtype=dtype, device=self.device)
            else:  # page-locked by the drain, piece by piece
                self._host[dtype] = pinned.PinnedBuffer(numel, dtype, shared=self.shared,
                                                        lock=False)
                self._buffers[dtype] = self._host[dtype].tensor

    def _drain(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], hot: Collection[int]
               ) -> Drain:
        """The pairs (destination, source) as a drain, ``hot`` sources' copies issued now
        (all of them for a device snapshot)."""
        if self.cuda and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        hot_pairs = [p for p in pairs if p[1].untyped_storage().data_ptr() in hot]
        ordered = hot_pairs + [p for p in pairs if p[1].untyped_storage().data_ptr() not in hot]
        into = {b.tensor.untyped_storage().data_ptr(): b for b in self._host.values()}
        copies = [Copy(_bytes(dst), _bytes(src), into.get(dst.untyped_storage().data_ptr()))
                  for dst, src in ordered]
        drain = Drain(copies, self.device, self._stream, self.log_wait)
        if self.on_device:
            drain.issue_now(len(copies))
        else:
            drain.keep_now(len(hot_pairs))
        return drain


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _identity(t: torch.Tensor) -> tuple[int, int, torch.dtype]:
    return (t.data_ptr(), t.numel(), t.dtype)


@dataclass(frozen=True)
class _PlanRun:
    """A run as ``numel`` elements at ``offset`` of source ``name``, at ``at`` of the buffer
    of its ``dtype``."""

    name: str
    offset: int
    numel: int
    dtype: torch.dtype
    at: int


@dataclass(frozen=True)
class _Plan:
    """A take's runs as pieces of named sources, and its jobs."""

    key: tuple
    runs: list[_PlanRun]
    jobs: list[Job]

    @classmethod
    def of(cls, runs: list[_Run], sources: dict[str, torch.Tensor], jobs: list[Job],
           on_device: bool) -> _Plan | None:
        """None when a run is not inside one source (e.g. a copy made for a
        non-contiguous frozen tensor): such a take is not repeated."""
        where = {(t.untyped_storage().data_ptr(), t.dtype): (name, t)
                 for name, t in sources.items() if t.dim() == 1 and t.is_contiguous()}
        pos: dict[torch.dtype, int] = {}
        out = []
        for run in runs:
            name, t = where.get((run.storage.data_ptr(), run.dtype), (None, None))
            at = pos.get(run.dtype, 0)
            pos[run.dtype] = at + run.numel
            if t is None or not (t.storage_offset() <= run.start
                                 and run.start + run.numel <= t.storage_offset() + t.numel()):
                return None
            out.append(_PlanRun(name, run.start - t.storage_offset(), run.numel, run.dtype, at))
        return cls(_key(sources, on_device), out, jobs)


def _key(sources: dict[str, torch.Tensor], on_device: bool) -> tuple:
    """What a plan depends on: each source's name, size and dtype, and which sources share
    storage, at which distance (a run copied once for two views of one storage must be
    planned anew when one of them gets storage of its own)."""
    first: dict[int, tuple[int, int]] = {}  # storage address -> (source index, its offset)
    out = []
    for i, (name, t) in enumerate(sources.items()):
        j, at = first.setdefault(t.untyped_storage().data_ptr(), (i, t.storage_offset()))
        out.append((name, t.numel(), t.dtype, j, t.storage_offset() - at))
    return (on_device, tuple(out))


class _Run:
    """Elements ``[start, start + numel)`` of one storage, covering the sources ``members``."""

    def __init__(self, key, src: torch.Tensor) -> None:
        self.storage, self.dtype, self.device = src.untyped_storage(), src.dtype, src.device
        self.start, self.numel = src.storage_offset(), src.numel()
        self.members = [(key, src)]

    def source(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=self.device).set_(
            self.storage, self.start, (self.numel,))


def _runs(sources) -> list[_Run]:
    """The sources (1-D, contiguous) as runs of adjacent or overlapping elements of one
    storage, each storage's runs in memory order."""
    ordered = sorted(((src.untyped_storage().data_ptr(), src.dtype, src.storage_offset(), src)
                      for src in sources), key=lambda x: (x[0], str(x[1]), x[2]))
    runs: list[_Run] = []
    for ptr, dtype, start, src in ordered:
        assert src.dim() == 1 and src.is_contiguous(), "snapshot sources are flat views"
        last = runs[-1] if runs else None
        if (last is not None and last.storage.data_ptr() == ptr and last.dtype == dtype
                and start <= last.start + last.numel):
            last.numel = max(last.numel, start + src.numel() - last.start)
            last.members.append((_identity(src), src))
        else:
            runs.append(_Run(_identity(src), src))
    return runs
