"""Optimizer memory per rank: bytes each DP rank holds, measured, against 12 bytes/param / DP size.

Builds a reference model (``shardopt.recipes.model`` preset, bf16 with fp32 norms and
routers), takes one step at each DP size on CPU/gloo, and reads
``DistributedOptimizer.memory_bytes()`` on every rank. The expected optimizer
state is 12 bytes per bf16 param (fp32 main copy + two fp32 moments) and 8 per
fp32 param (two moments; the param itself is the main copy), divided by the DP
size; padding makes up the difference.

    python benchmarks/probes/memory_per_rank.py --preset small --dp 1,2,4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suites' helpers
from _common import format_table, run_header, write_json  # noqa: E402

import shardopt  # noqa: E402
from shardopt.recipes.model import build_model, model_config, no_decay  # noqa: E402


def _rank(rank: int, world: int, preset: str, store: str, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    cfg = model_config(preset)
    model = build_model(cfg, seed=0)
    opt = shardopt.DistributedOptimizer(model, shardopt.OptimizerConfig(), param_group_fn=no_decay)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    numel = {dt: sum(p.numel() for p in model.parameters() if p.dtype == dt)
             for dt in (torch.bfloat16, torch.float32)}
    torch.save({"rank": rank, "memory": opt.memory_bytes(), "numel_bf16": numel[torch.bfloat16],
                "numel_fp32": numel[torch.float32]}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dp", default="1,2,4", help="comma-separated DP sizes")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    rows, results = [], []
    for world in (int(x) for x in args.dp.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank, args=(world, args.preset, f"{tmp}/store", tmp), nprocs=world)
            per_rank = [torch.load(f"{tmp}/rank{r}.pt") for r in range(world)]
        n16, n32 = per_rank[0]["numel_bf16"], per_rank[0]["numel_fp32"]
        expected = (12 * n16 + 8 * n32) / world
        states = [r["memory"]["optimizer_state"] for r in per_rank]
        results.append({"dp_size": world, "numel_bf16": n16, "numel_fp32": n32,
                        "expected_state_bytes": expected, "per_rank": per_rank})
        rows.append([world, f"{n16 + n32:,}", f"{expected / 2**20:.2f}",
                     f"{max(states) / 2**20:.2f}", f"{max(states) / expected:.4f}",
                     f"{per_rank[0]['memory']['params'] / 2**20:.2f}",
                     f"{per_rank[0]['memory']['grads'] / 2**20:.2f}"])
    print(format_table(rows, ["dp", "params", "expected state MiB", "state MiB (max rank)",
                              "ratio", "param buffer MiB", "grad buffer MiB"]))
    path = Path(args.out) / "memory_per_rank.json"
    write_json(path, {**run_header(torch.device("cpu"), vars(args)),
                      "benchmark": "memory_per_rank", "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
