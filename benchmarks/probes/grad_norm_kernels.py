"""Sum of squared gradients over a step's grad views: which way of computing it reads fastest.

The clipped step reads every grad twice: once for the global norm, once in the update. This
times the norm pass alone, on views cut as the optimizer's layout cuts the grad buffer (one
view per bucket of ``--bucket-numel`` elements, each this rank's shard), for a buffer of
``--numel`` elements of ``--dtype``:

* ``foreach``      : ``torch._foreach_norm(views, dtype=float32)``, then stack, square, sum;
* ``vector_norm``  : one ``torch.linalg.vector_norm(view, dtype=float32)`` per view, then the same;
* ``whole``        : one ``vector_norm`` over the contiguous run the views cover (DP 1: the
                     shards are the buckets, back to back), a bound for the per-view forms.

Each variant: median, min and max over ``--repeats`` timed calls (CUDA events), as GB/s of the
bytes read, beside a device-to-device copy of the same bytes (read + write / time). The
values of the variants agree within fp32 summation order (printed).

    python3 benchmarks/probes/grad_norm_kernels.py --numel 1e9 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suites' helpers
from _common import cuda_time_ms, run_header, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=float, default=1e9)
    ap.add_argument("--bucket-numel", type=int, default=40_000_000)
    ap.add_argument("--dp", type=int, default=1, help="views are rank 0's shard of each bucket")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    numel = int(args.numel)
    flat = torch.randn(numel, device="cuda").to(dtype)
    views, covered = [], 0
    for start in range(0, numel, args.bucket_numel):
        size = min(args.bucket_numel, numel - start)
        shard = size // args.dp
        views.append(flat.narrow(0, start, shard))
        covered = start + shard
    read = sum(v.numel() for v in views) * flat.element_size()

    def foreach():
        return torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32)).square().sum()

    def vector_norm():
        return torch.stack([torch.linalg.vector_norm(v, 2, dtype=torch.float32)
                            for v in views]).square().sum()

    def whole():
        return torch.linalg.vector_norm(flat.narrow(0, 0, covered), 2,
                                        dtype=torch.float32).square()

    variants = {"foreach": foreach, "vector_norm": vector_norm}
    if args.dp == 1:
        variants["whole"] = whole
    dst = torch.empty_like(flat)
    results = {"copy": {"ms": cuda_time_ms(lambda: dst.copy_(flat), args.repeats, warmup=5),
                        "bytes": 2 * flat.numel() * flat.element_size()}}
    values = {}
    for name, fn in variants.items():
        values[name] = float(fn())
        results[name] = {"ms": cuda_time_ms(fn, args.repeats, warmup=5), "bytes": read}
    for name, r in results.items():
        r["gbps_median"] = r["bytes"] / r["ms"]["median"] / 1e6
        print(f"{name:12s} {r['ms']['median']:.3f} ms (min {r['ms']['min']:.3f}, max "
              f"{r['ms']['max']:.3f})  {r['gbps_median']:.0f} GB/s")
    print("values:", values)
    out = {**run_header(flat.device, vars(args) | {"out": str(args.out)}),
           "benchmark": "grad_norm_kernels", "world_size": 1, "views": len(views),
           "results": results, "values": values}
    if args.out is not None:
        write_json(args.out / f"grad_norm_kernels_{args.dtype}_dp{args.dp}.json", out)


if __name__ == "__main__":
    main()
