"""Quantisation error of candidate 8-bit moment formats on real Adam state (CPU, a minute).

Trains the reference job's model (``--preset``, default ``small``) for ``--steps`` steps with
fp32 state, takes every param's exp_avg (m) and exp_avg_sq (v), and stores them in each
candidate format (per param, blocks of the flattened param, as shardopt does). Reports for m,
v and the Adam direction ``m / (sqrt(v) + eps)``: the normwise relative error
``||q - x|| / ||x||``, the median elementwise relative error, and the share of nonzero
entries flushed to zero (a flushed v turns its element's step into ``m / eps``).

    PYTHONPATH=src python3 benchmarks/probes/lowprec_quant_error.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suites' helpers
from lowprec_quality import job_parts  # noqa: E402

from shardopt import DistributedOptimizer, OptimizerConfig  # noqa: E402


def blockwise(x: torch.Tensor, block: int, fmt: str, sqrt: bool) -> torch.Tensor:
    """``x`` after a round trip through absmax-scaled blocks of ``fmt`` (e4m3 or int8)."""
    y = x.sqrt() if sqrt else x
    b = F.pad(y, (0, -y.numel() % block)).view(-1, block)
    # int8: signed for m, unsigned (0..255) for sqrt(v), which is never negative
    top = 448.0 if fmt == "e4m3" else 255.0 if sqrt else 127.0
    scale = b.abs().amax(dim=1, keepdim=True) / top
    q = b / torch.where(scale == 0, 1.0, scale)
    q = q.to(torch.float8_e4m3fn).float() if fmt == "e4m3" else q.round().clamp(-top, top)
    out = (q * scale).view(-1)[:x.numel()]
    return out.square() if sqrt else out


FORMATS = {
    "bf16": lambda x, sqrt: x.to(torch.bfloat16).float(),
    **{f"{fmt}_b{block}{'_sqrt' if sq else ''}": (
        lambda x, sqrt, fmt=fmt, block=block, sq=sq: blockwise(x, block, fmt, sq and sqrt))
       for fmt in ("e4m3", "int8") for block in (64, 128, 256) for sq in (False, True)},
}


def errors(q: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    nz = x != 0
    rel = ((q - x).abs() / x.abs())[nz]
    return {"normwise": float((q - x).norm() / x.norm()),
            "median_elementwise": float(rel.median()) if rel.numel() else 0.0,
            "flushed_to_zero": float(((q == 0) & nz).sum() / nz.sum().clamp(min=1))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args(argv)
    model_config, build_model, no_decay, MarkovTask, BatchPlan, local_batches = job_parts()
    mcfg = model_config(args.preset)
    model = build_model(mcfg, seed=0)
    opt = DistributedOptimizer(model, OptimizerConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                                                      max_grad_norm=1.0, step_kernel="torch"),
                               param_group_fn=no_decay)
    task = MarkovTask(vocab_size=mcfg.vocab_size, seq_len=mcfg.seq_len, seed=0)
    plan = BatchPlan(global_batch_size=args.batch_size, dp_size=1, dp_rank=0,
                     micro_batch_size=args.batch_size)
    for step in range(args.steps):
        (x, y), = local_batches(task, plan, step * args.batch_size)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    shards = opt.layout.shards(0)
    per_param = [(opt.shard_state.view("exp_avg", s), opt.shard_state.view("exp_avg_sq", s)) for s in shards]
    m = torch.cat([a for a, _ in per_param])
    v = torch.cat([b for _, b in per_param])
    eps = opt.config.eps
    direction = m / (v.sqrt() + eps)
    results = {}
    for name, fn in FORMATS.items():
        qm = torch.cat([fn(a, False) for a, _ in per_param])
        qv = torch.cat([fn(b, True) for _, b in per_param])
        results[name] = {"m": errors(qm, m), "v": errors(qv, v),
                         "direction": errors(qm / (qv.sqrt() + eps), direction)}
        print(f"{name:18s} m {results[name]['m']['normwise']:.4f}  "
              f"v {results[name]['v']['normwise']:.4f} (flushed "
              f"{100 * results[name]['v']['flushed_to_zero']:.2f}%)  direction "
              f"{results[name]['direction']['normwise']:.4f} "
              f"(median {results[name]['direction']['median_elementwise']:.4f})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"args": vars(args), "numel": m.numel(), "v_range": [float(v[v > 0].min()), float(v.max())],
           "results": results}
    (out / "lowprec_quant_error.json").write_text(json.dumps(doc, indent=1))
    print(f"wrote {out / 'lowprec_quant_error.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
