"""Host snapshot of what one rank's asynchronous save writes, taken at the call.

Adam state and params change only inside ``step()`` (and ``load``,
``load_state_dict``, ``offload()``, ``reload_model_params()``), so a copy queued at
the call, before any of those runs again, is exactly the state at the call while
training goes on.

Memory: one buffer per dtype, each exactly the bytes of this rank's entries of that
dtype (its model shards, fp32 main params and moments, rank 0's frozen tensors; a tensor
saved under two keys, like an fp32 param that is its own main param, is copied once),
allocated at the first asynchronous save and reused by the next ones while the sizes stay
the same. ``snapshot="host"`` (default): host memory, page-locked with
:class:`~shardopt.pinned.PinnedBuffer` when the optimizer is on a GPU (exact size: no
power-of-two rounding), and shared (memfd) where the writer process can map it
(:mod:`.writer_process`). ``snapshot="device"``: spare GPU memory, a device-to-device copy
(about 40x faster than over PCIe, so the next ``step()`` hardly waits); the background
thread then copies each buffer to a page-locked host buffer of its size in one copy
(:meth:`Snapshot.drain`: a few calls, asleep while they run, so it takes next to nothing
from the training thread) and writes from there, as for ``"host"``: one copy of the state
in GPU memory and one in host memory. ``snapshot="device_staged"``: the GPU copy is
streamed to the files through one small page-locked staging buffer (``staging_bytes``,
:meth:`Snapshot.staging`), so the host holds no copy of the state: the background thread
fills its slots and the writer process writes them
(:meth:`.writer_process.WriterProcess.stream_files`).

What is copied: runs of adjacent elements of the few flat tensors the state lives in (a
rank's shard of each bucket is contiguous), not one copy per param and state. A later save
whose state lives in tensors of the same names, sizes and dtypes (after steps, offload, a
load) repeats those copies from wherever the tensors are now (:meth:`Snapshot.retake`) and
builds no per-param views at all; anything else (a frozen tensor added, the moments
allocated) plans anew.

Copies (CUDA): queued on a side stream behind the work already queued on the current
stream, so the call returns at once. The :class:`SaveFence` they return is the optimizer's
state-write hook (:meth:`~shardopt.optimizer.DistributedOptimizer.register_state_write_hook`)
until the copies are done: the first write after the call (``step()``'s update) makes the
current stream wait for all of them (the host does not wait), what frees the state or writes
it from the host waits on the host; the background writer waits on the host for the copies
before reading the buffers. Off CUDA the copies are plain, finished at once.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch
from torch.utils.hooks import RemovableHandle

from ..pinned import PinnedBuffer
from . import writer_process
from .storage import WriteEntry

if TYPE_CHECKING:
    from ..optimizer import DistributedOptimizer

Job = tuple[str, list[WriteEntry]]  # a file name and the entries it holds


class SaveFence:
    """The copies of one asynchronous save, queued on one stream, and the event after the
    last of them. Registered as the optimizer's state-write hook (:meth:`attach`) until the
    first write waits for the copies or the background writer has seen them done."""

    def __init__(self, done: torch.cuda.Event, device: torch.device) -> None:
        self.done, self.device = done, device
        self._handle: RemovableHandle | None = None
        self._lock = threading.Lock()  # the training and the background thread detach

    def attach(self, opt: DistributedOptimizer) -> None:
        """Make ``opt``'s next write or free of its state wait for the copies."""
        self._handle = opt.register_state_write_hook(self._before_write)

    def _before_write(self, host: bool) -> None:
        """The host (``host``) or the current CUDA stream waits for every copy; whatever is
        queued after that wait is behind the copies, so the hook goes."""
        if host:
            self.done.synchronize()
        else:
            torch.cuda.current_stream(self.device).wait_event(self.done)
        self.detach()

    def finish(self) -> None:
        """The background writer: the host waits for the copies; no write need wait after."""
        self.done.synchronize()
        self.detach()

    def detach(self) -> None:
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()


class Snapshot:
    """Reused host buffers for one optimizer's asynchronous saves (one at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.on_device = False  # where the buffers are: spare device memory, or the host
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self._pinned: dict[torch.dtype, PinnedBuffer] = {}
        self._drained: dict[torch.dtype, PinnedBuffer] = {}  # host copies of device buffers
        self._staging: PinnedBuffer | None = None  # what device_staged saves stream through
        self._stream: torch.cuda.Stream | None = None
        self._drain_stream: torch.cuda.Stream | None = None
        self._plan: _Plan | None = None  # the last take, to repeat with the same buffers
        # Writes the files from the buffers, which are shared memory where it can run.
        self.writer = writer_process.WriterProcess()

    def nbytes(self) -> int:
        """Memory the snapshot holds (kept between saves), on the device or the host."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def host_nbytes(self) -> int:
        """Host memory a device snapshot keeps between saves: :meth:`drain`'s copies and
        the :meth:`staging` buffer."""
        staging = self._staging.tensor.numel() if self._staging is not None else 0
        return staging + sum(b.tensor.numel() * b.tensor.element_size()
                             for b in self._drained.values())

    def host_buffers(self) -> list[PinnedBuffer]:
        """The host buffers the entries of the last take (drained, for a device snapshot)
        lie in: shared memory the writer process can map (:mod:`.writer_process`)."""
        return list((self._drained if self.on_device else self._pinned).values())

    def staging(self, nbytes: int) -> PinnedBuffer:
        """A page-locked, shared host buffer of ``nbytes`` that ``"device_staged"`` saves
        stream the device copy through (:meth:`~.writer_process.WriterProcess.stream_files`), kept and
        reused while the size stays."""
        if self._staging is None or self._staging.tensor.numel() != nbytes:
            _release(self.writer, [self._staging] if self._staging is not None else [])
            self._staging = PinnedBuffer(nbytes, torch.uint8, shared=self.writer.available,
                                         lock=self.cuda)
        return self._staging

    def release(self) -> None:
        _release(self.writer, [*self._pinned.values(), *self._drained.values(),
                  *([self._staging] if self._staging is not None else [])])
        self._buffers, self._pinned, self._drained, self._plan = {}, {}, {}, None
        self._staging = None

    def drain(self, jobs: list[Job]) -> list[Job]:
        """Coordinator-free; run by the background writer after the snapshot's copies. For
        a snapshot in device memory: copy each buffer to a page-locked host buffer of its
        size (allocated at the first drain, reused while the sizes stay), one copy per
        buffer on a side stream, the thread asleep until they are done; return ``jobs``
        with their sources moved to the host copies. Otherwise ``jobs`` as they are."""
        if not self.on_device:
            return jobs
        if {d: b.tensor.numel() for d, b in self._drained.items()} != \
                {d: t.numel() for d, t in self._buffers.items()}:
            _release(self.writer, self._drained.values())
            self._drained = {d: PinnedBuffer(t.numel(), d, shared=self.writer.available)
                             for d, t in self._buffers.items()}
        if self._drain_stream is None:
            self._drain_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._drain_stream):
            for dtype, buf in self._buffers.items():
                self._drained[dtype].tensor.copy_(buf, non_blocking=True)
        done = torch.cuda.Event(blocking=True)
        done.record(self._drain_stream)
        done.synchronize()

        def host(src: torch.Tensor) -> torch.Tensor:
            buf = self._buffers[src.dtype]
            at = (src.data_ptr() - buf.data_ptr()) // src.element_size()
            return self._drained[src.dtype].tensor[at:at + src.numel()]
        return [(name, [e if e.source is None or not e.source.is_cuda else  # not RNG state
                        WriteEntry(e.key, e.dtype, e.numel, e.offset, host(e.source))
                        for e in entries]) for name, entries in jobs]

    def retake(self, sources: dict[str, torch.Tensor], on_device: bool = False,
               hot: Collection[int] = ()) -> tuple[list[Job], SaveFence | None] | None:
        """Coordinator-free. The jobs of the last :meth:`take` again, with its copies queued
        anew from ``sources`` (the flat tensors the state lives in now, by name; see
        ``shard_state.sources()``), when they have
        the names, sizes and dtypes they had then; else None. The entries' pieces of the
        sources depend on the layout alone, so they are where they were: this builds no
        per-param views, which keeps the call of a repeated save to a few copies. ``hot``:
        as for :meth:`take`."""
        plan = self._plan
        if plan is None or plan.key != _key(sources, on_device and self.cuda):
            return None
        pairs = [(self._buffers[dtype][pos:pos + n], sources[name].narrow(0, rel, n))
                 for name, rel, n, dtype, pos in plan.runs]
        return plan.jobs, self._copy(pairs, hot)

    def take(self, jobs: Sequence[Job], on_device: bool = False,
             sources: dict[str, torch.Tensor] | None = None, hot: Collection[int] = ()
             ) -> tuple[list[Job], SaveFence | None]:
        """Coordinator-free. Queue copies of every entry's source into the buffers (in
        device memory with ``on_device`` and a GPU, else on the host); return the jobs with
        the copies as sources and the :class:`SaveFence` of the copies (None off CUDA:
        already there).

        The sources are mostly adjacent views of a few flat buffers (a rank's shard of each
        bucket): each run of adjacent or overlapping elements of one storage is copied at
        once, a few large copies instead of one per param and state, which keeps the call
        short. With ``sources``, the runs are also recorded as pieces of them, for
        :meth:`retake`. ``hot``: the storages (addresses) that work queued after the call
        may write without going through the optimizer (module buffers, which a forward
        updates in place: BatchNorm's running statistics); their copies are queued first and
        the current stream waits for them (the host does not)."""
        unique: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        for _, entries in jobs:
            for e in entries:
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
        event = self._copy(pairs, hot)
        out = [(name, [e if e.source is None else
                       WriteEntry(e.key, e.dtype, e.numel, e.offset, copies[_identity(e.source)])
                       for e in entries])
               for name, entries in jobs]
        self._plan = None if sources is None else _Plan.of(runs, sources, out,
                                                           self.on_device)
        return out, event

    def _allocate(self, sizes: dict[torch.dtype, int], on_device: bool) -> None:
        if {d: t.numel() for d, t in self._buffers.items()} == sizes and \
                on_device == self.on_device:
            return
        self.release()
        self.on_device = on_device
        for dtype, numel in sizes.items():
            if on_device:
                self._buffers[dtype] = torch.empty(numel, dtype=dtype, device=self.device)
            else:  # page-locked for copies from a GPU; shared with the writer process
                self._pinned[dtype] = PinnedBuffer(numel, dtype, shared=self.writer.available,
                                                   lock=self.cuda)
                self._buffers[dtype] = self._pinned[dtype].tensor

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], hot: Collection[int] = ()
              ) -> SaveFence | None:
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src.detach().reshape(-1))
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        # The sources are final once the work queued so far on the current stream has run.
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        hot_pairs, cold_pairs = _hot_first(pairs, hot)
        hot_done = None
        with torch.cuda.stream(self._stream):
            for dst, src in hot_pairs:  # first: the current stream waits for them alone
                dst.copy_(src.detach().reshape(-1), non_blocking=True)
            if hot_pairs:
                hot_done = torch.cuda.Event()
                hot_done.record(self._stream)
            for dst, src in cold_pairs:
                dst.copy_(src.detach().reshape(-1), non_blocking=True)
        if hot_done is not None:
            # The next forward must not update a buffer before its copy has read it.
            current.wait_event(hot_done)
        # Blocking: the background writer waits on it for as long as the copies take, asleep
        # (a spinning wait would take a core from the training loop).
        done = torch.cuda.Event(blocking=True)
        done.record(self._stream)
        return SaveFence(done, self.device)


def _hot_first(pairs: list[tuple[torch.Tensor, torch.Tensor]], hot: Collection[int] = ()
               ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                          list[tuple[torch.Tensor, torch.Tensor]]]:
    """``pairs`` (destination, source) split into those whose source lies in a ``hot``
    storage (by address), copied first, and the others, each in their given order."""
    hot_pairs = [pair for pair in pairs if pair[1].untyped_storage().data_ptr() in hot]
    return hot_pairs, [pair for pair in pairs if pair[1].untyped_storage().data_ptr() not in hot]


def _release(writer: writer_process.WriterProcess, buffers) -> None:
    for buf in buffers:
        if buf.fd is not None:
            writer.forget(buf)  # the process's mapping would keep the memory
        buf.release()


def _identity(t: torch.Tensor) -> tuple[int, int, torch.dtype]:
    return (t.data_ptr(), t.numel(), t.dtype)


class _Plan:
    """A take's runs as pieces of named sources, its buffer positions and its jobs."""

    def __init__(self, key, runs, jobs) -> None:
        self.key, self.runs, self.jobs = key, runs, jobs

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
            out.append((name, run.start - t.storage_offset(), run.numel, run.dtype, at))
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
