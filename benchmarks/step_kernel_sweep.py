"""Block size and warps of the Triton AdamW kernel (``shardopt.kernels``), timed alone.

One flat bf16-param shard of ``--numel`` elements (fp32 grads, main params and moments), one
param group, every block full: what each (BLOCK, num_warps) pair gets from memory, against a
device copy measured in the same run. Prints a table and writes ``step_kernel_sweep.json``.

    PYTHONPATH=src python3 benchmarks/step_kernel_sweep.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from shardopt import kernels  # noqa: E402

CONFIGS = ((1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16))
BYTES_PER_ELEMENT = 4 + 8 + 8 + 8 + 2  # grad read; main, exp_avg, exp_avg_sq read+write; bf16 write


def _time_ms(fn, repeats: int) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return _common.stats(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=float, default=1e9)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and kernels.available(torch.device("cuda"))):
        ap.error("needs CUDA and Triton")
    device = torch.device("cuda", 0)
    n = int(args.numel)
    grads = torch.randn(n, device=device) * 1e-3
    main_ = torch.randn(n, device=device)
    m = torch.zeros(n, device=device)
    v = torch.zeros(n, device=device)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(main_)
    copy = _time_ms(lambda: dst.copy_(main_), args.repeats)
    del dst
    copy_gbps = 8 * n / copy["median"] / 1e6
    rows, results = [], []
    default = (kernels.BLOCK, kernels.NUM_WARPS)
    try:
        for block, warps in CONFIGS:
            kernels.BLOCK, kernels.NUM_WARPS = block, warps
            table = kernels.chunk_table([kernels.ChunkPart(0, 0, 0, n)], device)
            r = _time_ms(lambda t=table: kernels.adamw_(
                t, main_, grads, m, v, out, main_global=False, lr=1e-4, beta1=0.9, beta2=0.95,
                eps=1e-8, weight_decay=0.1, step=3, grad_scale=None), args.repeats)
            gbps = BYTES_PER_ELEMENT * n / r["median"] / 1e6
            results.append({"block": block, "num_warps": warps, "ms": r, "gbps": gbps,
                            "of_copy": gbps / copy_gbps, "default": (block, warps) == default})
            rows.append([block, warps, r["median"], gbps, f"{100 * gbps / copy_gbps:.1f}%",
                         "*" if (block, warps) == default else ""])
    finally:
        kernels.BLOCK, kernels.NUM_WARPS = default
    print(f"copy: {copy['median']:.3f} ms, {copy_gbps:.0f} GB/s")
    print(_common.format_table(rows, ["BLOCK", "warps", "median ms", "GB/s", "of copy", "default"]))
    doc = _common.run_header(device, {"numel": n, "repeats": args.repeats})
    doc.update({"benchmark": "step_kernel_sweep", "copy_ms": copy, "copy_gbps": copy_gbps,
                "bytes_per_element": BYTES_PER_ELEMENT, "results": results})
    _common.write_json(Path(args.out) / "step_kernel_sweep.json", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
