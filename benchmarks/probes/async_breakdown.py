"""Where an asynchronous save's stall goes: a breakdown on the ``1b`` preset, one GPU.

For each snapshot kind it times, on the iteration that contains a save and the ones after:
the ``save`` call (and its parts), the forward+backward and the step on the training
stream (CUDA events), the loop time with the training stream synchronised (what a loop
that reads its loss waits for) and with the whole device synchronised (which also waits
for the background writer's copies). Then the same with the background write replaced by a
wait for the snapshot copy only (separates the copy from the writer's CPU work), plus the
raw copy speeds (device-to-device and device-to-host, 3 repetitions, same bytes).

    PYTHONPATH=src python3 benchmarks/probes/async_breakdown.py --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import sys
import tempfile
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suites' helpers
import _common  # noqa: E402
import _peers  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="1b")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=1,
                   help="micro-batches (forward+backward) per iteration, before its step")
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--gap", type=int, default=12, help="iterations between saves")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--snapshots", default="host")
    p.add_argument("--modes", default="write,copy_only")
    p.add_argument("--tag", default="", help="suffix of the result file name")
    args = p.parse_args(argv)
    device = _peers.single_rank_group("cuda")
    from shardopt import checkpoint
    save_mod = importlib.import_module("shardopt.checkpoint.save")
    snap_mod = importlib.import_module("shardopt.checkpoint.snapshot")
    commit_mod = importlib.import_module("shardopt.checkpoint.commit")
    state_mod = importlib.import_module("shardopt.checkpoint.state")
    bg_mod = importlib.import_module("shardopt.checkpoint.background")
    from shardopt import DistributedOptimizer
    parts: list[tuple[str, float, float]] = []
    # The call's parts in the order it runs them (take, retake: the snapshot's copies queued).
    _common.timed_parts(bg_mod, ["settle", "start"], parts)
    _common.timed_parts(state_mod, ["frozen_tensors", "sources"], parts)
    _common.timed_parts(DistributedOptimizer, ["_reseed_written"], parts)
    _common.timed_parts(save_mod, ["_take_snapshot", "_manifest_base"], parts)
    _common.timed_parts(snap_mod.Snapshot, ["take", "retake"], parts)
    _common.timed_parts(commit_mod, ["begin"], parts)
    batches = _peers.make_batches(args.preset, 0, 1, args.micro_batch, 8, device)
    model = _peers.build_gpt(args.preset, device, seed=0)
    opt = _peers.setup_shardopt(model, _peers.Hyper(), device).optimizer
    _MODEL.append(model)
    stream = torch.cuda.current_stream(device)
    k = [0]

    def iteration(save_fn=None):
        x, y = batches[k[0] % 8]
        k[0] += 1
        t0 = time.perf_counter()
        call = 0.0
        if save_fn is not None:
            save_fn()
            call = time.perf_counter() - t0
        e0, e1, e2, e3 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        e0.record()
        for a in range(args.accumulate):
            if a:
                x, y = batches[k[0] % 8]
                k[0] += 1
            last = a == args.accumulate - 1
            with contextlib.nullcontext() if last else opt.no_sync():  # reduce once, at the last
                (model(x, y) / args.accumulate).backward()
        e1.record()
        t_host_fb = time.perf_counter() - t0
        opt.step()
        e2.record()
        opt.zero_grad()
        e3.record()
        stream.synchronize()
        t_stream = time.perf_counter() - t0
        torch.cuda.synchronize(device)
        t_device = time.perf_counter() - t0
        return {"call_s": call, "host_launch_fb_s": t_host_fb, "gpu_fb_s": e0.elapsed_time(e1) / 1e3,
                "gpu_step_s": e1.elapsed_time(e2) / 1e3, "stream_sync_s": t_stream,
                "device_sync_s": t_device}

    for _ in range(4):
        iteration()
    base = [iteration() for _ in range(15)]
    result = {"baseline": {key: statistics.median(r[key] for r in base) for key in base[0]}}
    print("baseline", result["baseline"], flush=True)

    nbytes = sum(b.numel() * b.element_size() for b in _state_tensors(opt))
    result["state_bytes"] = nbytes
    # Raw copies of the same bytes, 3 repetitions each.
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    for name, d in (("d2d", dst), ("d2h_pinned", host)):
        ts = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            d.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        result[f"raw_{name}_s"] = min(ts)
        print(name, min(ts), nbytes / min(ts) / 1e9, "GB/s", flush=True)
    del src, dst, host
    torch.cuda.empty_cache()

    real_write = save_mod._write_and_commit
    for mode in args.modes.split(","):
        for snap in args.snapshots.split(","):
            if mode == "copy_only":
                # work() still waits for the snapshot copy; nothing is written.
                save_mod._write_and_commit = lambda *a, **kw: None
            else:
                save_mod._write_and_commit = real_write
            root = Path(tempfile.mkdtemp(prefix="async-breakdown-", dir=args.dir))
            rows = []
            handle = None
            parts.clear()
            try:
                for s in range(args.saves + 1):
                    step = 1000 * (1 + len(result)) + s

                    def do_save(step=step):
                        nonlocal handle
                        handle = checkpoint.save(root, model, opt, step=step, keep_last=1,
                                                 blocking=False,
                                                 config=checkpoint.CheckpointConfig(snapshot=snap))
                    r = iteration(do_save)
                    r["after"] = [iteration() for _ in range(args.gap)]
                    rows.append(r)
                    if handle is not None:
                        t0 = time.perf_counter()
                        try:
                            handle.wait()
                        except Exception as e:  # noqa: BLE001
                            r["wait_error"] = repr(e)[:200]
                        r["wait_after_gap_s"] = time.perf_counter() - t0
            finally:
                shutil.rmtree(root, ignore_errors=True)
            key = f"{mode}:{snap}"
            result[key] = {"rows": rows[1:], "first": rows[0],
                           "parts_s": _median_parts(parts)}
            for r in rows[1:]:
                print(key, {k2: round(v, 4) for k2, v in r.items() if isinstance(v, float)},
                      "after:", [round(a["stream_sync_s"], 3) for a in r["after"][:6]], flush=True)
            print(key, "parts", result[key]["parts_s"], flush=True)
    save_mod._write_and_commit = real_write
    doc = {**_common.run_header(device, vars(args)), "benchmark": "async_breakdown", **result}
    _common.write_json(Path(args.out) / f"async_breakdown_1gpu{args.tag}.json", doc)
    dist.destroy_process_group()
    return 0


def _median_parts(parts: list[tuple[str, float, float]]) -> dict[str, float]:
    """Median seconds of each part's calls, the first (which allocates) left out."""
    by: dict[str, list[float]] = {}
    for name, t0, t1 in parts:
        by.setdefault(name, []).append(t1 - t0)
    return {n: statistics.median(v[1:] or v) for n, v in by.items()}


def _state_tensors(opt):
    from shardopt.checkpoint.state import contents as _state_contents
    from shardopt.checkpoint.state import frozen_tensors
    out = {}
    for job in _state_contents(opt, frozen_tensors(_MODEL[0], opt)):
        for e in job.entries:
            if e.source is not None:
                out[(e.source.data_ptr(), e.source.numel())] = e.source
    return list(out.values())


_MODEL: list = []

if __name__ == "__main__":
    sys.exit(main())
