"""Ways to copy a device buffer into page-locked host memory while training runs (for
``d2h_stall.py``): each a :class:`Strategy` whose :meth:`Strategy.start` queues the copy of
``Buffers.src`` into ``Buffers.dst`` and returns at once with a :class:`Running` copy.

How the bytes move:

* ``queued``: ``copy_`` (``cudaMemcpyAsync`` device to host, a copy engine) in pieces of
  ``piece`` bytes, all queued at once on ``streams`` side streams (round robin), an event
  after each piece, as ``shardopt.checkpoint.snapshot`` queues a save's copies.
* ``thread``: the same pieces issued by a host thread that keeps ``in_flight`` of them queued
  (it sleeps on a blocking event of the piece ``in_flight`` back before it issues the next).
  ``paced_<piece>_<in flight>``: small pieces (1-4 MiB), 1 or 2 in flight; with 1 the copy
  stream's queue runs empty between every two pieces, for as long as the thread takes to wake
  and issue the next.
* ``uva``: ``copy_`` into a CUDA tensor that aliases the pinned memory (its UVA address), so
  torch issues a device-to-device ``cudaMemcpyAsync`` whose destination is host memory.
* ``kernel``: a Triton kernel of ``ctas`` programs, each looping over the blocks of a piece
  (grid stride), whose stores go through the SMs to the mapped pinned memory over PCIe; no
  copy engine. Without Triton: ``torch.bitwise_or(src, 0, out=view)`` on the UVA view (a
  kernel over every SM; ``Running.kernel`` says which ran).
* ``d2d`` first (``d2d="ce"``: one ``copy_`` per piece into spare device memory;
  ``d2d="kernel"``: the Triton kernel over 4 programs per SM), then the drain above from the
  device copy (``d2d_only``: no drain).

Side streams have the default priority, which is also the lowest CUDA has (0: no stream
ranks below the training stream, and torch refuses a positive one), or with
``priority="high"`` the highest. Off CUDA (code paths only) copies run in order on the host,
streams are None and events are clock readings. :data:`STRATEGIES` names the ways the probe
measures; :func:`fill` and :func:`check` give each repetition a pattern of its own and check
the copy.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

MIB = 1 << 20
GIB = 1 << 30
_BLOCK = 2048  # int32 elements per program per loop step of the copy kernel (8 KiB)


@dataclass(frozen=True)
class Buffers:
    """What every strategy copies: ``src`` (device, uint8) into ``dst`` (page-locked host,
    uint8, same size); ``spare``: device memory of that size for a device copy first (None:
    strategies with ``d2d`` cannot run); ``dst_view``: ``dst`` as a CUDA tensor (None where
    torch would not make one)."""

    src: torch.Tensor
    dst: torch.Tensor
    spare: torch.Tensor | None
    dst_view: torch.Tensor | None


class _Clock:
    """An event off CUDA: the host clock when recorded."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, later: _Clock) -> float:
        return (later.t - self.t) * 1e3


def side_stream(device: torch.device, priority: str):
    if device.type != "cuda":
        return None
    # torch maps a priority past the highest to the highest
    return torch.cuda.Stream(device, priority=-(1 << 10) if priority == "high" else 0)


def on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _mark(stream, blocking: bool = False):
    if stream is None:
        return _Clock()
    event = torch.cuda.Event(enable_timing=True, blocking=blocking)
    event.record(stream)
    return event


_KERNEL: dict[str, Any] = {}


def triton_kernel():
    """The grid-stride copy kernel (compiled at first use), or None without Triton."""
    if "k" not in _KERNEL:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _KERNEL["k"] = None
            return None

        @triton.jit
        def copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
            nblocks = tl.cdiv(n, BLOCK)
            for b in range(tl.program_id(0), nblocks, tl.num_programs(0)):
                offs = b * BLOCK + tl.arange(0, BLOCK)  # int32: pieces under 8 GiB
                mask = offs < n
                tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)

        _KERNEL["k"] = copy_kernel
    return _KERNEL["k"]


def kernel_copy(dst: torch.Tensor, src: torch.Tensor, ctas: int) -> str:
    """Queue ``dst.copy_(src)`` (uint8, sizes a multiple of 4; ``dst`` device memory or the
    CUDA view of pinned memory) on the current stream as a kernel of ``ctas`` programs;
    returns which kernel ran."""
    kernel = triton_kernel()
    if kernel is not None:
        s32, d32 = src.view(torch.int32), dst.view(torch.int32)
        assert s32.numel() < 1 << 31, "the kernel's offsets are int32"
        kernel[(ctas,)](s32, d32, s32.numel(), BLOCK=_BLOCK, num_warps=4)
        return "triton"
    if src.is_cuda and not dst.is_cuda:
        raise RuntimeError("no Triton and no CUDA view of the pinned memory: no copy kernel")
    torch.bitwise_or(src.view(torch.int32), 0, out=dst.view(torch.int32))
    return "torch.bitwise_or"


def cuda_view(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor | None, str]:
    """``host`` (page-locked) as a CUDA tensor of the same memory through its UVA address,
    and how it was made (or why not)."""
    if device.type != "cuda":
        return None, "CUDA only"
    ptr, why = host.data_ptr(), "UVA: the host address"
    try:
        from cuda.bindings import runtime as cudart  # type: ignore[import-not-found]

        err, dev_ptr = cudart.cudaHostGetDevicePointer(ptr, 0)
        if int(err) == 0:
            ptr, why = int(dev_ptr), f"cudaHostGetDevicePointer (same as host: {dev_ptr == ptr})"
    except Exception as e:  # noqa: BLE001 - cuda-bindings absent or different: UVA address
        why += f" (cuda.bindings: {type(e).__name__})"

    class _Interface:
        __cuda_array_interface__ = {"shape": (host.numel(),), "typestr": "|u1",
                                    "data": (ptr, False), "version": 3, "strides": None}
    try:
        view = torch.as_tensor(_Interface(), device=device)
    except Exception as e:  # noqa: BLE001 - recorded: the strategies that need it are skipped
        return None, f"no CUDA view: {type(e).__name__}: {e}"
    return view, why


@dataclass(frozen=True)
class Strategy:
    """One way to copy (module docstring). ``piece``: bytes per copy or kernel launch."""

    name: str
    how: str  # "queued", "thread", "uva", "kernel", "none" (d2d_only)
    piece: int = 256 * MIB
    streams: int = 1
    in_flight: int = 2
    priority: str = "default"  # or "high"
    ctas: int = 16
    d2d: str = ""  # "", "ce", "kernel"

    def start(self, buf: Buffers, device: torch.device) -> Running:
        return Running(self, buf, device)


class Running:
    """A copy in flight: :meth:`wait` for it, then :meth:`timings`."""

    def __init__(self, s: Strategy, buf: Buffers, device: torch.device) -> None:
        self.s, self.buf, self.device = s, buf, device
        self.kernel = ""
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        cuda = device.type == "cuda"
        current = torch.cuda.current_stream(device) if cuda else None
        self.streams = [side_stream(device, s.priority) for _ in range(max(1, s.streams))]
        first = self.streams[0]
        if cuda:  # the source is final once the work queued so far has run
            first.wait_stream(current)
        self.t0 = _mark(first)
        source = buf.src
        self.d2d_end = None
        if s.d2d:
            if buf.spare is None:
                raise RuntimeError(f"{s.name}: no spare device memory for the device copy")
            ctas = 4 * (torch.cuda.get_device_properties(device).multi_processor_count
                        if cuda else 1)
            with on(first):
                for lo in range(0, buf.src.numel(), s.piece):
                    hi = min(lo + s.piece, buf.src.numel())
                    if s.d2d == "ce":
                        buf.spare[lo:hi].copy_(buf.src[lo:hi], non_blocking=True)
                    else:
                        kernel_copy(buf.spare[lo:hi], buf.src[lo:hi], ctas)
            self.d2d_end = _mark(first)
            source = buf.spare
        # The drain may run on a stream of another priority than the device copy's.
        drain = first if not s.d2d else side_stream(device, s.priority)
        if s.d2d and cuda:
            drain.wait_event(self.d2d_end)
            self.streams = [drain]
        self.drain_start = _mark(drain) if s.d2d else self.t0
        pieces = [(lo, min(lo + s.piece, source.numel())) for lo in range(0, source.numel(),
                                                                        s.piece)]
        self.source = source
        self.end = None
        if s.how == "thread":
            self.thread = threading.Thread(target=self._feed, args=(drain, pieces),
                                           name=f"feed-{s.name}", daemon=True)
            self.thread.start()
        else:
            self._queue(pieces)

    def _copy_piece(self, lo: int, hi: int) -> None:
        s, buf = self.s, self.buf
        if s.how == "kernel":
            target = buf.dst_view if buf.dst_view is not None else buf.dst
            self.kernel = kernel_copy(target[lo:hi], self.source[lo:hi], s.ctas)
        elif s.how == "uva":
            buf.dst_view[lo:hi].copy_(self.source[lo:hi], non_blocking=True)
        elif s.how in ("queued", "thread"):
            buf.dst[lo:hi].copy_(self.source[lo:hi], non_blocking=True)

    def _queue(self, pieces: list[tuple[int, int]]) -> None:
        first = self.streams[0]
        for k, (lo, hi) in enumerate(pieces):
            stream = self.streams[k % len(self.streams)]
            if stream is not first and k < len(self.streams):
                stream.wait_event(self.t0)
            with on(stream):
                self._copy_piece(lo, hi)
            _mark(stream)  # an event after every piece, as a save's fence has
        for stream in self.streams[1:]:
            if stream is not None:
                first.wait_stream(stream)
        self.end = _mark(first, blocking=True)

    def _feed(self, stream, pieces: list[tuple[int, int]]) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            marks = []
            for k, (lo, hi) in enumerate(pieces):
                if k >= self.s.in_flight:
                    marks[k - self.s.in_flight].synchronize()  # asleep: a blocking event
                with on(stream):
                    self._copy_piece(lo, hi)
                marks.append(_mark(stream, blocking=True))
            self.end = marks[-1] if marks else _mark(stream, blocking=True)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait()
            self.error = e

    def done(self) -> bool:
        if self.thread is not None and self.thread.is_alive():
            return False
        return self.end is None or self.end.query()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        self.end.synchronize()

    def timings(self) -> dict[str, float]:
        """Seconds on the GPU (after :meth:`wait`): ``copy_s`` from the start to the last
        byte, and with a device copy first ``d2d_s`` and ``drain_s``."""
        out = {"copy_s": self.t0.elapsed_time(self.end) / 1e3}
        if self.d2d_end is not None:
            out["d2d_s"] = self.t0.elapsed_time(self.d2d_end) / 1e3
            out["drain_s"] = self.drain_start.elapsed_time(self.end) / 1e3
        return out


def device_facts(device: torch.device) -> dict[str, Any]:
    """What the copies depend on: copy engines, stream priorities, mapped host memory."""
    if device.type != "cuda":
        return {"cuda": False}
    out: dict[str, Any] = {"sms": torch.cuda.get_device_properties(device).multi_processor_count,
                           "stream_priority": {p: side_stream(device, p).priority
                                               for p in ("default", "high")}}
    try:
        from cuda.bindings import runtime as cudart  # type: ignore[import-not-found]

        for name in ("cudaDevAttrAsyncEngineCount", "cudaDevAttrCanUseHostPointerForRegisteredMem",
                     "cudaDevAttrUnifiedAddressing", "cudaDevAttrCanMapHostMemory"):
            try:
                err, value = cudart.cudaDeviceGetAttribute(
                    getattr(cudart.cudaDeviceAttr, name), device.index or 0)
                out[name] = int(value) if int(err) == 0 else f"error {int(err)}"
            except Exception as e:  # noqa: BLE001 - an attribute this release lacks
                out[name] = f"{type(e).__name__}: {e}"
        err, version = cudart.cudaDriverGetVersion()
        out["driver_version"] = int(version) if int(err) == 0 else None
    except Exception as e:  # noqa: BLE001 - try cupy, then nothing
        out["cuda_bindings"] = f"{type(e).__name__}: {e}"
        try:
            import cupy  # type: ignore[import-not-found]

            props = cupy.cuda.runtime.getDeviceProperties(device.index or 0)
            out["asyncEngineCount"] = props.get("asyncEngineCount")
        except Exception as e2:  # noqa: BLE001 - recorded as missing
            out["cupy"] = f"{type(e2).__name__}: {e2}"
    return out


# The ways d2h_stall.py measures, by name.
STRATEGIES = {s.name: s for s in (
    Strategy("queued_256m", "queued"),  # as a save's snapshot queues its copies
    Strategy("queued_1g", "queued", piece=GIB),
    Strategy("queued_4g", "queued", piece=4 * GIB),  # a few huge copies
    Strategy("queued_16m", "queued", piece=16 * MIB),
    Strategy("thread_4m", "thread", piece=4 * MIB),
    Strategy("thread_16m", "thread", piece=16 * MIB),
    Strategy("thread_64m", "thread", piece=64 * MIB),
    Strategy("thread_256m", "thread"),
    Strategy("queued_256m_high", "queued", priority="high"),
    Strategy("queued_256m_4streams", "queued", streams=4),
    Strategy("uva_256m", "uva"),
    *(Strategy(f"kernel_{n}", "kernel", ctas=n) for n in (4, 8, 16, 32, 64)),
    Strategy("d2d_only", "none", d2d="ce"),
    Strategy("d2d+kernel_16", "kernel", ctas=16, d2d="ce"),
    Strategy("d2d+kernel_32", "kernel", ctas=32, d2d="ce"),
    Strategy("d2d+thread_64m", "thread", piece=64 * MIB, d2d="ce"),
    Strategy("d2d+queued_4g", "queued", piece=4 * GIB, d2d="ce"),  # as snapshot="device"
    Strategy("d2dk_only", "none", d2d="kernel"),
    Strategy("d2dk+kernel_16", "kernel", ctas=16, d2d="kernel"),
    # paced drains: small pieces fed by a thread, from the source or from a device copy first
    *(Strategy(f"{first}paced_{mib}m_{k}", "thread", piece=mib * MIB, in_flight=k,
               d2d="ce" if first else "")
      for first in ("", "d2d+") for mib in (1, 2, 4) for k in (1, 2)),
)}


def fill(src: torch.Tensor, seed: int) -> None:
    """A pattern no other repetition has: element i of the int64 view is i + seed * 2**34."""
    s64 = src.view(torch.int64)
    torch.arange(s64.numel(), out=s64)
    s64.add_(seed << 34)


def check(copy: torch.Tensor, seed: int) -> bool:
    """The copy (host or device) holds the pattern at 64 evenly spread and 16 random places."""
    d64 = copy.view(torch.int64)
    n, width = d64.numel(), min(512, d64.numel())
    spots = [k * (n - width) // 63 for k in range(64)]
    spots += torch.randint(0, n - width + 1, (16,)).tolist()
    return all(torch.equal(d64[i:i + width].cpu(), torch.arange(i, i + width) + (seed << 34))
               for i in spots)
