"""The AdamW update of a rank's flat shard in one pass over memory (Triton).

torch's ``_fused_adamw_`` updates a list of fp32 tensors; a mixed-precision
step then needs a second pass that reads every fp32 main param again to write
the bf16/fp16 model param. This kernel does both in one pass: per element it
reads the grad, the main param and both moments, and writes the main param,
the moments and (for bf16/fp16 buffers) the model-dtype param: 30 bytes per
element with fp32 grads, against 36 for the two passes.

The work is cut into chunks of at most ``BLOCK`` elements, each inside one
param's part of the shard; a chunk table (built once per layout) gives every
chunk's position in the rank's local state tensors and in the global
param/grad buffers, so padding between buckets is never touched and one launch
covers a whole buffer for one param group.

The arithmetic is torch's fused AdamW (``adam_math``) in fp32: decoupled weight
decay, then the moments, then ``param -= (lr / bc1) * exp_avg / (sqrt(exp_avg_sq)
/ sqrt(bc2) + eps)``; bias corrections are computed on the host in double.
Clipping divides the grad by ``grad_scale`` (a device scalar: no host sync).

Triton is optional: :func:`available` says whether this path can run (CUDA, or
Triton's interpreter on the CPU with ``TRITON_INTERPRET=1``, which the tests use).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: the optimizer falls back to torch's fused AdamW
    triton = None

BLOCK = 4096


def available(device: torch.device) -> bool:
    """Whether the Triton step can run on ``device``."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def chunk_table(parts: Sequence[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """``[n, 3]`` int64 rows (local start, global start, length) covering every
    ``(local_start, global_start, numel)`` part in chunks of at most ``BLOCK``."""
    rows = []
    for local, glob, numel in parts:
        if numel <= 0:
            continue
        starts = torch.arange(0, numel, BLOCK, dtype=torch.int64)
        rows.append(torch.stack([starts + local, starts + glob,
                                 (numel - starts).clamp(max=BLOCK)], dim=1))
    if not rows:
        return torch.zeros((0, 3), dtype=torch.int64, device=device)
    return torch.cat(rows).to(device)


if triton is not None:

    @triton.jit
    def _adamw_kernel(table_ptr, main_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr,
                      scale_ptr, lr_wd, beta1, beta2, step_size, bc2_sqrt, eps,
                      MAIN_GLOBAL: tl.constexpr, HAS_OUT: tl.constexpr, OUT_BF16: tl.constexpr,
                      HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
        row = table_ptr + tl.program_id(0).to(tl.int64) * 3
        local = tl.load(row)
        glob = tl.load(row + 1)
        n = tl.load(row + 2)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        g_idx = glob + offs
        l_idx = local + offs
        m_idx = g_idx if MAIN_GLOBAL else l_idx
        grad = tl.load(grad_ptr + g_idx, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            grad = tl.div_rn(grad, tl.load(scale_ptr))
        param = tl.load(main_ptr + m_idx, mask=mask, other=0.0)
        exp_avg = tl.load(exp_avg_ptr + l_idx, mask=mask, other=0.0)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + l_idx, mask=mask, other=0.0)
        param = param - lr_wd * param
        exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
        denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bc2_sqrt) + eps
        param = param - tl.div_rn(step_size * exp_avg, denom)
        tl.store(main_ptr + m_idx, param, mask=mask)
        tl.store(exp_avg_ptr + l_idx, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + l_idx, exp_avg_sq, mask=mask)
        if OUT_BF16:
            tl.store(out_ptr + g_idx, _to_bf16_rne(param), mask=mask)
        elif HAS_OUT:
            tl.store(out_ptr + g_idx, param.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _to_bf16_rne(x):
        """fp32 -> bf16, rounding to nearest even as torch does (NaN stays NaN). Spelled out
        in integer ops so that compiled and interpreted kernels round alike (Triton's
        interpreter truncates a plain cast)."""
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


def adamw_(table: torch.Tensor, main: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor,
           exp_avg_sq: torch.Tensor, out: torch.Tensor | None, *, main_global: bool,
           lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
           grad_scale: torch.Tensor | None) -> None:
    """One AdamW step over the chunks of ``table`` (see :func:`chunk_table`).

    ``grads`` and ``out`` (model-dtype params, or None) are whole flat buffers indexed
    by the global column; ``exp_avg``/``exp_avg_sq`` are local state tensors indexed by
    the local column; ``main`` is either (``main_global``: the fp32 param buffer itself).
    """
    n = table.shape[0]
    if n == 0:
        return
    bc1 = 1.0 - beta1 ** step
    bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
    _adamw_kernel[(n,)](
        table, main, grads, exp_avg, exp_avg_sq, out if out is not None else main,
        grad_scale if grad_scale is not None else main,
        lr * weight_decay, beta1, beta2, lr / bc1, bc2_sqrt, eps,
        MAIN_GLOBAL=main_global, HAS_OUT=out is not None,
        OUT_BF16=out is not None and out.dtype == torch.bfloat16, HAS_SCALE=grad_scale is not None,
        BLOCK=BLOCK, num_warps=8,
    )
