"""The snapshot of what one rank's asynchronous save writes: the state at the call, copied
while training goes on (docs/async_save.md, Memory and who writes).

One host buffer per dtype of exactly this rank's entries (a tensor saved under two keys is
copied once), shared with the writer process where it can run, filled by a
:class:`~.drain.Drain`. Each run of adjacent elements of the flat tensors the state lives in
is one copy; a later save of tensors of the same names, sizes and dtypes repeats them
(:meth:`Snapshot.retake`). :meth:`Snapshot.prepare` allocates the buffers ahead.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import pinned
from .config import CheckpointConfig
from .drain import Copy, Drain
from .storage import Job

log = logging.getLogger("shardopt.checkpoint")


@dataclass(frozen=True)
class Taken:
    """A snapshot's jobs (the save's entries, their sources in the host buffers) and the
    drain that fills them."""

    jobs: list[Job]
    drain: Drain


class Snapshot:
    """Reused host buffers for one optimizer's asynchronous saves (one at a time).
    ``forget``: told of each shared buffer released (the writer process unmaps it)."""

    def __init__(self, device: torch.device, shared: bool,
                 forget: Callable[[pinned.PinnedBuffer], None]) -> None:
        self.device, self.shared, self._forget = device, shared, forget
        self.cuda = device.type == "cuda"
        self._host: dict[torch.dtype, pinned.PinnedBuffer] = {}
        self._stream: torch.cuda.Stream | None = None
        self._plan: _Plan | None = None  # the last take, to repeat with the same buffers
        self._waits_logged = False
        self._prepared = False  # the buffers held are prepare()'s, no take has differed

    def host_nbytes(self) -> int:
        """Host memory kept between saves."""
        return sum(b.nbytes for b in self._host.values())

    def host_buffers(self) -> list[pinned.PinnedBuffer]:
        """The buffers the entries of the last take lie in."""
        return list(self._host.values())

    def prepare(self, sizes: dict[torch.dtype, int]) -> None:
        """Buffers of ``sizes`` (elements by dtype: :func:`buffer_sizes`), page-locked now
        on a GPU, for the next :meth:`take` of those sizes (those held are kept where they
        have them). Where an allocation fails none is held, and it raises."""
        try:
            if self._sizes() != sizes:
                self.release()
                self._fill(sizes, lock=self.cuda)
            elif self.cuda:  # a save's drain may have left them partly locked
                for buf in self._host.values():
                    buf.lock_to(buf.nbytes)
        except BaseException:
            self.release()
            raise
        self._prepared = True

    def release(self) -> None:
        """Free every buffer (after the copies queued into them)."""
        if self._stream is not None:
            self._stream.synchronize()
        for buf in self._host.values():
            if buf.fd is not None:
                self._forget(buf)  # the process's mapping would keep the memory
            buf.release()
        self._host, self._plan, self._prepared = {}, None, False

    def log_wait(self) -> None:
        if not self._waits_logged:
            self._waits_logged = True
            log.info("no spare device memory for the rest of an asynchronous save's snapshot: "
                     "the state's next write waits for the snapshot's copies")

    def retake(self, sources: dict[str, torch.Tensor], cfg: CheckpointConfig,
               hot: Collection[int] = ()) -> Taken | None:
        """Coordinator-free. The last :meth:`take` repeated from ``sources`` (the flat
        tensors the state lives in now, by name: :func:`.state.sources`) when they have the
        names, sizes and dtypes they had then, else None; ``hot`` as for :meth:`take`."""
        plan = self._plan
        if plan is None or plan.key != _key(sources):
            return None
        pairs = [(self._host[r.dtype].tensor[r.at:r.at + r.numel],
                  sources[r.name].narrow(0, r.offset, r.numel)) for r in plan.runs]
        return Taken(plan.jobs, self._drain(pairs, hot, cfg))

    def take(self, jobs: Sequence[Job], cfg: CheckpointConfig,
             sources: dict[str, torch.Tensor] | None = None, hot: Collection[int] = ()) -> Taken:
        """Coordinator-free. The jobs with the host buffers as their sources, one copy per
        run of adjacent or overlapping elements of a storage; with ``sources`` the runs are
        recorded as pieces of them, for :meth:`retake`. ``hot``: the storages (addresses)
        queued work may write bypassing the optimizer (module buffers): copied at the call."""
        out, pairs = self._planned(jobs, sources)
        return Taken(out, self._drain(pairs, hot, cfg))

    def plan(self, jobs: Sequence[Job], sources: dict[str, torch.Tensor]) -> None:
        """Coordinator-free. Plan :meth:`take` of ``jobs`` from ``sources`` now, into the
        buffers held where they have the sizes (:meth:`prepare`), so that the next save
        repeats the plan (:meth:`retake`) instead of making it."""
        self._planned(jobs, sources)

    def _planned(self, jobs: Sequence[Job], sources: dict[str, torch.Tensor] | None
                 ) -> tuple[list[Job], list[tuple[torch.Tensor, torch.Tensor]]]:
        unique: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        for job in jobs:
            for e in job.entries:
                if e.source is not None:
                    unique.setdefault(_identity(e.source), e.source)
        runs = _runs(unique.values())
        sizes = _sizes(run.extent for run in runs)
        self._allocate(sizes)
        offsets = dict.fromkeys(sizes, 0)
        pairs, copies = [], {}
        for run in runs:
            e = run.extent
            pos = offsets[e.dtype]
            offsets[e.dtype] = pos + e.numel
            dst = self._host[e.dtype].tensor[pos:pos + e.numel]
            pairs.append((dst, run.source()))
            for src in run.members:
                at = src.storage_offset() - e.start
                copies[_identity(src)] = dst[at:at + src.numel()]
        out = [Job(job.name, [e if e.source is None else dataclasses.replace(
                   e, source=copies[_identity(e.source)]) for e in job.entries])
               for job in jobs]
        self._plan = None if sources is None else _Plan.of(runs, sources, out)
        return out, pairs

    def _sizes(self) -> dict[torch.dtype, int]:
        return {d: b.tensor.numel() for d, b in self._host.items()}

    def _allocate(self, sizes: dict[torch.dtype, int]) -> None:
        if self._sizes() == sizes:
            return
        if self._prepared:
            log.info("this asynchronous save's snapshot differs from the host buffers "
                     "checkpoint.prepare allocated (other sizes): it is allocated anew%s",
                     " and page-locked by the drain while training runs" if self.cuda else "")
        self.release()
        self._fill(sizes, lock=False)  # page-locked by the drain

    def _fill(self, sizes: dict[torch.dtype, int], lock: bool) -> None:
        for dtype, numel in sizes.items():
            self._host[dtype] = pinned.PinnedBuffer(numel, dtype, shared=self.shared, lock=lock)

    def _drain(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], hot: Collection[int],
               cfg: CheckpointConfig) -> Drain:
        """The pairs (destination, source) as a drain, ``hot`` sources' copies taken now."""
        if self.cuda and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        first = [p for p in pairs if p[1].untyped_storage().data_ptr() in hot]
        ordered = first + [p for p in pairs if p[1].untyped_storage().data_ptr() not in hot]
        into = {b.tensor.untyped_storage().data_ptr(): b for b in self._host.values()}
        copies = [Copy(_bytes(dst), _bytes(src), into.get(dst.untyped_storage().data_ptr()))
                  for dst, src in ordered]
        drain = Drain(copies, self.device, self._stream, self.log_wait,
                      cfg.drain_piece_bytes, cfg.drain_in_flight)
        drain.keep_now(len(first))
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
    def of(cls, runs: list[_Run], sources: dict[str, torch.Tensor], jobs: list[Job]
           ) -> _Plan | None:
        """None when a run is not inside one source (e.g. a copy made for a
        non-contiguous frozen tensor): such a take is not repeated."""
        where = {(t.untyped_storage().data_ptr(), t.dtype): (name, t)
                 for name, t in sources.items() if t.dim() == 1 and t.is_contiguous()}
        pos: dict[torch.dtype, int] = {}
        out = []
        for run in runs:
            e = run.extent
            name, t = where.get((e.storage, e.dtype), (None, None))
            at = pos.get(e.dtype, 0)
            pos[e.dtype] = at + e.numel
            if t is None or not (t.storage_offset() <= e.start
                                 and e.start + e.numel <= t.storage_offset() + t.numel()):
                return None
            out.append(_PlanRun(name, e.start - t.storage_offset(), e.numel, e.dtype, at))
        return cls(_key(sources), out, jobs)


def _key(sources: dict[str, torch.Tensor]) -> tuple:
    """What a plan depends on: each source's name, size and dtype, and which sources share
    storage, at which distance (a run copied once for two views of one storage must be
    planned anew when one of them gets storage of its own)."""
    first: dict[int, tuple[int, int]] = {}  # storage address -> (source index, its offset)
    out = []
    for i, (name, t) in enumerate(sources.items()):
        j, at = first.setdefault(t.untyped_storage().data_ptr(), (i, t.storage_offset()))
        out.append((name, t.numel(), t.dtype, j, t.storage_offset() - at))
    return tuple(out)


@dataclass(frozen=True)
class Extent:
    """Elements ``[start, start + numel)`` of ``dtype`` of one storage, named by ``storage``:
    its address, or any negative number for storage yet to be allocated."""

    storage: int
    dtype: torch.dtype
    start: int
    numel: int

    @classmethod
    def of(cls, t: torch.Tensor) -> Extent:
        return cls(t.untyped_storage().data_ptr(), t.dtype, t.storage_offset(), t.numel())


def buffer_sizes(extents: Iterable[Extent]) -> dict[torch.dtype, int]:
    """Elements by dtype of the buffers a :meth:`Snapshot.take` of sources at ``extents``
    allocates."""
    return _sizes(run.extent for run in _merge((e, e) for e in extents))


def _sizes(runs: Iterable[Extent]) -> dict[torch.dtype, int]:
    sizes: dict[torch.dtype, int] = {}
    for run in runs:
        sizes[run.dtype] = sizes.get(run.dtype, 0) + run.numel
    return sizes


@dataclass(frozen=True)
class _Run:
    """A run of elements of one storage, covering ``members`` (sources, or extents)."""

    extent: Extent
    members: list[Any]

    def source(self) -> torch.Tensor:
        m, e = self.members[0], self.extent
        return torch.empty(0, dtype=e.dtype, device=m.device).set_(
            m.untyped_storage(), e.start, (e.numel,))


def _runs(sources: Iterable[torch.Tensor]) -> list[_Run]:
    """The sources (1-D, contiguous) as runs (:func:`_merge`)."""
    sources = list(sources)
    for src in sources:
        assert src.dim() == 1 and src.is_contiguous(), "snapshot sources are flat views"
    return _merge((Extent.of(s), s) for s in sources)


def _merge(items: Iterable[tuple[Extent, Any]]) -> list[_Run]:
    """Extents, each with what it belongs to, merged into runs of adjacent or overlapping
    elements of one storage, each storage's runs in memory order."""
    runs: list[_Run] = []
    for e, item in sorted(items, key=lambda x: (x[0].storage, str(x[0].dtype), x[0].start)):
        last = runs[-1].extent if runs else None
        if (last is not None and (last.storage, last.dtype) == (e.storage, e.dtype)
                and e.start <= last.start + last.numel):
            end = max(last.numel, e.start + e.numel - last.start)
            runs[-1].members.append(item)
            runs[-1] = _Run(dataclasses.replace(last, numel=end), runs[-1].members)
        else:
            runs.append(_Run(e, [item]))
    return runs
