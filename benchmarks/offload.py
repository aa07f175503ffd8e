"""offload() / onload() for colocated RL: speed, memory given back, exact continuation.

One process, one GPU (``--nproc N``: N ranks, one a GPU, data parallel), the ``1b`` preset
of ``--model``: ``gpt``, the reference GPT of ``shardopt.recipes`` (1.3B params, bf16 with
fp32 norms and routers), or ``hf-llama``, Hugging Face's ``LlamaForCausalLM`` of 1.35B params
built from a config (``_common.HF_LLAMA_PRESETS``), trained by shardopt as in
``train_iter.py``; a training step is ``--accumulate`` micro-batches of ``--micro-batch``
sequences, then the step. In order:

1. Baseline: a subprocess that sees only the GPU and creates a CUDA context there reports
   the device memory in use (``total - free`` of ``cudaMemGetInfo``), before this process
   (or any rank) touches CUDA.
2. Reference: ``--cycles`` training steps without offload; the losses.
3. The same model and batches again; every step is followed by the colocation cycle:
   ``offload()``, allocate a "rollout" tensor of ``--rollout-fraction`` of the memory
   the offload freed and run a kernel over it, free it, ``onload()``. At the first
   cycle a separate process also allocates all the free device memory but 2 GiB (more
   than was free before the offload) and writes it: the memory really went back to
   the device, not just to this process's allocator.
4. More offload/onload cycles without training, up to ``--rss-cycles`` in all, for the
   host RSS after the 1st and the last (the pinned host copies are reused, not grown).
   ``--h2d`` lists the ways onload copies to the device, taken in turn by the cycles and
   reported apart (``onload_by_h2d``: the same run, the same bytes): ``kernel`` (a kernel
   reading the pinned host memory), ``copy_engine`` (``copy_``); the one
   ``host_state.h2d_by_kernel()`` picks for this process is the reported ``onload``. The
   cycles past ``--cycles`` are also timed (``back_to_back``: offload then onload, nothing
   between, as torch_memory_saver's pause and resume below). ``--rollout-alloc expandable``
   allocates the rollout in expandable segments, so that its memory goes back to the driver
   by unmapping, as an engine on the CUDA virtual-memory API gives it back
   (torch_memory_saver, vLLM's sleep mode), rather than by ``cudaFree``.
5. The same bytes copied raw between the optimizer's own pinned host copies and its
   device tensors (one side stream, one sync: the ceiling; host to device both by the copy
   engine and by the kernel, the faster is the bar), and with plain
   ``.to("cpu")`` / ``.to("cuda")``; torch_memory_saver's pause/resume of the same bytes if
   it is importable (its wheel carried to the GPU host: ``pip install --no-deps --target
   /tmp/site .whl/torch_memory_saver-*.whl``).

Targets (recorded in ``targets``): offload and onload each >= 90% of the raw pinned
copy's GB/s, medians against medians (every time is also reported with its min and max,
``--reps`` repetitions of the raw copies, the cycles after the first for offload and
onload); device memory in use after offload <= 1 GiB above the CUDA-context baseline;
losses identical to the reference. Expected well under 5 minutes on one H200.

``--nproc N`` (N > 1) runs N ranks (``_peers.spawn``: rank r on ``cuda:r`` over NCCL, gloo
on CPU), each with the same model and its own micro-batches, the optimizer over all of them
(DP N). Each rank offloads and onloads its own state (its shards of the main params and
moments, its copy of the params) and measures its own: times and GB/s, raw copies, device
memory (against its GPU's baseline, probed by the parent before any rank starts, so the
rank's NCCL buffers count against the target as in a DP job), host RSS, the other process on
its GPU, losses against its own reference. Training steps are collective and nothing here is
timed against a budget, so every rank runs the same steps and cycles; a barrier starts every
timed offload, onload and raw copy on all ranks at once, as a colocated DP job offloads (its
GPUs may share a PCIe switch and host memory bandwidth). The plain ``.to()`` copies and
torch_memory_saver run on rank 0 only (the same per-GPU copy as at DP 1). The result:
``dp_size``, ``result`` (rank 0's, as at DP 1, and the plot's timeline), ``by_rank`` (every
rank's) and ``worst_rank`` (for each target, the first rank farthest from it and its value
there).

GPU::

    PYTHONPATH=src python3 benchmarks/offload.py --out benchmarks/results/offload_1gpu.json \\
        --plot benchmarks/results/offload_1gpu.png

The Hugging Face model, 2 micro-batches of 8 sequences per step, 6 timed cycles after the
first (about a minute and a half)::

    PYTHONPATH=src python3 benchmarks/offload.py --model hf-llama --micro-batch 8 \\
        --accumulate 2 --cycles 7 --rss-cycles 13 --h2d kernel --no-peers \\
        --out $OUT/offload_1gpu_hf.json

DP 2 (two GPUs)::

    PYTHONPATH=src python3 benchmarks/offload.py --nproc 2 \\
        --out benchmarks/results/offload_2gpu.json --plot benchmarks/results/offload_2gpu.png

CPU smoke (code paths only; no memory figures; ``--nproc 2`` for two ranks over gloo)::

    PYTHONPATH=src python benchmarks/offload.py --device cpu --preset tiny --cycles 3 \\
        --rss-cycles 5 --out /tmp/offload_smoke.json
    PYTHONPATH=src python benchmarks/offload.py --device cpu --preset tiny --model hf-llama \\
        --accumulate 2 --cycles 3 --rss-cycles 5 --out /tmp/offload_smoke_hf.json
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import _peers  # noqa: E402
from shardopt import host_state, kernels  # noqa: E402

_PROBE = """
import sys, time, torch
torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
n = int(sys.argv[1])
if n:
    t = torch.empty(n, dtype=torch.uint8, device="cuda"); t.fill_(1)
    s = int(t[: 1 << 20].sum()); torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
print(total - free)
"""


def _probe(index: int, nbytes: int = 0) -> int:
    """Device memory in use on GPU ``index`` (of those this process sees) seen by a fresh
    process that sees only that GPU and holds a CUDA context on it (and, with ``nbytes``, a
    tensor of that size it wrote). Raises if it cannot allocate."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu = visible.split(",")[index] if visible is not None else str(index)
    out = subprocess.run([sys.executable, "-c", _PROBE, str(nbytes)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu})
    if out.returncode:
        raise RuntimeError(f"probe process failed: {out.stderr.strip()[-2000:]}")
    return int(out.stdout.split()[-1])


def _device_used(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def _reserved(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _rate(nbytes: int, times: list[float]) -> dict[str, float]:
    """GB/s of ``nbytes`` moved in each of ``times``: median, min and max (the min from the
    slowest time)."""
    t = _common.stats(times)
    return {"median": _gbps(nbytes, t["median"]), "min": _gbps(nbytes, t["max"]),
            "max": _gbps(nbytes, t["min"]), "n": t["n"]}


def _train(system, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """One training step over ``micro_batches`` (grads reduced once, at the last), then
    ``zero_grad()``; the mean loss, read on the host (which waits for the step)."""
    opt, acc = system.optimizer, len(micro_batches)
    total = None
    for i, (x, y) in enumerate(micro_batches):
        with opt.no_sync() if i < acc - 1 else contextlib.nullcontext():
            loss = system.model(x, y) / acc
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    opt.step()
    opt.zero_grad()
    return float(total)


def _moved_pairs(opt) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(host copy, device tensor) for every tensor offload() copies (grads not pending
    are freed without a copy)."""
    return [(h.host, h.device) for h in opt.shard_state.held.values() if h.host is not None]


def _raw_copies(opt, device: torch.device, reps: int) -> dict[str, Any]:
    """The same bytes, the same pinned buffers, one side stream: D2H then H2D (each
    repetition started on every rank at once)."""
    pairs = _moved_pairs(opt)
    nbytes = sum(h.numel() * h.element_size() for h, _ in pairs)
    out: dict[str, Any] = {"bytes": nbytes}
    if device.type != "cuda":
        return out
    stream = torch.cuda.Stream(device)
    for name in ("d2h", "h2d", "h2d_kernel"):
        times = []
        for _ in range(reps):
            _peers.barrier()
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                for h, d in pairs:  # H2D writes back the values D2H just read: no change
                    if name == "d2h":
                        h.copy_(d, non_blocking=True)
                    elif name == "h2d":
                        d.copy_(h, non_blocking=True)
                    else:  # what onload's kernel does: its loads read the host memory
                        kernels.copy_from_host_(d, h)
            stream.synchronize()
            times.append(time.perf_counter() - t0)
        out[f"{name}_s"] = _common.stats(times)
        out[f"{name}_gbps"] = _rate(nbytes, times)["median"]
        out[f"{name}_gbps_range"] = _rate(nbytes, times)
    out["h2d_bar_gbps"] = max(out["h2d_gbps"], out["h2d_kernel_gbps"])  # the faster way
    # What onload pays beyond the copy: fresh device memory for the same tensors (the
    # allocator's cache emptied first, as after an offload), alone and then with the copies
    # queued as each allocation returns.
    for name, copy in (("alloc", False), ("alloc_and_h2d", True)):
        times = []
        for _ in range(reps):
            _peers.barrier()
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            t0 = time.perf_counter()
            fresh = []
            for h, d in pairs:
                fresh.append(torch.empty_like(d))
                if copy:
                    with torch.cuda.stream(stream):
                        fresh[-1].copy_(h, non_blocking=True)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            del fresh
        out[f"{name}_s"] = _common.stats(times)
    torch.cuda.empty_cache()
    return out


def _plain_to(opt, device: torch.device) -> dict[str, Any]:
    """``.to("cpu")`` then ``.to(device)`` of the same tensors (pageable host memory)."""
    devs = [d for _, d in _moved_pairs(opt)]
    nbytes = sum(d.numel() * d.element_size() for d in devs)
    _common.cuda_sync(device)
    t0 = time.perf_counter()
    host = [d.to("cpu") for d in devs]
    t1 = time.perf_counter()
    back = [h.to(device) for h in host]
    _common.cuda_sync(device)
    t2 = time.perf_counter()
    del host, back
    return {"bytes": nbytes, "to_cpu_s": t1 - t0, "to_device_s": t2 - t1,
            "to_cpu_gbps": _gbps(nbytes, t1 - t0), "to_device_gbps": _gbps(nbytes, t2 - t1)}


def _memory_saver(opt, device: torch.device, reps: int) -> dict[str, Any]:
    """torch_memory_saver's ``pause()`` / ``resume()`` of the same bytes: a copy of every tensor
    ``offload()`` moves, allocated in its region with a CPU backup (``hook_mode="torch"``: its
    allocator in a MemPool of this process, no LD_PRELOAD), paused and resumed ``reps`` times
    after a first cycle that allocates its host backup, then again with
    ``retain_cpu_backup`` (the backup kept between cycles, as ``offload()`` keeps its pinned
    copies). Values are checked after the last resume."""
    try:
        import torch_memory_saver  # type: ignore[import-not-found]
        from torch_memory_saver import torch_memory_saver as tms  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - recorded: why it was not measured
        return {"measured": False, "why": f"not importable: {type(e).__name__}: {e}"}
    version = _common._package_version("torch_memory_saver") or getattr(
        torch_memory_saver, "__version__", "?")
    if device.type != "cuda":
        return {"measured": False, "version": version, "why": "CUDA only"}
    if host_state.allocator_expandable():
        return {"measured": False, "version": version,
                "why": "torch_memory_saver refuses expandable_segments"}
    try:
        tms.hook_mode = "torch"
        devs = [d for _, d in _moved_pairs(opt)]
        with tms.region(enable_cpu_backup=True):
            theirs = [torch.empty_like(d) for d in devs]
        for t, d in zip(theirs, devs):
            t.copy_(d)
        nbytes = sum(t.numel() * t.element_size() for t in theirs)
        out: dict[str, Any] = {"measured": True, "version": version, "bytes": nbytes}
        for name, retain in (("default", False), ("retain_cpu_backup", True)):
            tms.retain_cpu_backup = retain
            pause, resume = [], []
            for _ in range(reps + 1):
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                tms.pause()
                torch.cuda.synchronize(device)
                t1 = time.perf_counter()
                tms.resume()
                torch.cuda.synchronize(device)
                pause.append(t1 - t0)
                resume.append(time.perf_counter() - t1)
            out[name] = {"first_pause_s": pause[0], "first_resume_s": resume[0],
                         "pause_s": _common.stats(pause[1:]), "resume_s": _common.stats(resume[1:]),
                         "pause_gbps": _rate(nbytes, pause[1:])["median"],
                         "resume_gbps": _rate(nbytes, resume[1:])["median"]}
        out["values_kept"] = all(torch.equal(t, d) for t, d in zip(theirs, devs))
        del theirs
        torch.cuda.empty_cache()
        return out
    except Exception as e:  # noqa: BLE001 - a peer that fails is reported, the run goes on
        return {"measured": False, "version": version, "why": f"{type(e).__name__}: {e}"}


def _rollout(freed: int, fraction: float, device: torch.device, alloc: str) -> dict[str, Any]:
    """Allocate ``fraction`` of the freed bytes (by ``cudaMalloc``, or in expandable segments
    as an engine that maps its own memory does), write and reduce them, free them."""
    nbytes = int(freed * fraction)
    if device.type != "cuda" or nbytes <= 0:
        return {"bytes": 0}
    t0 = time.perf_counter()
    expandable = alloc == "expandable" and not host_state.allocator_expandable()
    if expandable:  # for this allocation alone
        torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    try:
        t = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    finally:
        if expandable:
            torch._C._accelerator_setAllocatorSettings("expandable_segments:False")
    t.fill_(1.0)
    t.mul_(2.0)
    total = float(t[: 1 << 24].float().sum())
    torch.cuda.synchronize(device)
    peak_used = _device_used(device)
    del t
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "s": time.perf_counter() - t0, "check": total,
            "device_used_with_rollout": peak_used}


def _run(rank: int, world: int, a: argparse.Namespace, device: torch.device,
         baseline: int | None) -> dict[str, Any]:
    """The whole benchmark on rank ``rank`` of ``world`` (the whole run at DP 1), its result;
    ``baseline``: its GPU's CUDA-context baseline (None on CPU)."""
    result: dict[str, Any] = {}
    if device.type == "cuda":
        result["baseline_cuda_context_used"] = baseline
        # Identical losses need a deterministic backward: cuBLAS with a fixed workspace, and
        # no cuDNN attention (its backward is non-deterministic; flash attention then runs,
        # with its deterministic backward, which warn_only=True would not select).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.use_deterministic_algorithms(True)  # flash attention's backward too
        # deterministic mode would also fill every torch.empty (host copies included)
        torch.utils.deterministic.fill_uninitialized_memory = False
    flat = _common.make_batches(a.model, a.preset, rank, world, a.micro_batch,
                                a.cycles * a.accumulate, device)
    batches = [flat[i:i + a.accumulate] for i in range(0, len(flat), a.accumulate)]
    hp = _peers.Hyper()

    def build():
        return _common.build_model(a.model, a.preset, device, num_layers=a.num_layers)

    # With --noise-check the reference runs twice: if two runs without offload differ, the
    # loss comparison below measures the backward's nondeterminism, not offload.
    for key in ("reference_losses", "reference_again_losses")[:2 if a.noise_check else 1]:
        ref = _peers.setup_shardopt(build(), hp, device)
        result[key] = [_train(ref, b) for b in batches]
        del ref
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if a.noise_check:
        result["reference_repeatable"] = (result["reference_losses"]
                                          == result["reference_again_losses"])

    timeline = _common.MemoryTimeline(device)
    sys_ = _peers.setup_shardopt(build(), hp, device)
    opt = sys_.optimizer
    result["bytes_by_kind"] = opt.memory_bytes()
    mem = {"reserved_before_training": _reserved(device),
           "device_used_before_training": _device_used(device)}
    timeline.mark("setup")
    losses, cycles = [], []
    modes = a.h2d.split(",")
    default_h2d = "kernel" if host_state.h2d_by_kernel() else "copy_engine"
    for i, b in enumerate(batches):
        losses.append(_train(sys_, b))
        timeline.mark("train")
        _peers.barrier()  # every rank offloads at once (no-op at DP 1), and onloads below
        held = _reserved(device)
        free_before = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        t0 = time.perf_counter()
        opt.offload()
        t_off = time.perf_counter() - t0
        timeline.mark("offload")
        c = {"offload_s": t_off, "reserved_before": held, "reserved_offloaded": _reserved(device),
             "device_used_offloaded": _device_used(device)}
        freed = held - c["reserved_offloaded"]
        c["rollout"] = _rollout(freed, a.rollout_fraction, device, a.rollout_alloc)
        if i == 0 and device.type == "cuda":
            # Another process takes nearly all the free memory: more than was free before
            # the offload, so it only fits because the offload gave the memory back.
            free_now = torch.cuda.mem_get_info(device)[0]
            want = max(0, free_now - (2 << 30))  # its own CUDA context needs some
            c["other_process"] = {"alloc_bytes": want, "free_before_offload": free_before,
                                  "fits_only_after_offload": want > free_before,
                                  "device_used_seen": _probe(device.index, want)}
        timeline.mark("rollout")
        _peers.barrier()
        c["h2d"] = modes[i % len(modes)]
        t0 = time.perf_counter()
        opt.onload(copy=c["h2d"])
        _common.cuda_sync(device)
        c["onload_s"] = time.perf_counter() - t0
        c["reserved_onloaded"] = _reserved(device)
        c["device_used_onloaded"] = _device_used(device)
        timeline.mark("onload")
        cycles.append(c)
        if i == 0:
            result["host_rss_after_cycle_1"] = _common.host_rss_bytes()
    # Back to back, nothing between (as torch_memory_saver's pause/resume below): timed.
    b2b_off, b2b_on = [], []
    for _ in range(len(batches), a.rss_cycles):
        _peers.barrier()
        _common.cuda_sync(device)
        t0 = time.perf_counter()
        opt.offload()
        t1 = time.perf_counter()
        opt.onload()
        _common.cuda_sync(device)
        b2b_off.append(t1 - t0)
        b2b_on.append(time.perf_counter() - t1)
    _common.cuda_sync(device)
    result["host_rss_after_last_cycle"] = _common.host_rss_bytes()
    result["rss_cycles"] = max(a.rss_cycles, len(batches))
    result["host_copy_bytes"] = sum(h.host.numel() * h.host.element_size()
                                    for h in opt.shard_state.held.values()
                                    if h.host is not None and h.where != "staged")
    result["losses"] = losses
    result["losses_identical"] = losses == result["reference_losses"]

    moved = sum(h.numel() * h.element_size() for h, _ in _moved_pairs(opt))
    steady = cycles[1:] or cycles  # the first offload also registers the host memory
    off_times = [c["offload_s"] for c in steady]
    # Onload times by copy method, of the steady cycles (all of them where it had none).
    times = {m: [c["onload_s"] for c in steady if c["h2d"] == m]
             or [c["onload_s"] for c in cycles if c["h2d"] == m] for m in modes}
    by_h2d = {m: {"s": _common.stats(v), "gbps": _rate(moved, v)["median"],
                  "gbps_range": _rate(moved, v)}
              for m, v in times.items() if v}
    on_mode = default_h2d if default_h2d in modes else modes[0]
    raw = _raw_copies(opt, device, a.reps)
    last = cycles[-1]
    mem.update(reserved_after_offload=last["reserved_offloaded"],
               reserved_after_onload=last["reserved_onloaded"],
               device_used_after_offload=last["device_used_offloaded"],
               device_used_after_onload=last["device_used_onloaded"])
    result.update(
        cycles=cycles, memory=mem, moved_bytes=moved,
        offload={"s": _common.stats(off_times), "gbps": _rate(moved, off_times)["median"],
                 "gbps_range": _rate(moved, off_times), "first_s": cycles[0]["offload_s"]},
        onload={"s": _common.stats(times[on_mode]), "gbps": _rate(moved, times[on_mode])["median"],
                "gbps_range": _rate(moved, times[on_mode]), "h2d": on_mode},
        onload_by_h2d=by_h2d,
        back_to_back={} if not b2b_on else {
            "cycles": len(b2b_on), "h2d": default_h2d,
            "offload": {"s": _common.stats(b2b_off), "gbps": _rate(moved, b2b_off)["median"],
                        "gbps_range": _rate(moved, b2b_off)},
            "onload": {"s": _common.stats(b2b_on), "gbps": _rate(moved, b2b_on)["median"],
                       "gbps_range": _rate(moved, b2b_on)}},
        raw_pinned=raw, timeline=timeline.as_list(), model=a.model,
        parameters=_common.param_count(sys_.model))
    if not a.no_peers and rank == 0:
        result.update(plain_to=_plain_to(opt, device),
                      torch_memory_saver=_memory_saver(opt, device, a.reps))
    if device.type == "cuda":
        base = result["baseline_cuda_context_used"]
        worst = max(c["device_used_offloaded"] for c in cycles)
        result["targets"] = {
            "offload_vs_raw": result["offload"]["gbps"] / raw["d2h_gbps"],
            "onload_vs_raw": result["onload"]["gbps"] / raw["h2d_bar_gbps"],
            "offloaded_used_above_context_gib": (worst - base) / _common.GIB,
            "other_process_fits_only_after_offload":
                cycles[0]["other_process"]["fits_only_after_offload"],
            "met": (result["offload"]["gbps"] >= 0.9 * raw["d2h_gbps"]
                    and result["onload"]["gbps"] >= 0.9 * raw["h2d_bar_gbps"]
                    and worst - base <= 1 << 30 and result["losses_identical"]),
        }
    return result


def _memory_saver_measured(result: dict[str, Any]) -> bool:
    """Whether torch_memory_saver was measured: 0.0.10 then aborts the interpreter's teardown
    ("only support interesting region", tms_torch_free), so the process leaves without it once
    its result is out."""
    return bool((result.get("torch_memory_saver") or {}).get("measured"))


def _rank(rank: int, world: int, a: dict, baselines: list[int | None]) -> dict[str, Any]:
    """Rank ``rank`` of ``world`` at ``--nproc`` > 1, in a fresh process (``_peers.spawn``)."""
    result = _run(rank, world, argparse.Namespace(**a), _peers.rank_device(rank, a["device"]),
                  baselines[rank])
    if _memory_saver_measured(result):
        atexit.register(os._exit, 0)  # after _peers._entry has written the result
    return result


# Per target, how its worst value is picked (a bool's is False): a run meets a target if its
# worst rank does.
_WORST = {"offload_vs_raw": min, "onload_vs_raw": min, "offloaded_used_above_context_gib": max,
          "other_process_fits_only_after_offload": min, "losses_identical": min, "met": min}


def _worst_rank(ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each target, the first rank farthest from it and its value there (on CPU, with no
    ``targets``, the losses only)."""
    rows = [{"losses_identical": r["losses_identical"], **r.get("targets", {})} for r in ranks]
    out = {}
    for key, worse in _WORST.items():
        if key in rows[0]:
            values = [row[key] for row in rows]
            rank = values.index(worse(values))
            out[key] = {"rank": rank, "value": values[rank]}
    return out


def _plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = result["timeline"]
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.step([e["t_s"] for e in ev], [e["reserved"] / _common.GIB for e in ev], where="post",
            label="reserved at event")
    ax.plot([e["t_s"] for e in ev], [e["peak_reserved"] / _common.GIB for e in ev], ".",
            label="peak reserved since previous event")
    ax.set_xlabel("s")
    ax.set_ylabel("GiB")
    ax.set_title("GPU memory: train step, offload, rollout, onload")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=1, help="ranks, one per GPU (data parallel)")
    p.add_argument("--out", required=True, help="JSON result file")
    p.add_argument("--plot", default=None,
                   help="PNG of GPU memory over time (rank 0's at --nproc > 1)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", choices=_common.MODELS, default="gpt",
                   help="the reference GPT, or Hugging Face's LlamaForCausalLM from a config")
    p.add_argument("--preset", default="1b")
    p.add_argument("--num-layers", type=int, default=None,
                   help="the preset's layers replaced (a larger model: 64 layers of 1b, 3.3B)")
    p.add_argument("--no-peers", action="store_true",
                   help="skip the plain .to() copies and torch_memory_saver (time, host memory)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--accumulate", type=int, default=1,
                   help="micro-batches (forward+backward) per training step, before its step")
    p.add_argument("--cycles", type=int, default=20, help="train + colocation cycles")
    p.add_argument("--rss-cycles", type=int, default=100, help="offload/onload cycles in all")
    p.add_argument("--rollout-fraction", type=float, default=0.9)
    p.add_argument("--rollout-alloc", choices=("cudamalloc", "expandable"), default="cudamalloc",
                   help="how the rollout allocates: cudaMalloc'd memory given back by cudaFree "
                        "(onload right after copies slower by the copy engine), or mapped "
                        "pages given back by unmapping (torch_memory_saver, vLLM's sleep mode)")
    p.add_argument("--reps", type=int, default=5, help="repetitions of the raw copies")
    p.add_argument("--h2d", default="kernel,copy_engine",
                   help="onload's ways to copy to the device, taken in turn by the cycles")
    p.add_argument("--noise-check", action="store_true",
                   help="run the reference twice and record whether it repeats bit for bit")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds the ranks may run at --nproc > 1 before they are killed")
    a = p.parse_args(argv)
    if a.nproc < 1 or a.accumulate < 1:
        p.error("--nproc and --accumulate must be at least 1")
    if a.nproc > 1 and a.device == "cuda" and torch.cuda.device_count() < a.nproc:
        p.error(f"--nproc {a.nproc} needs {a.nproc} GPUs, found {torch.cuda.device_count()}")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the ranks inherit it
    t0 = time.perf_counter()
    # Before this process or any rank touches CUDA: the only context on each GPU, the probe's.
    baselines = ([_probe(r) for r in range(a.nproc)] if a.device == "cuda"
                 else [None] * a.nproc)
    if a.nproc == 1:
        ranks = [_run(0, 1, a, _peers.rank_device(0, a.device), baselines[0])]
    else:
        try:
            ranks = _peers.spawn(_rank, a.nproc, vars(a), baselines, device=a.device,
                                 timeout_s=a.timeout)
        except _peers.RankFailed as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
    result = ranks[0]
    result["wall_s"] = time.perf_counter() - t0
    by_rank = {} if a.nproc == 1 else {"by_rank": ranks, "worst_rank": _worst_rank(ranks)}
    doc = _common.run_header(torch.device(a.device), vars(a)) | {
        "dp_size": a.nproc, "result": result, **by_rank}
    _common.write_json(a.out, doc)
    if a.plot and a.device == "cuda":
        _plot(result, a.plot)
    summary = {k: result.get(k) for k in ("losses_identical", "moved_bytes", "targets")}
    summary["offload_gbps"] = result["offload"]["gbps"]
    summary["onload_gbps"] = result["onload"]["gbps"]
    if "worst_rank" in doc:
        summary["worst_rank"] = doc["worst_rank"]
    print(summary, flush=True)
    if _memory_saver_measured(result) and a.nproc == 1:  # the result is written
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
