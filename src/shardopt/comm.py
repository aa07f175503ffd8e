"""Thin collectives over the data-parallel group.

Every function is collective over the group unless it says otherwise; with one rank they are
no-ops, so the optimizer runs the same code at any world size. CPU tensors (gloo) take
portable paths (reduce-scatter as an all-reduce, all-gather through a list of views), CUDA
tensors (NCCL) the real ``reduce_scatter_tensor`` / ``all_gather_into_tensor``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import ProcessGroupError


@dataclass(frozen=True)
class DPGroup:
    """The data-parallel group as the optimizer sees it (not a global)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    @staticmethod
    def resolve(process_group: dist.ProcessGroup | None) -> DPGroup:
        """Coordinator-free: rank and size of ``process_group`` (default group if None); one
        rank without a process group, unless ``WORLD_SIZE`` says more (ProcessGroupError)."""
        if not (dist.is_available() and dist.is_initialized()):
            if process_group is not None:
                raise ValueError("a process_group was given but torch.distributed is not initialized")
            try:  # as a launcher (torchrun, a SLURM wrapper) sets it
                world = int(os.environ.get("WORLD_SIZE", "1"))
            except ValueError:
                world = 1
            if world > 1:
                raise ProcessGroupError(
                    f"WORLD_SIZE={world} says this process is one rank of {world} (torchrun or "
                    "another launcher), but torch.distributed is not initialised: each rank "
                    "would build a one-rank optimizer and train alone. Call "
                    "torch.distributed.init_process_group() before building the "
                    "DistributedOptimizer (under a framework: build it where the framework "
                    "has set up its process group, e.g. in configure_optimizers).")
            return DPGroup(None, 0, 1)
        return DPGroup(process_group, dist.get_rank(process_group), dist.get_world_size(process_group))


class _Done:
    """Handle for work that already finished (one rank, or a synchronous fallback)."""

    def wait(self) -> bool:
        return True


DONE = _Done()


def reduce_scatter_avg_(bucket: torch.Tensor, dp: DPGroup, async_op: bool) -> object:
    """Collective. Average ``bucket`` (1-D, ``numel % dp.size == 0``) over ranks into rank r's
    shard of it; the rest is left unspecified (partial sums on CUDA, averages on CPU)."""
    if dp.size > 1 and bucket.is_cuda:
        n = bucket.numel() // dp.size
        return dist.reduce_scatter_tensor(bucket.narrow(0, dp.rank * n, n), bucket,
                                          op=dist.ReduceOp.AVG, group=dp.group,
                                          async_op=async_op) or DONE
    return all_reduce_avg_(bucket, dp, async_op)


def all_reduce_avg_(bucket: torch.Tensor, dp: DPGroup, async_op: bool) -> object:
    """Collective. Average ``bucket`` over ranks in place: every rank holds the whole average."""
    if dp.size == 1:
        return DONE
    if bucket.is_cuda:
        return dist.all_reduce(bucket, op=dist.ReduceOp.AVG, group=dp.group,
                               async_op=async_op) or DONE
    bucket.div_(dp.size)  # gloo has no AVG (and DDP divides before summing too)
    return dist.all_reduce(bucket, group=dp.group, async_op=async_op) or DONE


def all_gather_(bucket: torch.Tensor, dp: DPGroup, async_op: bool) -> object:
    """Collective. Fill every shard of ``bucket`` from the rank that owns it (in place)."""
    if dp.size == 1:
        return DONE
    shard_numel = bucket.numel() // dp.size
    own = bucket.narrow(0, dp.rank * shard_numel, shard_numel)
    if bucket.is_cuda:
        return dist.all_gather_into_tensor(bucket, own, group=dp.group, async_op=async_op) or DONE
    # gloo may not accept aliasing input/output; gather from a private copy.
    return dist.all_gather(list(bucket.chunk(dp.size)), own.clone(), group=dp.group,
                           async_op=async_op) or DONE


def all_reduce_sum_(tensor: torch.Tensor, dp: DPGroup) -> torch.Tensor:
    """Collective. In-place sum over ranks (synchronous)."""
    if dp.size > 1:
        dist.all_reduce(tensor, group=dp.group)
    return tensor


def all_reduce_sum_async_(tensor: torch.Tensor, dp: DPGroup) -> object:
    """Collective. In-place sum over ranks, started; returns its handle."""
    if dp.size == 1:
        return DONE
    return dist.all_reduce(tensor, group=dp.group, async_op=True) or DONE


def all_gather_objects(obj: object, dp: DPGroup) -> list[object]:
    """Collective. Every rank's ``obj`` (small, JSON-like values only), in rank order."""
    if dp.size == 1:
        return [obj]
    out: list[object] = [None] * dp.size
    dist.all_gather_object(out, obj, group=dp.group)
    return out


def agree(dp: DPGroup, error: BaseException | None, payload: object = None
          ) -> tuple[list[object], str | None]:
    """Collective. Every rank's ``payload`` (small, JSON-like), and, if any rank brings an
    ``error``, one line naming each problem once with the ranks that saw it
    (``"[dp ranks 0-2] ...; [dp rank 5] ..."``); None when every rank succeeded."""
    text = None if error is None else (
        str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}")
    gathered = all_gather_objects((payload, text), dp)
    failed: dict[str, list[int]] = {}
    for r, (_, e) in enumerate(gathered):
        if e is not None:
            failed.setdefault(e, []).append(r)
    detail = "; ".join(f"[dp rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}] {e}"
                       for e, rs in failed.items()) or None
    return [p for p, _ in gathered], detail


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else f"{g[0]}" for g in runs)
