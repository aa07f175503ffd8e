"""Where an offload after a training step spends its time, what device memory it leaves, and
how fast the onload kernel copies at other block sizes (one GPU, the HF Llama of offload.py).

1. ``--cycles`` training steps, each followed by an offload and an onload, as in offload.py;
   inside every offload the time of each ``torch.cuda.empty_cache()`` and of each host wait on a
   stream is recorded, the rest is queueing and bookkeeping. Every other cycle first empties the
   allocator's cache of the step's activations (timed apart), so the offload frees only the
   optimizer's own storages.
2. After offloading: device memory in use against a bare CUDA context, the allocator's counters,
   and the same after freeing cuBLAS's workspaces.
3. The onload kernel (``kernels.copy_from_host_``) at each ``--blocks`` x ``--warps`` setting
   copies the offloaded bytes into memory allocated just after a rollout freed 40 GB by
   ``cudaFree``, against the copy engine into the same memory; ``--reps`` times each.

    PYTHONPATH=src python3 benchmarks/probes/offload_phases.py --out $OUT/offload_phases.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402
import _peers  # noqa: E402
import offload as bench  # noqa: E402
from shardopt import kernels  # noqa: E402


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


class _Timed:
    """Records the host time of ``torch.cuda.empty_cache`` and ``Stream/Event.synchronize``."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._orig = []

    def __enter__(self) -> _Timed:
        for owner, name, key in ((torch.cuda, "empty_cache", "empty_cache"),
                                 (torch.cuda.Stream, "synchronize", "stream_wait"),
                                 (torch.cuda.Event, "synchronize", "event_wait")):
            orig = getattr(owner, name)
            self._orig.append((owner, name, orig))

            def timed(*args, _orig=orig, _key=key, **kw):
                t0 = time.perf_counter()
                out = _orig(*args, **kw)
                self.times[_key] = self.times.get(_key, 0.0) + time.perf_counter() - t0
                return out
            setattr(owner, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, orig in self._orig:
            setattr(owner, name, orig)


def _memory(device: torch.device, baseline: int) -> dict[str, int]:
    free, total = torch.cuda.mem_get_info(device)
    s = torch.cuda.memory_stats(device)
    return {"used_above_context": total - free - baseline,
            "allocated": s["allocated_bytes.all.current"],
            "reserved": s["reserved_bytes.all.current"],
            "segments": s["segment.all.current"]}


def _kernel_sweep(hosts, device, blocks, warps, reps) -> dict[str, dict]:
    nbytes = sum(h.numel() * h.element_size() for h in hosts)
    out: dict[str, dict] = {}
    settings = [("copy_engine", None, None)] + [(f"kernel_{b >> 10}k_w{w}", b, w)
                                               for b in blocks for w in warps]
    for rep in range(reps):
        for name, block, warp in settings:
            roll = torch.empty(40 << 30, dtype=torch.uint8, device=device)
            roll.fill_(1)
            del roll
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            dst = [torch.empty(h.numel(), dtype=h.dtype, device=device) for h in hosts]
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for d, h in zip(dst, hosts):
                if block is None:
                    d.copy_(h, non_blocking=True)
                else:
                    kernels.COPY_BLOCK_BYTES, kernels.COPY_WARPS = block, warp
                    kernels.copy_from_host_(d.view(-1), h.view(-1))
            torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            ok = all(torch.equal(d.view(-1)[-4096:].cpu(), h.view(-1)[-4096:])
                     for d, h in zip(dst, hosts))
            out.setdefault(name, {"s": [], "ok": True})
            out[name]["s"].append(dt)
            out[name]["ok"] &= ok
            del dst
            torch.cuda.empty_cache()
    for v in out.values():
        v["gbps"] = nbytes / statistics.median(v["s"]) / 1e9
        v["s"] = _stats(v["s"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="1b")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--cycles", type=int, default=8)
    p.add_argument("--blocks", default="4096,8192,16384,32768")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    device = torch.device("cuda", 0)
    baseline = bench._probe(0)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    flat = _common.make_batches("hf-llama", a.preset, 0, 1, a.micro_batch,
                                a.cycles * a.accumulate, device)
    batches = [flat[i:i + a.accumulate] for i in range(0, len(flat), a.accumulate)]
    system = _peers.setup_shardopt(
        _common.build_model("hf-llama", a.preset, device, num_layers=a.num_layers),
        _peers.Hyper(), device)
    opt = system.optimizer
    cycles = []
    for i, b in enumerate(batches):
        bench._train(system, b)
        torch.cuda.synchronize(device)
        c = {"reserved_before": torch.cuda.memory_reserved(device), "pre_empty_s": None}
        if i % 2:
            t0 = time.perf_counter()
            torch.cuda.empty_cache()
            c["pre_empty_s"] = time.perf_counter() - t0
            c["reserved_after_pre_empty"] = torch.cuda.memory_reserved(device)
        with _Timed() as t:
            t0 = time.perf_counter()
            opt.offload()
            c["offload_s"] = time.perf_counter() - t0
        c.update({f"{k}_s": v for k, v in t.times.items()})
        c["memory_offloaded"] = _memory(device, baseline)
        if i == 1:
            torch._C._cuda_clearCublasWorkspaces()
            c["memory_without_cublas_workspaces"] = _memory(device, baseline)
        t0 = time.perf_counter()
        opt.onload()
        torch.cuda.synchronize(device)
        c["onload_s"] = time.perf_counter() - t0
        cycles.append(c)
    moved = sum(d.numel() * d.element_size() for d, _ in bench._moved_pairs(opt))
    result = {"moved_bytes": moved, "baseline_context": baseline, "cycles": cycles,
              "parameters": sum(p.numel() for p in system.model.parameters())}
    timed = cycles[1:]
    for key in ("offload_s", "empty_cache_s", "stream_wait_s", "onload_s"):
        for name, sel in (("plain", [c for c in timed if c["pre_empty_s"] is None]),
                          ("pre_emptied", [c for c in timed if c["pre_empty_s"] is not None])):
            xs = [c.get(key, 0.0) for c in sel]
            if xs:
                result.setdefault("summary", {}).setdefault(name, {})[key] = _stats(xs)
    pre = [c["pre_empty_s"] for c in timed if c["pre_empty_s"] is not None]
    if pre:
        result["summary"]["pre_emptied"]["pre_empty_s"] = _stats(pre)
    if not a.no_sweep:
        opt.offload()  # the device is free again; its pinned host copies are the sources
        hosts = [h for h, _ in bench._moved_pairs(opt)]
        gc.collect()
        torch.cuda.empty_cache()
        result["kernel_sweep"] = _kernel_sweep(
            hosts, device, [int(x) for x in a.blocks.split(",")],
            [int(x) for x in a.warps.split(",")], a.reps)
    result.update({"command": " ".join(sys.argv), "torch": torch.__version__,
                   "device": torch.cuda.get_device_name(device),
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "cycles"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
