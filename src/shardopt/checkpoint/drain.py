"""The drain: an asynchronous save's snapshot copied while training goes on, and the
state-write hook that keeps the copy the state at the call (docs/async_save.md, The drain).

The background thread (:meth:`Drain.run`) copies each source into the host snapshot in
pieces of ``drain_piece_bytes``, ``drain_in_flight`` at a time on a side stream, page-locking
each host buffer segment by segment just ahead of its pieces; no piece crosses a segment.
The state's first write on the device (``step()``) copies what is not yet issued into spare
device memory and the drain goes on from there (without spare memory the write waits for the
drain); a write the host waits for (``offload()`` and the like) issues the rest into the
host snapshot and waits for it: nothing of the save stays on the device. Off CUDA the same
code runs with plain copies.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from .. import pinned
from ..optimizer import DistributedOptimizer


@dataclass(frozen=True)
class Piece:
    """``nbytes`` of a copy; ``end``: the byte of its host buffer where it ends (0: none)."""

    nbytes: int
    end: int


@dataclass(frozen=True)
class Copy:
    """Bytes ``src`` to be copied into ``dst`` (1-D uint8 views of one size); ``into``: the
    host buffer ``dst`` lies in, page-locked segment by segment by the drain."""

    dst: torch.Tensor
    src: torch.Tensor
    into: pinned.PinnedBuffer | None = None

    def piece(self, offset: int, limit: int | None) -> Piece:
        """The piece from byte ``offset``: at most ``limit`` bytes (None: no limit), never
        across a segment (:data:`~shardopt.pinned.SEGMENT_BYTES`) of ``into``."""
        n = self.dst.numel() - offset
        n = n if limit is None else min(limit, n)
        if self.into is None:
            return Piece(n, 0)
        at = self.dst.data_ptr() - self.into.tensor.data_ptr() + offset
        n = min(n, (at // pinned.SEGMENT_BYTES + 1) * pinned.SEGMENT_BYTES - at)
        return Piece(n, at + n)


class Drain:
    """The copies of one snapshot, issued by the background thread (:meth:`run`) in pieces,
    guarded until done by the optimizer's state-write hook (:meth:`attach`). Thread-safe."""

    def __init__(self, copies: list[Copy], device: torch.device,
                 stream: torch.cuda.Stream | None, on_wait: Callable[[], None],
                 piece_bytes: int, in_flight: int) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.piece_bytes, self.in_flight = piece_bytes, in_flight
        self.finished = threading.Event()  # every copy done (or the drain failed)
        self._copies = copies  # not yet issued, in order
        self._offset = 0  # bytes of the first of them already issued
        self._flight: collections.deque[torch.cuda.Event] = collections.deque()
        self._stream, self._on_wait = stream, on_wait
        self._lock = threading.Lock()
        self._locking = threading.Lock()  # held while host memory of the copies is locked
        self._handle: RemovableHandle | None = None
        self._spares: list[torch.Tensor] = []  # copies of sources that could change
        self._moved = False  # every copy not yet issued reads a spare copy
        self._ready = None
        if self.cuda:  # the sources are final once the work queued so far has run
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(device))
            stream.wait_event(self._ready)

    def issue_now(self, count: int) -> None:
        """Issue the first ``count`` copies now (pieces into host memory not yet page-locked
        are synchronous); the current stream waits for them."""
        with self._lock, self._locking:
            self._issue_all(len(self._copies) - count)
            if self._flight:
                torch.cuda.current_stream(self.device).wait_event(self._flight[-1])

    def keep_now(self, count: int) -> None:
        """Take the sources of the first ``count`` copies now, into spare memory (the drain
        goes on from there), or by :meth:`issue_now` where it cannot be had."""
        with self._lock:
            if not count or self._move(count):
                return
        self.issue_now(count)

    def attach(self, opt: DistributedOptimizer) -> None:
        """Guard ``opt``'s state until every copy is done."""
        self._handle = opt.register_state_write_hook(self._before_write)

    def run(self) -> None:
        """Coordinator-free; the background thread. Issue the copies in pieces and return
        when every copy is done; the hook goes then, and if this raises."""
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
                    c = self._copies[0]
                    end = c.piece(self._offset, self.piece_bytes).end
                self._prepare(c.into, end)  # outside the lock: the step never waits for it
                with self._lock:
                    if self._copies:
                        self._issue(self.piece_bytes)
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
            with self._locking:
                into.lock_to(end)

    def _issue(self, limit: int | None) -> None:
        c, lo = self._copies[0], self._offset
        hi = lo + c.piece(lo, limit).nbytes
        self._copy(c.dst[lo:hi], c.src[lo:hi])
        self._offset = hi
        if hi == c.dst.numel():
            self._copies.pop(0)
            self._offset = 0

    def _issue_all(self, keep: int) -> None:
        """Issue every copy but the last ``keep`` in pieces of a segment at most."""
        while len(self._copies) > keep:
            self._issue(None)

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
        """The state-write hook (module docstring); ``host``: the host waits for it."""
        if host:
            self._finish()
            return
        with self._lock:
            if self._handle is None or self._moved:  # done, or the sources are copies
                return
            if self._move(len(self._copies)):
                self._moved = True
                return
        self._on_wait()
        self.finished.wait()

    def _finish(self) -> None:
        """Issue the rest into the host snapshot now and wait for every copy; the hook and
        the spare memory go."""
        with self._lock, self._locking:
            if self._handle is None:
                return
            self._issue_all(0)
            events = list(self._flight)
        for event in events:
            event.synchronize()
        with self._lock:
            self._spares = []  # nothing reads them any more
            handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()

    def _move(self, count: int) -> bool:
        """Copy what the first ``count`` copies read into spare memory on the current stream
        (after the pieces in flight) and drain them from there; False without the memory."""
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
        return True


def _spare(nbytes: int, device: torch.device) -> torch.Tensor | None:
    """``nbytes`` of spare memory on ``device``, or None where they cannot be had."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        return None
