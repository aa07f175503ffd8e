"""Why onload() copies into fresh device memory slower than into memory already held.

``offload()`` copies the optimizer's state to page-locked host buffers, resizes every device
storage to zero and calls ``torch.cuda.empty_cache()``; ``onload()`` (``HostState._to_device``)
resizes the storages back, queues the host-to-device copies on a side stream and zeroes the
dropped grads on the current stream. On an H200 that onload reached 84.8% of the raw pinned
copy rate (0.392 s against 0.333 s for the same 18.4 GB into device memory already held);
allocating the same tensors alone took 1.7 ms. This script takes the model out of it: device
tensors of the 1.3B run's moved state (params bf16 2.63 GB, main params, exp_avg and exp_avg_sq
fp32 5.25 GB each; a 5.25 GB fp32 grads tensor that is re-allocated and zeroed, never copied;
``--scale`` multiplies every size), host copies in :class:`shardopt.pinned.PinnedBuffer` (the
exact-size ``cudaHostRegister`` memory onload reads), filled with random values once. Each
variant runs ``--reps`` times; the time is wall clock from the start of the operation to
``torch.cuda.synchronize()``, and GB/s counts the copied bytes only (not the zeroed grads):

* ``held``: H2D copies on one side stream into tensors allocated and written before: the bar.
* ``held_d2h``: the same tensors device-to-host, for reference.
* ``fresh``: storages freed (``resize_(0)``, ``empty_cache()``, untimed); timed: every storage
  resized back first, copies queued on a side stream, grads zeroed on the current stream, the
  current stream waits for the side stream's event: what ``HostState._to_device`` does.
* ``fresh_interleaved``: as ``fresh``, each storage resized and its copy queued in turn.
* ``fresh_after_rollout``: as ``fresh``, but a "rollout" tensor of ``--rollout-fraction`` of the
  freed bytes is allocated, written and freed (``empty_cache()``) before the timed part, as in
  the colocation cycle of ``offload.py``.
* ``fresh_wait_then_copy``: storages freed, resized back and grads zeroed, a sync and a sleep
  of ``--settle-s`` (untimed); only the copies are timed. As fast as ``held``: the free or the
  allocation started asynchronous device work (e.g. the driver scrubbing pages) that the
  copies of ``fresh`` waited for or shared the device with (``fresh_settled_free`` tells which
  call); as slow as ``fresh``: the first write into new memory is what is slow.
* ``fresh_touch_then_copy``: storages freed and resized back (untimed); timed apart, (a) a
  ``zero_()`` of every new tensor (grads too) and a sync, then (b) the copies.
* ``fresh_two_streams``: as ``fresh``, each tensor's copy cut into pieces of ``--chunk-mib``
  (256 MiB at scale 1), the pieces alternating between two side streams.
* ``held_two_streams``: the same pieces and streams into held memory (the bar is the faster of
  this and ``held``).
* ``fresh_chunked_256m``: as ``fresh``, the copies cut into the same pieces on one stream.
* ``fresh_cached`` (control): storages resized to zero *without* ``empty_cache()``, so resizing
  back reuses the allocator's cached blocks (no cudaFree / cudaMalloc); as ``fresh`` otherwise.
  Equal to ``held``: the cost is in the driver's fresh memory, not in ``resize_`` or the streams.
* ``fresh_settled_free`` (control): storages freed as in ``fresh``, then a sleep of
  ``--settle-s`` (untimed) before the timed part of ``fresh``. With ``fresh_wait_then_copy`` it
  tells which call starts the slow background work: as fast as ``held`` here, the free
  (e.g. the driver scrubbing the pages given back); as slow as ``fresh``, the allocation.
* ``fresh_interleaved_after_rollout`` (candidate): the rollout of ``fresh_after_rollout``, then
  the timed part of ``fresh_interleaved``: the colocation cycle with per-tensor allocation.
* ``held_sm_4k4w``, ``held_sm_64k8w``: ``held_sm`` with 4 KiB per program and 4 warps, 64 KiB
  and 8 warps (``held_sm``: ``kernels.COPY_BLOCK_BYTES`` and ``COPY_WARPS``).
* ``fresh_onload``, ``fresh_after_rollout_onload``: what onload runs,
  ``shardopt.host_state.queue_h2d`` (each storage re-allocated just before its copy, by the
  kernel or the copy engine as ``h2d_by_kernel()`` picks for this allocator setting).
  (A share of the bytes by the kernel and the rest by the copy engine at the same time, 15, 30
  and 50%, is slower than either alone: ``results/onload_probe_1gpu_mixed.json``.)
* ``held_sm``, ``fresh_sm``, ``fresh_after_rollout_sm``: ``held``, ``fresh`` and
  ``fresh_after_rollout`` with each copy done by a kernel whose loads read the pinned host
  memory over PCIe (``shardopt.kernels.copy_from_host_``) instead of a copy engine; held_sm
  zeroes the device tensors first (untimed) so that the data check sees what it copied.

Beside the wall time each rep records the host time of the allocations (``alloc_s``), the GPU
time from an event on the current stream after the allocations to one after the copies
(``gpu_s``), and ``memory_reserved()`` / ``mem_get_info()`` / the allocator's cudaMalloc and
cudaFree counts after each phase (outside the timed parts). After each variant a slice at the
head, middle and tail of every device tensor is compared with its host copy (``data_ok``).
Device memory in use peaks at the tensors' 23.6 GB (the rollout tensor only exists while they
are freed); the whole run takes about 40 s on one H200 (6-10 s of it pinning the host buffers).

GPU (run twice, once per allocator setting, which is recorded in the result)::

    PYTHONPATH=src python3 benchmarks/probes/onload_probe.py \\
        --out benchmarks/results/onload_probe_1gpu.json
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src python3 \\
        benchmarks/probes/onload_probe.py --out benchmarks/results/onload_probe_1gpu_expandable.json

CPU (code paths only: plain tensors, no streams or events; the numbers mean nothing)::

    PYTHONPATH=src python benchmarks/probes/onload_probe.py --device cpu --out /tmp/onload_probe_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suites' helpers
import _common  # noqa: E402

from shardopt import host_state, kernels  # noqa: E402
from shardopt.pinned import PinnedBuffer  # noqa: E402

# name, dtype, GB (1e9 bytes) at scale 1, copied (False: re-allocated and zeroed only)
TENSORS: tuple[tuple[str, torch.dtype, float, bool], ...] = (
    ("params", torch.bfloat16, 2.63, True),
    ("main_params", torch.float32, 5.25, True),
    ("exp_avg", torch.float32, 5.25, True),
    ("exp_avg_sq", torch.float32, 5.25, True),
    ("grads", torch.float32, 5.25, False),
)
VARIANTS = ("held", "held_d2h", "fresh", "fresh_interleaved", "fresh_after_rollout",
            "fresh_wait_then_copy", "fresh_touch_then_copy", "fresh_two_streams",
            "held_two_streams", "fresh_chunked_256m", "fresh_cached", "fresh_settled_free",
            "fresh_interleaved_after_rollout", "held_sm", "fresh_sm", "fresh_after_rollout_sm",
            "held_sm_4k4w", "held_sm_64k8w", "fresh_onload", "fresh_after_rollout_onload")
BAR_VARIANTS = ("held", "held_two_streams", "held_sm", "held_sm_4k4w", "held_sm_64k8w")  # the raw H2D bar: the faster of these
CHUNK_BYTES_AT_SCALE_1 = 256 << 20
CHECK_ELEMS = 1 << 18  # elements compared at each of head, middle and tail


@dataclass
class Slot:
    """One device tensor, its storage size and (if copied) its pinned host copy."""

    name: str
    dev: torch.Tensor
    nbytes: int
    host: PinnedBuffer | None

    @property
    def storage(self) -> torch.UntypedStorage:
        return self.dev.untyped_storage()


Job = tuple[torch.Tensor, torch.Tensor]  # (destination, source) of one copy


def _gbps(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds else None


class Probe:
    """The tensors, the streams and the measured operations of every variant."""

    def __init__(self, device: torch.device, scale: float, chunk_bytes: int,
                 rollout_fraction: float, settle_s: float) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.rollout_fraction = rollout_fraction
        self.settle_s = settle_s
        self.slots: list[Slot] = []
        for name, dtype, gb, copied in TENSORS:
            numel = max(1, round(gb * 1e9 * scale / dtype.itemsize))
            dev = torch.empty(numel, dtype=dtype, device=device)
            host = PinnedBuffer(numel, dtype) if copied else None
            self.slots.append(Slot(name, dev, dev.untyped_storage().nbytes(), host))
        self.copied = [s for s in self.slots if s.host is not None]
        self.grads = [s.dev for s in self.slots if s.host is None]
        self.copied_bytes = sum(s.nbytes for s in self.copied)
        self.device_bytes = sum(s.nbytes for s in self.slots)
        self.streams: list[torch.cuda.Stream | None] = (
            [torch.cuda.Stream(device) for _ in range(2)] if self.cuda else [None, None])
        # Views stay valid across resize_(0) / resize_(n): they hold the storage, not its address.
        self.whole: list[Job] = [(s.dev, s.host.tensor) for s in self.copied
                                   if s.host is not None]
        self.pieces: list[Job] = []
        for s in self.copied:
            assert s.host is not None
            step = max(1, chunk_bytes // s.dev.element_size())
            for a in range(0, s.dev.numel(), step):
                self.pieces.append((s.dev[a:a + step], s.host.tensor[a:a + step]))

    # ------------------------------------------------------------------ helpers
    def sync(self) -> None:
        _common.cuda_sync(self.device)

    def stream_ctx(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def event(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
        """A timing event recorded on ``stream`` (default: the current stream); None on CPU."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    @staticmethod
    def elapsed(start: torch.cuda.Event | None, end: torch.cuda.Event | None) -> float | None:
        return start.elapsed_time(end) / 1e3 if start is not None and end is not None else None

    def memory(self) -> dict[str, Any] | None:
        """Allocator and driver figures now (call outside timed parts); None on CPU."""
        if not self.cuda:
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        st = torch.cuda.memory_stats(self.device)
        return {"allocated": torch.cuda.memory_allocated(self.device),
                "reserved": torch.cuda.memory_reserved(self.device),
                "device_used": total - free, "device_free": free,
                "segments": st.get("segment.all.current"),
                "num_device_alloc": st.get("num_device_alloc"),
                "num_device_free": st.get("num_device_free")}

    # ------------------------------------------------------------- state changes
    def fill(self) -> float:
        """Random values on the device, copied to the host copies; grads zero. Seconds."""
        t0 = time.perf_counter()
        gen = torch.Generator(device=self.device).manual_seed(0)
        for s in self.copied:
            assert s.host is not None
            s.dev.normal_(generator=gen)
            s.host.tensor.copy_(s.dev)
        for g in self.grads:
            g.zero_()
        self.sync()
        return time.perf_counter() - t0

    def free(self, empty_cache: bool = True) -> float:
        """Every storage resized to 0 (nothing queued uses them: synced first), the
        allocator's cache emptied, synced. Seconds (untimed in every variant)."""
        self.sync()
        t0 = time.perf_counter()
        for s in self.slots:
            s.storage.resize_(0)
        if self.cuda and empty_cache:
            torch.cuda.empty_cache()
        self.sync()
        return time.perf_counter() - t0

    def alloc(self) -> float:
        """Every storage resized back (for the current stream). Host seconds."""
        t0 = time.perf_counter()
        for s in self.slots:
            s.storage.resize_(s.nbytes)
        return time.perf_counter() - t0

    def restore(self) -> None:
        """Resize back any storage left at 0 (after an error), so no tensor is used empty."""
        for s in self.slots:
            if s.storage.nbytes() != s.nbytes:
                s.storage.resize_(s.nbytes)
        self.sync()

    def rollout(self, freed: int) -> dict[str, Any]:
        """Allocate ``rollout_fraction`` of ``freed`` bytes, write them, free them, empty the
        cache: the colocation cycle's rollout between offload and onload."""
        nbytes = int(freed * self.rollout_fraction) // 2 * 2
        t0 = time.perf_counter()
        t = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=self.device)
        t.fill_(1.0)
        t.mul_(2.0)
        self.sync()
        mem = self.memory()
        del t
        if self.cuda:
            torch.cuda.empty_cache()
        self.sync()
        return {"bytes": nbytes, "s": time.perf_counter() - t0, "memory_with_rollout": mem}

    # ------------------------------------------------------------------- copies
    def queue(self, jobs: Sequence[Job], nstreams: int, sm: bool = False
              ) -> list[torch.cuda.Event | None]:
        """Job ``i`` on side stream ``i % nstreams``, each side stream after the current
        stream's work; returns one (non-timing) event per side stream after its copies."""
        streams = self.streams[:nstreams]
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            for st in streams:
                assert st is not None
                st.wait_stream(current)
        for i, (dst, src) in enumerate(jobs):
            with self.stream_ctx(streams[i % nstreams]):
                if sm and self.cuda:  # a kernel reading the host memory, not a copy engine
                    kernels.copy_from_host_(dst, src)
                else:
                    dst.copy_(src, non_blocking=True)
        events: list[torch.cuda.Event | None] = []
        for st in streams:
            if st is not None:
                ev = torch.cuda.Event()
                ev.record(st)
                events.append(ev)
        return events

    def join(self, events: Sequence[torch.cuda.Event | None]) -> None:
        """The current stream waits for the side streams' events (the host does not)."""
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            for ev in events:
                if ev is not None:
                    current.wait_event(ev)

    def copies(self, jobs: Sequence[Job], nstreams: int, sm: bool = False
               ) -> dict[str, float | None]:
        """Copies only (memory already allocated), to the sync."""
        t0 = time.perf_counter()
        start = self.event()
        self.join(self.queue(jobs, nstreams, sm))
        end = self.event()
        self.sync()
        return {"total_s": time.perf_counter() - t0, "gpu_s": self.elapsed(start, end)}

    def onload(self, jobs: Sequence[Job], nstreams: int, sm: bool = False
               ) -> dict[str, float | None]:
        """HostState._to_device: allocate all, queue the copies, zero the grads beside them,
        the current stream waits for the copies; timed to the sync."""
        t0 = time.perf_counter()
        alloc_s = self.alloc()
        start = self.event()
        events = self.queue(jobs, nstreams, sm)
        for g in self.grads:
            g.zero_()
        self.join(events)
        end = self.event()
        self.sync()
        return {"total_s": time.perf_counter() - t0, "alloc_s": alloc_s,
                "gpu_s": self.elapsed(start, end)}

    def onload_interleaved(self) -> dict[str, float | None]:
        """As :meth:`onload`, each storage resized and its copy queued in turn."""
        side = self.streams[0]
        t0 = time.perf_counter()
        start = self.event()
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
        alloc_s = 0.0
        for s in self.slots:
            ta = time.perf_counter()
            s.storage.resize_(s.nbytes)
            alloc_s += time.perf_counter() - ta
            if s.host is not None:
                with self.stream_ctx(side):
                    s.dev.copy_(s.host.tensor, non_blocking=True)
        event = None
        if side is not None:
            event = torch.cuda.Event()
            event.record(side)
        for g in self.grads:
            g.zero_()
        self.join([event])
        end = self.event()
        self.sync()
        return {"total_s": time.perf_counter() - t0, "alloc_s": alloc_s,
                "gpu_s": self.elapsed(start, end)}

    def onload_library(self) -> dict[str, float | None]:
        """shardopt's own onload copies (``host_state.queue_h2d``): each storage re-allocated
        just before its copy, by kernel or copy engine as ``h2d_by_kernel()`` picks; grads
        re-allocated and zeroed beside them."""
        t0 = time.perf_counter()
        start = self.event()
        if self.cuda:
            assert self.streams[0] is not None
            event = host_state.queue_h2d(self.whole, self.streams[0],
                                         [s.nbytes for s in self.copied])
        else:
            for s in self.copied:
                s.storage.resize_(s.nbytes)
            for dst, src in self.whole:
                dst.copy_(src)
            event = None
        for s in self.slots:
            if s.host is None:
                s.storage.resize_(s.nbytes)
        for g in self.grads:
            g.zero_()
        self.join([event])
        end = self.event()
        self.sync()
        return {"total_s": time.perf_counter() - t0, "gpu_s": self.elapsed(start, end)}

    def d2h(self) -> dict[str, float | None]:
        return self.copies([(src, dst) for dst, src in self.whole], 1)

    # ----------------------------------------------------------------- variants
    def run_variant(self, name: str) -> dict[str, Any]:
        """One rep of variant ``name``: its timings and the memory after its phases."""
        mem: dict[str, Any] = {}
        rep: dict[str, Any] = {"memory": mem}
        if name.startswith("fresh"):
            rep["free_s"] = self.free(empty_cache=name != "fresh_cached")
            mem["freed"] = self.memory()
        if name == "held":
            rep |= self.copies(self.whole, 1)
        elif name == "held_d2h":
            rep |= self.d2h()
        elif name.startswith("held_sm"):
            for s in self.copied:  # so that check() sees what the kernel copied
                s.dev.zero_()
            self.sync()
            saved = kernels.COPY_BLOCK_BYTES, kernels.COPY_WARPS
            if name != "held_sm":  # held_sm_{KiB}k{warps}w
                kib, warps = name.removeprefix("held_sm_").removesuffix("w").split("k")
                kernels.COPY_BLOCK_BYTES, kernels.COPY_WARPS = int(kib) << 10, int(warps)
            try:
                rep |= self.copies(self.whole, 1, sm=True)
            finally:
                kernels.COPY_BLOCK_BYTES, kernels.COPY_WARPS = saved
        elif name.endswith("_onload"):
            if name == "fresh_after_rollout_onload":
                rep["rollout"] = self.rollout(self.device_bytes)
                mem["after_rollout"] = self.memory()
            rep["by_kernel"] = host_state.h2d_by_kernel()
            rep |= self.onload_library()
        elif name == "fresh_sm":
            rep |= self.onload(self.whole, 1, sm=True)
        elif name == "fresh_after_rollout_sm":
            rep["rollout"] = self.rollout(self.device_bytes)
            mem["after_rollout"] = self.memory()
            rep |= self.onload(self.whole, 1, sm=True)
        elif name == "held_two_streams":
            rep |= self.copies(self.pieces, 2)
        elif name in ("fresh", "fresh_cached"):
            rep |= self.onload(self.whole, 1)
        elif name == "fresh_interleaved":
            rep |= self.onload_interleaved()
        elif name == "fresh_interleaved_after_rollout":
            rep["rollout"] = self.rollout(self.device_bytes)
            mem["after_rollout"] = self.memory()
            rep |= self.onload_interleaved()
        elif name == "fresh_settled_free":
            time.sleep(self.settle_s)
            mem["settled"] = self.memory()
            rep |= self.onload(self.whole, 1)
        elif name == "fresh_after_rollout":
            rep["rollout"] = self.rollout(self.device_bytes)
            mem["after_rollout"] = self.memory()
            rep |= self.onload(self.whole, 1)
        elif name == "fresh_two_streams":
            rep |= self.onload(self.pieces, 2)
        elif name == "fresh_chunked_256m":
            rep |= self.onload(self.pieces, 1)
        elif name == "fresh_wait_then_copy":
            rep["alloc_s"] = self.alloc()
            for g in self.grads:
                g.zero_()
            self.sync()
            time.sleep(self.settle_s)
            mem["allocated_settled"] = self.memory()
            rep |= self.copies(self.whole, 1)
        elif name == "fresh_touch_then_copy":
            rep["alloc_s"] = self.alloc()
            self.sync()
            mem["allocated"] = self.memory()
            t0 = time.perf_counter()
            for s in self.slots:
                s.dev.zero_()
            self.sync()
            rep["touch_s"] = time.perf_counter() - t0
            part = self.copies(self.whole, 1)
            rep["copy_s"] = part["total_s"]
            rep["gpu_s"] = part["gpu_s"]
            rep["total_s"] = rep["touch_s"] + rep["copy_s"]
        else:
            raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
        rep.setdefault("copy_s", rep["total_s"])
        mem["done"] = self.memory()
        return rep

    def check(self) -> bool:
        """Head, middle and tail of every device tensor equal its host copy; grads zero."""
        self.sync()
        ok = True
        for s in self.slots:
            n = s.dev.numel()
            k = min(n, CHECK_ELEMS)
            for a in sorted({0, max(0, n // 2 - k // 2), n - k}):
                got = s.dev[a:a + k].cpu()
                want = s.host.tensor[a:a + k] if s.host is not None else torch.zeros_like(got)
                ok = ok and torch.equal(got, want)
        return ok

    def release(self) -> None:
        """Synced first: no copy reads the host buffers any more; then unlock them."""
        self.restore()
        self.sync()
        for s in self.slots:
            if s.host is not None:
                s.host.release()
        self.slots, self.copied, self.grads, self.whole, self.pieces = [], [], [], [], []
        if self.cuda:
            torch.cuda.empty_cache()


def _summary(reps: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {"reps": reps}
    for key in ("total_s", "copy_s", "alloc_s", "gpu_s", "touch_s", "free_s"):
        vals = [r[key] for r in reps if r.get(key) is not None]
        if vals:
            out[key] = _common.stats(vals)
    out["gbps"] = _gbps(nbytes, out["total_s"]["min"])
    out["copy_gbps"] = _gbps(nbytes, out["copy_s"]["min"])
    out["gpu_gbps"] = _gbps(nbytes, out["gpu_s"]["min"]) if "gpu_s" in out else None
    return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(a.device)
    scale = a.scale if a.scale is not None else (1.0 if device.type == "cuda" else 1e-5)
    chunk = (int(a.chunk_mib * _common.MIB) if a.chunk_mib is not None
             else int(CHUNK_BYTES_AT_SCALE_1 * scale))
    chunk = max(512, chunk // 512 * 512)
    names = [v.strip() for v in a.variants.split(",") if v.strip()] if a.variants else VARIANTS
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    result: dict[str, Any] = {
        "alloc_conf": {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF",
                                                      "PYTORCH_ALLOC_CONF")},
        "allocator_backend": (torch.cuda.get_allocator_backend()
                              if device.type == "cuda" else None),
        "scale": scale, "chunk_bytes": chunk, "variants_run": names,
    }
    if device.type == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    probe = Probe(device, scale, chunk, a.rollout_fraction, a.settle_s)
    result["setup"] = {"alloc_and_pin_s": time.perf_counter() - t0}
    try:
        result["tensors"] = [{"name": s.name, "dtype": s.dev.dtype, "numel": s.dev.numel(),
                              "bytes": s.nbytes, "copied": s.host is not None,
                              "pinned": s.host.pinned if s.host is not None else None}
                             for s in probe.slots]
        result |= {"copied_bytes": probe.copied_bytes, "device_bytes": probe.device_bytes,
                   "zeroed_bytes": probe.device_bytes - probe.copied_bytes,
                   "pieces": len(probe.pieces)}
        result["setup"]["fill_s"] = probe.fill()
        warm = probe.copies(probe.whole, 1)  # untimed warm-up: the copy path, every page once
        result["setup"] |= {"warmup_h2d_s": warm["total_s"], "memory": probe.memory()}
        variants: dict[str, Any] = {}
        for name in names:
            reps = []
            try:
                for _ in range(a.reps):
                    reps.append(probe.run_variant(name))
            finally:
                probe.restore()  # every storage full size again before anything else
            v = _summary(reps, probe.copied_bytes)
            if name == "fresh_touch_then_copy":
                v["touch_gbps"] = _gbps(probe.device_bytes, v["touch_s"]["min"])
            v["data_ok"] = probe.check()
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the check's slices; nothing else is cached
            v["memory_after"] = probe.memory()
            variants[name] = v
        result["variants"] = variants
        bars = [(variants[n]["gbps"], n) for n in BAR_VARIANTS if n in variants]
        bar_gbps, bar_name = max(bars) if bars else (None, None)
        result["raw_bar"] = {"variant": bar_name, "gbps": bar_gbps}
        for v in variants.values():
            v["vs_raw"] = v["gbps"] / bar_gbps if bar_gbps else None
            v["copy_vs_raw"] = v["copy_gbps"] / bar_gbps if bar_gbps else None
        if device.type == "cuda":
            result["peak_allocated"] = torch.cuda.max_memory_allocated(device)
            result["peak_reserved"] = torch.cuda.max_memory_reserved(device)
    finally:
        probe.release()
    result["memory_end"] = probe.memory()
    return result


def _table(result: dict[str, Any]) -> str:
    rows = []
    for name, v in result["variants"].items():
        t = {k: 1e3 * x for k, x in v["total_s"].items() if k != "n"}
        pct = f"{100 * v['vs_raw']:.1f}%" if v["vs_raw"] is not None else None
        alloc = 1e3 * v["alloc_s"]["median"] if "alloc_s" in v else None
        gpu = 1e3 * v["gpu_s"]["median"] if "gpu_s" in v else None
        extra = (f"touch {1e3 * v['touch_s']['median']:.1f} + copy "
                 f"{1e3 * v['copy_s']['median']:.1f} ms" if "touch_s" in v else "")
        rows.append([name, t["median"], t["min"], t["max"], v["gbps"], pct, alloc, gpu,
                     "yes" if v["data_ok"] else "NO", extra])
    return _common.format_table(rows, ["variant", "ms med", "ms min", "ms max", "GB/s (min)",
                                       "of bar", "alloc ms", "gpu ms med", "data ok", "note"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON result file")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every variant")
    p.add_argument("--scale", type=float, default=None,
                   help="multiplies every tensor size (default 1 on cuda, 1e-5 on cpu)")
    p.add_argument("--variants", default=None,
                   help=f"comma list, run in that order (default all: {','.join(VARIANTS)})")
    p.add_argument("--chunk-mib", type=float, default=None,
                   help="piece size of the chunked and two-stream variants "
                        "(default 256 MiB times --scale)")
    p.add_argument("--rollout-fraction", type=float, default=0.9,
                   help="fresh_after_rollout: rollout tensor as a fraction of the freed bytes")
    p.add_argument("--settle-s", type=float, default=0.2,
                   help="fresh_wait_then_copy: sleep between allocation and copies; "
                        "fresh_settled_free: between the free and the timed part")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available (use --device cpu)")
    t0 = time.perf_counter()
    result = run(a)
    result["wall_s"] = time.perf_counter() - t0
    doc = _common.run_header(torch.device(a.device), vars(a)) | {"result": result}
    _common.write_json(a.out, doc)
    print(_table(result))
    bar = result["raw_bar"]
    conf = result["alloc_conf"]["PYTORCH_CUDA_ALLOC_CONF"]
    print(f"copied {result['copied_bytes'] / 1e9:.3f} GB (+ {result['zeroed_bytes'] / 1e9:.3f} "
          f"GB zeroed) in {result['pieces']} pieces of {result['chunk_bytes']} B; bar "
          f"{bar['variant']} {bar['gbps'] or 0:.1f} GB/s; PYTORCH_CUDA_ALLOC_CONF={conf}; "
          f"wall {result['wall_s']:.1f} s")
    ok = all(v["data_ok"] for v in result["variants"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
