"""Loading Adam moments stored otherwise (:class:`~.manifest.MomentEncoding`) than the
optimizer keeps them: each rank reads its pieces as stored (codes with the scales of their
blocks), decodes them to fp32 as :meth:`shardopt.quant.Moment.to_fp32` does and stores each
local tensor in the target format (:meth:`~shardopt.quant.Moment.store_`), as a step would.
One log line (logger ``shardopt.checkpoint``) names every conversion of a load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import dtype_name
from ..layout import ParamShard, Range
from ..moments import NAMES, Moments
from ..optimizer import DistributedOptimizer
from .manifest import MomentEncoding
from .read import DataFiles, Read
from .state import check_quantized, encodings

log = logging.getLogger("shardopt.checkpoint")


@dataclass(frozen=True)
class Piece:
    """One shard's stored moment ``name`` read as stored: ``values`` and the ``scales`` of
    the blocks covering it (None unless 8-bit) from block ``scale_start`` on."""

    shard: ParamShard
    name: str
    values: torch.Tensor
    scales: torch.Tensor | None
    scale_start: int = 0

    @property
    def scale_key(self) -> str:
        return f"{self.shard.fqn}.{self.name}.scale"


def plan(opt: DistributedOptimizer, saved: dict[str, MomentEncoding], files: DataFiles
         ) -> tuple[list[Piece], list[Read]]:
    """The pieces of the moments ``opt`` stores otherwise than ``saved``, and their reads
    (into new tensors, so they are read in the verifying pass before the ranks agree)."""
    mine = encodings(opt)
    pieces: list[Piece] = []
    reads: list[Read] = []
    for name in NAMES:
        enc = saved[name]
        if enc == mine[name]:
            continue
        for s in opt.shard_state.shards:
            if name not in opt.shard_state.moment_names[s.fqn]:
                continue  # a Muon param
            r = s.range_param
            values = torch.empty(r.size, dtype=enc.dtype)
            reads += files.reads(f"{s.fqn}.{name}", r, values, in_place=False,
                                 block=opt.shard_state.parallel.blocks.get(s.fqn))
            scales, blocks = None, Range(0, 0)
            if enc.block:
                check_quantized(opt, s.fqn)
                blocks = r.blocks(enc.block)
                scales = torch.empty(blocks.size, dtype=torch.float32)
                reads += files.reads(f"{s.fqn}.{name}.scale", blocks, scales, in_place=False)
            pieces.append(Piece(s, name, values, scales, blocks.start))
    return pieces, reads


def apply(opt: DistributedOptimizer, saved: dict[str, MomentEncoding], pieces: list[Piece],
          moments: Moments, path: str) -> None:
    """Decode ``pieces`` to fp32 and store them into ``moments`` in ``opt``'s format."""
    mine = encodings(opt)
    names = [n for n in NAMES if saved[n] != mine[n]]
    if not names:
        return
    log.info("loading %s: converting Adam moments %s (dequantised to fp32, stored blockwise)",
             path, ", ".join(f"{n} {_describe(saved[n])} -> {_describe(mine[n])}"
                             for n in names))
    for name in names:
        for bi, target in enumerate(moments.of(name)):  # one buffer's fp32 copy at a time
            work = torch.zeros(target.values.numel(), dtype=torch.float32,
                               device=target.values.device)
            for p in pieces:
                if p.name == name and p.shard.buffer_index == bi:
                    x = saved[name].decode(p.values, p.scales, p.shard.range_param.start)
                    work[p.shard.range_local.as_slice()].copy_(x)
            target.store_(work)


def _describe(enc: MomentEncoding) -> str:
    if not enc.block:
        return dtype_name(enc.dtype)
    return f"int8 ({'sqrt' if enc.sqrt else 'linear'}, blocks of {enc.block})"
