"""Block size and warps of the Triton AdamW kernel (``shardopt.kernels``), timed alone.

One flat bf16-param shard of ``--numel`` elements (fp32 main params; grads and moments in
each ``--combos`` setting), one param group, every block full: what each (BLOCK, num_warps)
pair gets from memory (the bytes that setting moves), against a device copy measured in the
same run. ``--modes`` adds the kernel as a clipped step runs it (``clip``: a grad scale) and as
a step without clipping does (``norm``: per-block sums of squared grads for the grad norm).
Prints a table and writes ``step_kernel_sweep.json``.

    PYTHONPATH=src python3 benchmarks/probes/step_kernel_sweep.py --out benchmarks/results \\
        --combos fp32/fp32/fp32,bf16/bf16/fp32,int8/int8/fp32,int8/int8/bf16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suites' helpers
import _common  # noqa: E402
from shardopt import kernels, quant  # noqa: E402

CONFIGS = ((1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8),
           (8192, 16))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": "int8"}


def _moment(kind: str, n: int, device: torch.device, sqrt: bool):
    """A moment in the storage form the optimizer keeps (random codes and scales for int8)."""
    mom = quant.Moment(DTYPES[kind], n, device, sqrt=sqrt)
    if mom.scales is not None:
        mom.values.random_(0, 100)
        mom.scales.uniform_(1e-6, 1e-5)
    return mom


def _bytes_per_element(m: str, v: str, g: str) -> float:
    """Grad read; main param read+write; each moment (scales included) read+write; bf16 write."""
    grad = 2 if g == "bf16" else 4
    return grad + 8 + 2 * (quant.bytes_per_element(DTYPES[m]) + quant.bytes_per_element(DTYPES[v])) + 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=float, default=1e9)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--combos", default="fp32/fp32/fp32",
                    help="comma-separated exp_avg/exp_avg_sq/grad dtypes (fp32, bf16, int8)")
    ap.add_argument("--configs", default=",".join(f"{b}x{w}" for b, w in CONFIGS),
                    help="comma-separated BLOCKxnum_warps pairs")
    ap.add_argument("--modes", default="plain",
                    help="comma-separated: plain; clip (a grad scale, as a clipped step); "
                         "norm (the per-block sums of squared grads, as a step without "
                         "clipping computes the grad norm)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="", help="suffix of the result file name")
    args = ap.parse_args(argv)
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    if not (torch.cuda.is_available() and kernels.available(torch.device("cuda"))):
        ap.error("needs CUDA and Triton")
    device = torch.device("cuda", 0)
    n = int(args.numel) // quant.QBLOCK * quant.QBLOCK
    main_ = torch.randn(n, device=device)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(main_)
    copy = _common.cuda_time_ms(lambda: dst.copy_(main_), args.repeats)
    del dst
    copy_gbps = 8 * n / copy["median"] / 1e6
    rows, results = [], []
    default = (kernels.BLOCK, kernels.NUM_WARPS)
    modes = args.modes.split(",")
    scale = torch.tensor(1.5, device=device)  # what a clipped step divides the grads by
    try:
        for combo in args.combos.split(","):
            m_kind, v_kind, g_kind = combo.split("/")
            grads = (torch.randn(n, device=device) * 1e-3).to(DTYPES[g_kind])
            m = _moment(m_kind, n, device, sqrt=False)
            v = _moment(v_kind, n, device, sqrt=True)
            per_elem = _bytes_per_element(m_kind, v_kind, g_kind)
            for mode, (block, warps) in ((md, c) for md in modes for c in configs):
                kernels.BLOCK, kernels.NUM_WARPS = block, warps
                is_default = (block, warps) == default
                table = kernels.chunk_table([kernels.ChunkPart(0, 0, 0, n)], device)
                sum_sq = (torch.empty(table.num_blocks, device=device) if mode == "norm"
                          else None)
                r = _common.cuda_time_ms(lambda t=table, sq=sum_sq, md=mode: kernels.adamw_(
                    t, main_, grads, m, v, out, main_global=False, lr=1e-4,
                    beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3,
                    grad_scale=scale if md == "clip" else None, sum_sq=sq), args.repeats)
                gbps = per_elem * n / r["median"] / 1e6
                results.append({"combo": combo, "mode": mode, "block": block,
                                "num_warps": warps, "ms": r, "gbps": gbps,
                                "of_copy": gbps / copy_gbps, "bytes_per_element": per_elem,
                                "default": is_default})
                rows.append([combo, mode, block, warps, r["median"], gbps,
                             f"{100 * gbps / copy_gbps:.1f}%", "*" if is_default else ""])
    finally:
        kernels.BLOCK, kernels.NUM_WARPS = default
    print(f"copy: {copy['median']:.3f} ms, {copy_gbps:.0f} GB/s")
    print(_common.format_table(rows, ["m/v/grad", "mode", "BLOCK", "warps", "median ms", "GB/s",
                                      "of copy", "default"]))
    doc = _common.run_header(device, {"numel": n, "repeats": args.repeats,
                                      "combos": args.combos, "configs": args.configs,
                                      "modes": args.modes})
    doc.update({"benchmark": "step_kernel_sweep", "copy_ms": copy, "copy_gbps": copy_gbps,
                "results": results})
    _common.write_json(Path(args.out) / f"step_kernel_sweep{args.tag}.json", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
