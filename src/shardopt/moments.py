"""The moments of one rank as one record: what a load fills and the shard state adopts.

Each moment of each layout buffer is a :class:`~shardopt.quant.Moment` in its storage form
(fp32, bf16, or int8 codes plus one fp32 scale per block): the Adam moments of AdamW's
buffers, Muon's fp32 momentum buffer of Muon's (:mod:`.muon`), empty in the other buffers. A
record built for a load may live in host memory; ``pinned`` is the page-locked memory behind
it, which the shard state takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import quant
from .layout import Range
from .muon import MOMENTUM
from .pinned import PinnedBuffer

NAMES = ("exp_avg", "exp_avg_sq")
ALL_NAMES = (*NAMES, MOMENTUM)  # Muon's momentum buffer last


@dataclass(frozen=True)
class Moments:
    """``exp_avg``, ``exp_avg_sq`` and ``momentum_buffer``, one
    :class:`~shardopt.quant.Moment` per layout buffer (``momentum_buffer``: none without
    Muon)."""

    exp_avg: tuple[quant.Moment, ...]
    exp_avg_sq: tuple[quant.Moment, ...]
    pinned: tuple[PinnedBuffer, ...] = ()
    momentum_buffer: tuple[quant.Moment, ...] = ()

    def of(self, name: str) -> tuple[quant.Moment, ...]:
        """The moment ``name`` (of :data:`ALL_NAMES`) of every buffer."""
        if name not in ALL_NAMES:
            raise KeyError(f"no moment {name!r}; the moments are {list(ALL_NAMES)}")
        return getattr(self, name)

    def named(self) -> dict[str, torch.Tensor]:
        """Every storage tensor by its shard-state name: ``{name}.{i}`` and, for int8,
        ``{name}.scale.{i}`` for buffer ``i``; empty ones (a moment a buffer has not) left out."""
        out = {}
        for name in ALL_NAMES:
            for i, m in enumerate(self.of(name)):
                if not m.values.numel():
                    continue
                out[f"{name}.{i}"] = m.values
                if m.scales is not None:
                    out[f"{name}.scale.{i}"] = m.scales
        return out


def piece(m: quant.Moment, r: Range) -> quant.Moment:
    """Views of the local range ``r`` of ``m``: its values and, where ``m`` has scales (``r``
    then starts on a block boundary, the layout's ``param_align``), those of its blocks."""
    scales = None if m.scales is None else m.scales[r.blocks(quant.QBLOCK).as_slice()]
    return quant.Moment.wrap(m.kind, m.values[r.as_slice()], scales, m.sqrt)
