"""The Triton AdamW step (shardopt.kernels) against torch's fused AdamW and the reference.

Without a GPU the kernel runs in Triton's interpreter (set by conftest), so CI checks
its arithmetic and indexing too; the GPU run checks the compiled kernel.
"""

from __future__ import annotations

import pytest
import torch

from helpers.checks import bits
from helpers.dist import device_for, require_world_size, run_distributed
from helpers.models import Scenario, assert_matches_reference, tol_for, train_rank
from shardopt import DistributedOptimizer, OptimizerConfig, kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(not kernels.available(DEVICE),
                                  reason="Triton is not installed")


def _torch_reference(main, grad, exp_avg, exp_avg_sq, step, grad_scale, **hp):
    """torch._fused_adamw_ on copies of one param's state; returns the updated copies."""
    out = [t.clone() for t in (main, exp_avg, exp_avg_sq)]
    torch._fused_adamw_([out[0]], [grad.float().clone()], [out[1]], [out[2]], [],
                        [torch.tensor(float(step), device=main.device)], amsgrad=False,
                        maximize=False, grad_scale=grad_scale, **hp)
    return out


@needs_triton
@pytest.mark.parametrize("global_base", [96, 100], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, None],
                         ids=["bf16_out", "fp16_out", "fp32_main_is_param"])
@pytest.mark.parametrize("clip", [False, True], ids=["no_clip", "clip"])
def test_kernel_matches_torch_fused_adamw(out_dtype, clip, global_base):
    """Two bucket shards; parts that fill blocks whole, share a block, end mid-block; what
    lies outside the parts is never written."""
    B = kernels.BLOCK
    g = torch.Generator().manual_seed(0)
    numel, glob_numel = 4 * B, 6 * B
    parts = [(0, global_base, 0, B + 7), (0, global_base, B + 20, B + 353),
             (2 * B, 3 * B + global_base, 5, B + 300)]
    grads = (torch.randn(glob_numel, generator=g) * 1e-2).to(DEVICE)
    params = torch.randn(glob_numel, generator=g).to(DEVICE)
    main = torch.randn(numel, generator=g).to(DEVICE) if out_dtype else params
    exp_avg = (torch.randn(numel, generator=g) * 1e-2).to(DEVICE)
    exp_avg_sq = (torch.rand(numel, generator=g) * 1e-4).to(DEVICE)
    out = torch.zeros(glob_numel, dtype=out_dtype, device=DEVICE) if out_dtype else None
    before = {k: t.clone() for k, t in dict(main=main, m=exp_avg, v=exp_avg_sq).items()}
    scale = torch.tensor(3.5, device=DEVICE) if clip else None
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)

    table = kernels.chunk_table([kernels.ChunkPart(*p) for p in parts], DEVICE)
    assert table.aligned == (global_base % 16 == 0)
    assert table.full.shape[0] >= 1 and table.partial.shape[0] >= 2
    sum_sq = torch.full((table.num_blocks,), float("nan"), device=DEVICE)
    kernels.adamw_(table, main, grads, exp_avg, exp_avg_sq, out,
                   main_global=out_dtype is None, step=7, grad_scale=scale, sum_sq=sum_sq, **hp)
    want_sq = sum(grads[gb + a:gb + b].double().square().sum() for _, gb, a, b in parts)
    torch.testing.assert_close(sum_sq.double().sum(), want_sq, rtol=1e-6, atol=0)

    covered = torch.zeros(numel, dtype=torch.bool, device=DEVICE)
    covered_global = torch.zeros(glob_numel, dtype=torch.bool, device=DEVICE)
    for lb, gb, start, end in parts:
        loc, glo = slice(lb + start, lb + end), slice(gb + start, gb + end)
        m_at = glo if out_dtype is None else loc
        want = _torch_reference(before["main"][m_at], grads[glo], before["m"][loc],
                                before["v"][loc], 7, scale, **hp)
        for got, w in zip((main[m_at], exp_avg[loc], exp_avg_sq[loc]), want):
            torch.testing.assert_close(got, w, rtol=2e-6, atol=1e-7)
        if out is not None:  # the model-dtype param is the rounded main param, bit for bit
            assert torch.equal(bits(out[glo]), bits(main[m_at].to(out_dtype)))
        covered[loc] = True
        covered_global[glo] = True
    for key, t in dict(m=exp_avg, v=exp_avg_sq).items():
        assert torch.equal(t[~covered], before[key][~covered]), key
    if out is not None:
        assert not out[~covered_global].any()
        assert torch.equal(main[~covered], before["main"][~covered])
    else:
        assert torch.equal(main[~covered_global], before["main"][~covered_global])


@needs_triton
@pytest.mark.parametrize("world_size,max_grad_norm", [(1, 0.5), (2, 0.5), (3, 0.5), (2, None)],
                         ids=["1-clip", "2-clip", "3-clip", "2-no_clip"])
def test_triton_step_matches_reference(backend, world_size, max_grad_norm, tmp_path):
    """Clipping, decay groups, accumulation, cosine LR, tied, unused and partly used params.
    Without clipping the kernel also sums the squared grads for ``last_grad_norm``."""
    require_world_size(backend, world_size)
    if not kernels.available(device_for(backend, 0)):
        pytest.skip(f"no Triton for {backend}'s device here (CPU needs TRITON_INTERPRET=1)")
    sc = Scenario(world_size=world_size, steps=5, micro_batches=2, max_grad_norm=max_grad_norm,
                  eps=1e-3,
                  groups="lr_override", scheduler="cosine", tied=True, branch=True,
                  bucket_numel=100 + 37 * world_size, align_numel=world_size,
                  seed=world_size, step_kernel="triton")
    results = run_distributed(train_rank, world_size, sc, backend, backend=backend,
                              tmp_path=tmp_path)
    assert_matches_reference(sc, results, tol_for(backend))


def test_triton_kernel_unavailable_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda device: False)
    with pytest.raises(ValueError, match="step_kernel='triton' needs Triton"):
        DistributedOptimizer(torch.nn.Linear(2, 2), OptimizerConfig(step_kernel="triton"))
    # "auto" falls back to torch's fused AdamW: the same bits as step_kernel="torch".
    params = {}
    for kernel in ("auto", "torch"):
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 2).to(torch.bfloat16)
        opt = DistributedOptimizer(model, OptimizerConfig(step_kernel=kernel))
        model(torch.ones(3, 2, dtype=torch.bfloat16)).float().square().sum().backward()
        opt.step()
        params[kernel] = [opt.shard_state.view("master_param", s).clone()
                          for s in opt.shard_state.shards]
    assert all(torch.equal(a, b) for a, b in zip(params["auto"], params["torch"]))


def test_step_kernel_is_validated():
    with pytest.raises(ValueError, match="step_kernel must be one of"):
        OptimizerConfig(step_kernel="cuda")



@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.uint8])
def test_copy_from_host_copies_every_element(dtype):
    """onload's host-to-device kernel: sizes that end mid-block, one element, none; nothing
    past the end is written. On a GPU the source is page-locked host memory, read by the
    kernel over PCIe."""
    block = kernels.COPY_BLOCK_BYTES // dtype.itemsize
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, block - 1, 2 * block + 37):
        src = torch.randint(-100, 100, (n,), generator=g).to(dtype)
        if DEVICE.type == "cuda":
            src = src.pin_memory()
        dst = torch.full((n + 16,), 7, dtype=dtype, device=DEVICE)
        kernels.copy_from_host_(dst[:n], src)
        assert torch.equal(dst[:n].cpu(), src.cpu())
        assert (dst[n:] == 7).all()


def test_chunk_table_rows_come_in_order_of_local_base_and_cover_every_block_once():
    B = kernels.BLOCK
    # Two "buckets" of 5 and 3 blocks; ragged params, one sharing a block with the next.
    parts = [kernels.ChunkPart(5 * B, 9 * B, 0, 2 * B + 1), kernels.ChunkPart(0, 0, 10, 3 * B + 7),
             kernels.ChunkPart(0, 0, 3 * B + 7, 5 * B)]
    table = kernels.chunk_table(parts, torch.device("cpu"))
    for rows in (table.full, table.partial):
        assert torch.equal(rows[:, 0], rows[:, 0].sort().values)
    bases = sorted(table.full[:, 0].tolist() + table.partial[:, 0].tolist())
    assert bases == [k * B for k in range(8)]  # the shared block is one row
