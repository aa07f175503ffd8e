"""Resharding a checkpoint across data-parallel sizes: save at DP N, load at M, save, load at N.

``--sizes 8,2,8`` (default) trains ``--steps`` steps at DP 8 and saves; then each later size
builds a fresh model and optimizer on its ranks, loads the previous checkpoint and saves it again
without a step; at the end every checkpoint is exported (``checkpoint.export``) and the exports
must be identical tensor for tensor (model and optimizer state). Times of each load and save
(median over ranks of rank-local times; max too) and the peak GPU memory of each phase are
recorded. One JSON under ``--out``. Needs as many GPUs as the largest size (``--device cuda``);
``--device cpu`` runs the same on gloo ranks (``--preset tiny``).

    PYTHONPATH=src python3 benchmarks/reshard.py --sizes 8,2,8 --out $OUT              # 8 GPUs
    PYTHONPATH=src python3 benchmarks/reshard.py --model hf-llama --sizes 8,2,8 --out $OUT
    PYTHONPATH=src python3 benchmarks/reshard.py --device cpu --preset tiny --sizes 2,1,3 --out /tmp
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import _peers  # noqa: E402


def _phase(rank: int, world: int, a: dict, src: str | None, dst: str) -> dict:
    from shardopt import checkpoint

    device = _peers.rank_device(rank, a["device"])
    system = _peers.setup_shardopt(
        _common.build_model(a["model"], a["preset"], device), _peers.Hyper(), device)
    out = {"rank": rank}
    if src is None:
        for x, y in _common.make_batches(a["model"], a["preset"], rank, world, a["micro_batch"],
                                         a["steps"], device):
            system.step(x, y)
    else:
        t0 = time.perf_counter()
        checkpoint.load(src, system.model, system.optimizer)
        _peers.sync(device)
        out["load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    checkpoint.save(dst, system.model, system.optimizer, step=a["steps"])
    out["save_s"] = time.perf_counter() - t0
    if device.type == "cuda":
        out["peak_allocated"] = torch.cuda.max_memory_allocated(device)
    return out


def _tensors(export_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(export_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="8,2,8", help="DP sizes in order, the first trains")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", choices=_common.MODELS, default="gpt")
    p.add_argument("--preset", default="1b")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--ckpt-dir", default=None, help="default: a new folder in /dev/shm or /tmp")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    base = Path(a.ckpt_dir or tempfile.mkdtemp(
        prefix="reshard-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    args = {k: getattr(a, k) for k in ("device", "model", "preset", "micro_batch", "steps")}
    from shardopt import checkpoint

    phases, src = [], None
    for i, n in enumerate(sizes):
        dst = str(base / f"{i}_dp{n}")
        ranks = _peers.spawn(_phase, n, args, src, dst, device=a.device, timeout_s=a.timeout)
        phase = {"dp_size": n, "save_s": _stats([r["save_s"] for r in ranks])}
        if src is not None:
            phase["load_s"] = _stats([r["load_s"] for r in ranks])
        if "peak_allocated" in ranks[0]:
            phase["peak_allocated_max"] = max(r["peak_allocated"] for r in ranks)
        phases.append(phase)
        src = dst
    exports = []
    for i, n in enumerate(sizes):
        out = base / f"export_{i}"
        checkpoint.export(base / f"{i}_dp{n}", out)
        exports.append(_tensors(out))
    first = exports[0]
    identical = all(e.keys() == first.keys() and all(torch.equal(e[k], first[k]) for k in first)
                    for e in exports[1:])
    result = {**_common.run_header(torch.device(a.device), vars(a)), "benchmark": "reshard",
              "world_size": max(sizes), "sizes": sizes,
              "phases": phases, "tensors": len(first), "exports_identical": identical}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    path = Path(a.out) / f"reshard_{a.device}{'' if a.model == 'gpt' else '_hf'}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"sizes {sizes}: exports identical: {identical}; phases {json.dumps(phases)}")
    print(f"wrote {path}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
