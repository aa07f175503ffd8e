"""How much a background save holds up the training thread, and in which of its parts.

The training thread runs a tight loop of tiny torch ops (each releases and retakes the GIL,
as a loop launching kernels does) while ``checkpoint.save(..., blocking=False)`` writes the
``--preset`` model's state; every op is timestamped. Reported per save: the op time alone
and during the write, the total time the loop lost (sum of the ops' excess over the median
alone), and the longest gaps with the save's parts that were running then (each part is
wrapped with a timer). A long gap during a part that runs Python or C code holding the GIL
(JSON, headers, splitting) is time the training loop cannot launch anything.

    PYTHONPATH=src python3 benchmarks/probes/writer_gil.py --out $OUT                   # GPU, 1b
    PYTHONPATH=src python3 benchmarks/probes/writer_gil.py --device cpu --preset small --out /tmp
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suites' helpers
import _common  # noqa: E402
import _peers  # noqa: E402

PARTS = {
    "shardopt.checkpoint.save": ["_take_snapshot", "_manifest_base", "_split",
                                 "write_rank_files", "_manifest_text", "agree"],
    "shardopt.checkpoint.storage": ["write_file", "build_header", "write_scratch"],
    "shardopt.checkpoint.commit": ["begin", "commit", "fsync_dir"],
}


def _wrap(log: list) -> None:
    also = [importlib.import_module(m) for m in PARTS]  # modules that imported a name directly
    for mod_name, names in PARTS.items():
        mod = importlib.import_module(mod_name)
        _common.timed_parts(mod, [n for n in names if hasattr(mod, n)], log, also)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--preset", default="1b")
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--snapshots", default="host")
    p.add_argument("--writers", default="process,threads",
                   help="who writes the files: the writer process, or threads of this one")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    device = _peers.single_rank_group(args.device)
    from shardopt import checkpoint
    log: list = []
    _wrap(log)
    model = _peers.build_gpt(args.preset, device, seed=0)
    opt = _peers.setup_shardopt(model, _peers.Hyper(), device).optimizer
    x, y = _peers.make_batches(args.preset, 0, 1, 1, 1, device)[0]
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    probe = torch.zeros(1)

    def loop(n: int | None, until=None) -> list[float]:
        ts = [time.perf_counter()]
        while (until is None and len(ts) <= n) or (until is not None and not until()):
            probe.add_(1)
            ts.append(time.perf_counter())
        return ts

    alone = loop(20000)
    op_alone = statistics.median(b - a for a, b in zip(alone, alone[1:]))
    result: dict = {"op_alone_us": op_alone * 1e6, "saves": []}
    print(f"op alone {op_alone * 1e6:.2f} us", flush=True)
    snapshot = importlib.import_module("shardopt.checkpoint.background").of(opt).snapshot
    shared = snapshot.shared
    for writer, snap in [(w, s) for w in args.writers.split(",")
                         for s in args.snapshots.split(",")]:
        # Unshared snapshot buffers make the save write on threads of this process.
        snapshot.release()
        snapshot.shared = shared and writer == "process"
        root = Path(tempfile.mkdtemp(prefix="writer-gil-", dir=args.dir))
        try:
            for i in range(args.saves + 1):
                log.clear()
                t0 = time.perf_counter()
                h = checkpoint.save(root, model, opt, step=i, keep_last=1, blocking=False,
                                    config=checkpoint.CheckpointConfig(snapshot=snap))
                ts = loop(None, h.done)
                h.wait()
                gaps = [b - a for a, b in zip(ts, ts[1:])]
                lost = sum(max(0.0, g - op_alone) for g in gaps)
                top = sorted(zip(gaps, ts), reverse=True)[:8]
                row = {"writer": writer if snapshot.shared or writer == "threads" else
                       "threads (no memfd)", "snapshot": snap, "call_s": ts[0] - t0, "write_s": ts[-1] - t0,
                       "op_median_us": statistics.median(gaps) * 1e6 if gaps else 0.0,
                       "lost_s": lost,
                       "top_gaps": [{"ms": g * 1e3, "at_ms": (a - t0) * 1e3,
                                     "during": sorted({n for n, s, e in log
                                                       if s < a + g and e > a})}
                                    for g, a in top],
                       "parts": [(n, (s - t0) * 1e3, (e - t0) * 1e3) for n, s, e in
                                 sorted(log, key=lambda r: r[1])]}
                if i:  # the first save allocates its snapshot
                    result["saves"].append(row)
                print(f"[{writer} {snap} save {i}] call {row['call_s'] * 1e3:.1f} ms, write "
                      f"{row['write_s']:.2f} s, op median {row['op_median_us']:.2f} us, "
                      f"loop lost {lost * 1e3:.1f} ms", flush=True)
                for gap in row["top_gaps"][:5]:
                    print(f"    gap {gap['ms']:.1f} ms at {gap['at_ms']:.0f} ms during "
                          f"{gap['during']}", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    doc = {**_common.run_header(device, vars(args)), "benchmark": "writer_gil", **result}
    _common.write_json(Path(args.out) / f"writer_gil_{args.device}{args.tag}.json", doc)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
