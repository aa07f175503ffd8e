"""The drain: an asynchronous save's snapshot copied while training goes on, and the
state-write hook that keeps the copy the state at the call (docs/async_save.md, The drain).

The background thread (:meth:`Drain.run`) copies each source into the host snapshot in
pieces of :data:`PIECE_BYTES`, :data:`IN_FLIGHT` in flight on a side stream, so that a small
device-to-host read of the training loop never waits behind more than a piece, and page-locks
each host buffer segment by segment just ahead of its pieces. The state's first write
(:meth:`~shardopt.optimizer.DistributedOptimizer.register_state_write_hook`) copies what is
not yet issued into spare device memory and the drain goes on from there; without spare
memory the write waits on the host for the drain. Off CUDA the same code runs with plain
copies.
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

# The drain's piece size and how many pieces it keeps in flight (read at each save).
PIECE_BYTES = 4 << 20
IN_FLIGHT = 1


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
        if self.piece_bytes < 1 or self.in_flight < 1:
            raise ValueError(f"drain pieces of {self.piece_bytes} bytes, {self.in_flight} in "
                             "flight: both must be at least 1")
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
