"""The AdamW update of a rank's flat shard in one pass over memory (Triton).

Per element the kernel reads the grad, the main param and both moments, and writes the main
param, the moments and (bf16/fp16 buffers) the model-dtype param, where torch's fused AdamW
and a copy take two passes. The work is cut into blocks of ``BLOCK`` elements on a grid
aligned to each bucket shard's start; a table (built once per layout) lists the blocks a
param group covers whole and, masked, its params' ragged ends: two launches per (buffer,
param group), padding never touched. The arithmetic is torch's fused AdamW in fp32 (bias
corrections on the host in double); bf16 and int8 moments (:mod:`.quant`) are widened in
registers, each scale block whole inside one launch (the layout's ``param_align``); with int8
moments two IEEE divisions per element become products and a fast division (docs/lowprec.md,
"The two step paths"). Triton is optional: :func:`available` (CUDA, or its interpreter on the
CPU with ``TRITON_INTERPRET=1``, as the tests run it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .quant import QBLOCK, Moment

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: the optimizer falls back to torch's fused AdamW
    triton = None

BLOCK = 1024  # elements per program; with NUM_WARPS: benchmarks/probes/step_kernel_sweep.py
NUM_WARPS = 4
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.uint8: 2}


def available(device: torch.device) -> bool:
    """Whether the Triton step can run on ``device``."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class ChunkTable:
    """Where one launch works, in blocks of ``BLOCK`` on a grid from each bucket shard's first
    element: ``full`` rows (local base, global base) lie whole inside the launch's parts,
    ``partial`` rows (local base, global base, lo, hi) cover ``[lo, hi)`` of a block."""

    full: torch.Tensor
    partial: torch.Tensor
    aligned: bool

    @property
    def num_blocks(self) -> int:
        return self.full.shape[0] + self.partial.shape[0]


@dataclass(frozen=True)
class ChunkPart:
    """One param shard of a launch: its bucket shard's first element in the local state
    (``local_base``) and the global buffers (``global_base``), and ``[start, end)`` from it."""

    local_base: int
    global_base: int
    start: int
    end: int


def chunk_table(parts: Sequence[ChunkPart], device: torch.device) -> ChunkTable:
    """The blocks that cover ``parts``, in order of local base. Parts must not overlap."""
    full: list[torch.Tensor] = []
    edges: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for part in parts:
        local, glob, start, end = part.local_base, part.global_base, part.start, part.end
        if end <= start:
            continue
        first, last = start // BLOCK, (end - 1) // BLOCK
        for k in {first, last}:
            base = k * BLOCK
            lo, hi = max(start - base, 0), min(end - base, BLOCK)
            edges.setdefault((local + base, glob + base), []).append((lo, hi))
        if last - first > 1:
            ks = torch.arange(first + 1, last, dtype=torch.int64) * BLOCK
            full.append(torch.stack([ks + local, ks + glob], dim=1))
    partial = []
    for (local, glob), spans in edges.items():
        spans.sort()
        merged = [list(spans[0])]
        for lo, hi in spans[1:]:
            if lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        for lo, hi in merged:
            if lo == 0 and hi == BLOCK:
                full.append(torch.tensor([[local, glob]], dtype=torch.int64))
            else:
                partial.append((local, glob, lo, hi))
    full_t = torch.cat(full) if full else torch.zeros((0, 2), dtype=torch.int64)
    partial_t = torch.tensor(partial, dtype=torch.int64).reshape(-1, 4)
    full_t, partial_t = (t[t[:, 0].argsort(stable=True)] for t in (full_t, partial_t))
    aligned = bool((full_t % 16 == 0).all()) and bool((partial_t[:, :2] % 16 == 0).all())
    return ChunkTable(full_t.to(device), partial_t.to(device), aligned)


if triton is not None:

    @triton.jit
    def _adamw_kernel(table_ptr, main_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr,
                      scale_ptr, sq_ptr, m_scale_ptr, v_scale_ptr, lr_wd, beta1, beta2,
                      step_size, bc2_sqrt, eps,
                      FULL: tl.constexpr, SUM_SQ: tl.constexpr, ALIGNED: tl.constexpr,
                      MAIN_GLOBAL: tl.constexpr, HAS_OUT: tl.constexpr, OUT_BF16: tl.constexpr,
                      HAS_SCALE: tl.constexpr, M_KIND: tl.constexpr, V_KIND: tl.constexpr,
                      QBLOCK: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr):
        row = table_ptr + tl.program_id(0).to(tl.int64) * (2 if FULL else 4)
        local = tl.load(row)
        glob = tl.load(row + 1)
        if ALIGNED:
            local = tl.multiple_of(local, 16)
            glob = tl.multiple_of(glob, 16)
        offs = tl.arange(0, BLOCK)
        if FULL:
            mask = None
        else:
            mask = (offs >= tl.load(row + 2)) & (offs < tl.load(row + 3))
        g_idx = glob + offs
        l_idx = local + offs
        m_idx = g_idx if MAIN_GLOBAL else l_idx
        grad = tl.load(grad_ptr + g_idx, mask=mask).to(tl.float32)
        raw_grad = grad  # for SUM_SQ, summed after every load is issued (below)
        if HAS_SCALE:  # FAST (8-bit moments): products and a fast division, not IEEE ones
            if FAST:
                grad = grad * (1.0 / tl.load(scale_ptr))
            else:
                grad = tl.div_rn(grad, tl.load(scale_ptr))
        param = tl.load(main_ptr + m_idx, mask=mask)
        exp_avg = _load_moment(exp_avg_ptr, m_scale_ptr, local, l_idx, mask, M_KIND, False, FULL,
                               QBLOCK, BLOCK)
        exp_avg_sq = _load_moment(exp_avg_sq_ptr, v_scale_ptr, local, l_idx, mask, V_KIND, True,
                                  FULL, QBLOCK, BLOCK)
        param = param - lr_wd * param
        exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
        if FAST:
            denom = tl.sqrt_rn(exp_avg_sq) * (1.0 / bc2_sqrt) + eps
            param = param - (step_size * exp_avg) / denom
        else:
            denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bc2_sqrt) + eps
            param = param - tl.div_rn(step_size * exp_avg, denom)
        tl.store(main_ptr + m_idx, param, mask=mask)
        _store_moment(exp_avg_ptr, m_scale_ptr, exp_avg, local, l_idx, mask, M_KIND, False,
                      FULL, QBLOCK, BLOCK)
        _store_moment(exp_avg_sq_ptr, v_scale_ptr, exp_avg_sq, local, l_idx, mask, V_KIND, True,
                      FULL, QBLOCK, BLOCK)
        if OUT_BF16:
            tl.store(out_ptr + g_idx, _to_bf16_rne(param), mask=mask)
        elif HAS_OUT:
            tl.store(out_ptr + g_idx, param.to(out_ptr.dtype.element_ty), mask=mask)
        # This block's share of the squared grad norm. Last: a block-wide sum synchronises the
        # warps and would hold back the loads behind it (docs/lowprec.md).
        if SUM_SQ:
            if FULL:
                tl.store(sq_ptr + tl.program_id(0), tl.sum(raw_grad * raw_grad))
            else:
                tl.store(sq_ptr + tl.program_id(0),
                         tl.sum(tl.where(mask, raw_grad * raw_grad, 0.0)))

    @triton.jit
    def _load_moment(ptr, scale_ptr, local, idx, mask, KIND: tl.constexpr, SQRT: tl.constexpr,
                     FULL: tl.constexpr, QBLOCK: tl.constexpr, BLOCK: tl.constexpr):
        if FULL:
            raw = tl.load(ptr + idx)
        else:  # masked lanes read as zero (they may lie past the end of the tensor)
            raw = tl.load(ptr + idx, mask=mask, other=0)
        if KIND == 2:
            # One load per QBLOCK elements, broadcast (a per-element gather costs BLOCK loads).
            s_idx = local // QBLOCK + tl.arange(0, BLOCK // QBLOCK)
            if FULL:
                scale = tl.load(scale_ptr + s_idx)
            else:
                hit = tl.reshape(mask.to(tl.int32), (BLOCK // QBLOCK, QBLOCK))
                scale = tl.load(scale_ptr + s_idx, mask=tl.max(hit, axis=1) > 0, other=0.0)
            per_elem = tl.reshape(tl.broadcast_to(scale[:, None], (BLOCK // QBLOCK, QBLOCK)),
                                  (BLOCK,))
            x = raw.to(tl.float32) * per_elem
            if SQRT:
                x = x * x
        else:
            x = raw.to(tl.float32)
        return x

    @triton.jit
    def _store_moment(ptr, scale_ptr, x, local, idx, mask, KIND: tl.constexpr,
                      SQRT: tl.constexpr, FULL: tl.constexpr, QBLOCK: tl.constexpr,
                      BLOCK: tl.constexpr):
        if KIND == 2:
            # The block's absolute maximum over the largest code (255 for sqrt(v)). Lanes
            # outside the mask are padding (zero) or another launch's, whose scales stay.
            y = tl.sqrt_rn(x) if SQRT else x
            a = tl.abs(y)
            if not FULL:
                a = tl.where(mask, a, 0.0)
            top = 255.0 if SQRT else 127.0
            amax = tl.max(tl.reshape(a, (BLOCK // QBLOCK, QBLOCK)), axis=1)
            scale = tl.div_rn(amax, top)
            # One division per block and a product per element, as quant.Moment.store_.
            inv = tl.div_rn(top, tl.where(amax == 0.0, 1.0, amax))
            per_elem = tl.reshape(tl.broadcast_to(inv[:, None], (BLOCK // QBLOCK, QBLOCK)),
                                  (BLOCK,))
            q = tl.minimum(tl.maximum(y * per_elem, -top), top)
            # Round to nearest even as torch.round: adding 1.5 * 2**23 leaves no fraction bits.
            q = (q + 12582912.0) - 12582912.0
            tl.store(ptr + idx, q.to(ptr.dtype.element_ty), mask=mask)
            s_idx = local // QBLOCK + tl.arange(0, BLOCK // QBLOCK)
            if FULL:
                tl.store(scale_ptr + s_idx, scale)
            else:
                hit = tl.reshape(mask.to(tl.int32), (BLOCK // QBLOCK, QBLOCK))
                tl.store(scale_ptr + s_idx, scale, mask=tl.max(hit, axis=1) > 0)
        elif KIND == 1:
            tl.store(ptr + idx, _to_bf16_rne(x), mask=mask)
        else:
            tl.store(ptr + idx, x, mask=mask)

    @triton.jit
    def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)

    @triton.jit
    def _to_bf16_rne(x):
        """fp32 -> bf16, rounding to nearest even as torch does (NaN stays NaN). Spelled out
        in integer ops so that compiled and interpreted kernels round alike (Triton's
        interpreter truncates a plain cast)."""
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


def adamw_(table: ChunkTable, main: torch.Tensor, grads: torch.Tensor,
           exp_avg: torch.Tensor | Moment, exp_avg_sq: torch.Tensor | Moment,
           out: torch.Tensor | None, *, main_global: bool,
           lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
           grad_scale: torch.Tensor | None, sum_sq: torch.Tensor | None = None) -> None:
    """One AdamW step over the blocks of ``table`` (:func:`chunk_table`). ``grads`` and ``out``
    (model-dtype params, or None) are whole buffers indexed by the global column; the moments
    (fp32, or a :class:`~shardopt.quant.Moment`) and ``main`` by the local one, or ``main`` is
    the fp32 param buffer itself (``main_global``). ``sum_sq`` (``table.num_blocks`` fp32)
    receives each block's sum of squared grads before ``grad_scale``."""
    (m, m_scales), (v, v_scales) = ((t.values, t.scales) if isinstance(t, Moment) else (t, None)
                                    for t in (exp_avg, exp_avg_sq))
    bc1 = 1.0 - beta1 ** step
    bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
    first = 0
    for rows, full in ((table.full, True), (table.partial, False)):
        n = rows.shape[0]
        if n == 0:
            continue
        _adamw_kernel[(n,)](
            rows, main, grads, m, v, out if out is not None else main,
            grad_scale if grad_scale is not None else main,
            sum_sq[first:first + n] if sum_sq is not None else main,
            m_scales if m_scales is not None else main, v_scales if v_scales is not None else main,
            lr * weight_decay, beta1, beta2, lr / bc1, bc2_sqrt, eps,
            FULL=full, SUM_SQ=sum_sq is not None, ALIGNED=table.aligned,
            MAIN_GLOBAL=main_global, HAS_OUT=out is not None,
            OUT_BF16=out is not None and out.dtype == torch.bfloat16,
            HAS_SCALE=grad_scale is not None, M_KIND=_KIND[m.dtype], V_KIND=_KIND[v.dtype],
            QBLOCK=QBLOCK, BLOCK=BLOCK, FAST=_KIND[m.dtype] == 2 or _KIND[v.dtype] == 2,
            num_warps=NUM_WARPS,
        )
        first += n


# Bytes and warps per program of copy_from_host_: the fastest of the settings
# benchmarks/probes/offload_phases.py tries (docs/offload.md, "Why onload copies by kernel").
COPY_BLOCK_BYTES = 4 << 10
COPY_WARPS = 8


def copy_from_host_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a contiguous device ``dst`` and a page-locked host ``src``, as a
    kernel on the current stream whose loads read the host memory over PCIe, not by a copy
    engine (docs/offload.md, "Why onload copies by kernel")."""
    assert dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype
    n = dst.numel()
    assert src.numel() == n
    if n == 0:
        return
    block = max(1, COPY_BLOCK_BYTES // dst.element_size())
    _copy_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=COPY_WARPS)
