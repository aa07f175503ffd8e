"""The Adam moments of one rank, as one record passed between the optimizer, the
host copies (:mod:`.host_state`), ``state_dict`` and ``checkpoint``.

Each moment of each layout buffer is a :class:`~shardopt.quant.Moment` in its
storage form: fp32, bf16, or int8 codes plus one fp32 scale per block. A record
built for a load may live in host memory; ``pinned`` is the page-locked memory
behind it, released by whoever adopts it (:mod:`.host_state`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import quant
from .config import INT8
from .layout import Range
from .pinned import PinnedBuffer

# ``opt`` is the DistributedOptimizer this serves, typed ``Any``: the optimizer imports
# this module, never the reverse.

NAMES = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Moments:
    """``exp_avg`` and ``exp_avg_sq``, one :class:`~shardopt.quant.Moment` per layout buffer."""

    exp_avg: tuple[quant.Moment, ...]
    exp_avg_sq: tuple[quant.Moment, ...]
    pinned: tuple[PinnedBuffer, ...] = ()

    def of(self, name: str) -> tuple[quant.Moment, ...]:
        """The moment ``name`` (``"exp_avg"`` or ``"exp_avg_sq"``) of every buffer."""
        if name not in NAMES:
            raise KeyError(f"no Adam moment {name!r}; the moments are {list(NAMES)}")
        return getattr(self, name)

    def tensors(self) -> list[torch.Tensor]:
        """Every storage tensor: values of exp_avg then exp_avg_sq by buffer, then scales."""
        ms = self.exp_avg + self.exp_avg_sq
        return [m.values for m in ms] + [m.scales for m in ms if m.scales is not None]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Moments:
        """A record whose storage tensors are ``fn`` of these (e.g. device copies)."""
        def one(m: quant.Moment) -> quant.Moment:
            return quant.Moment.wrap(m.kind, fn(m.values),
                                     None if m.scales is None else fn(m.scales), m.sqrt)
        return Moments(tuple(map(one, self.exp_avg)), tuple(map(one, self.exp_avg_sq)))

    def num_bytes(self) -> int:
        return sum(m.num_bytes() for m in self.exp_avg + self.exp_avg_sq)


def piece(m: quant.Moment, r: Range) -> quant.Moment:
    """Views of the local range ``r`` of ``m`` (``r`` starts on a block boundary where ``m``
    has scales: the layout's ``param_align``): its values and the scales of its blocks."""
    scales = None if m.scales is None else m.scales[r.blocks(quant.QBLOCK).as_slice()]
    return quant.Moment.wrap(m.kind, m.values[r.as_slice()], scales, m.sqrt)


def kinds(opt: Any) -> dict[str, torch.dtype | str]:
    """The storage kind of each moment in ``opt``'s configuration."""
    return {"exp_avg": opt.config.exp_avg_dtype, "exp_avg_sq": opt.config.exp_avg_sq_dtype}


def zeros(opt: Any) -> Moments:
    """Zero moments on the device: what the first step starts from."""
    return Moments(*(tuple(quant.Moment(kind, b.local_numel, opt.device, sqrt=name == NAMES[1])
                           for b in opt.layout.buffers) for name, kind in kinds(opt).items()))


def allocate(opt: Any, on_host: bool) -> Moments:
    """New moments in ``opt``'s storage format whose params' parts are for the caller to
    fill (padding and scales start at zero), on the device or (``on_host``) in host memory,
    page-locked at its exact size when the optimizer is on CUDA (:mod:`.pinned`)."""
    cuda = opt.device.type == "cuda"
    pinned: list[PinnedBuffer] = []

    def tensor(dtype: torch.dtype, numel: int, bi: int | None) -> torch.Tensor:
        if on_host and cuda:  # registering faults every page in
            pinned.append(PinnedBuffer(numel, dtype))
            t = pinned[-1].tensor
        elif cuda:
            t = torch.empty(numel, dtype=dtype, device=opt.device)
        else:  # pageable host memory: a memset faults pages in faster than the reads would
            return torch.zeros(numel, dtype=dtype)
        if bi is None:
            return t.zero_()
        _zero_padding(opt, t, bi)
        return t

    out = []
    for name, kind in kinds(opt).items():
        sqrt = name == NAMES[1]
        out.append(tuple(
            quant.Moment.wrap(kind, tensor(quant.storage_dtype(kind, sqrt), b.local_numel, bi),
                              tensor(torch.float32, quant.num_scales(b.local_numel), None)
                              if kind == INT8 else None, sqrt)
            for bi, b in enumerate(opt.layout.buffers)))
    return Moments(out[0], out[1], tuple(pinned))


def load_target(opt: Any, on_host: bool) -> tuple[Moments, bool]:
    """Where loaded moments go (with the page-locked memory behind them), and whether
    they are new.

    New tensors let ``checkpoint.load`` read the moments in one verifying pass before
    the ranks agree (a failed load just drops them): for ``on_host``
    (``low_memory_resume``: host memory, page-locked at its exact size when the optimizer
    is on CUDA) and for an optimizer that has not stepped yet (a resume). Existing
    moments are reused in place (verified first, read after the agreement): a second
    copy of the optimizer state is what a resume must never hold, on the GPU least of all.
    """
    if on_host or opt.moments is None:
        return allocate(opt, on_host), True
    return opt.moments, False


def _zero_padding(opt: Any, t: torch.Tensor, bi: int) -> None:
    """Zero what no param shard of buffer ``bi`` covers in local tensor ``t``."""
    covered = sorted((s.range_local for s in opt.shards if s.buffer_index == bi),
                     key=lambda r: r.start)
    pos = 0
    for r in covered + [Range(t.numel(), t.numel())]:
        if r.start > pos:
            t[pos:r.start].zero_()
        pos = max(pos, r.end)


def memory_bytes(opt: Any) -> dict[str, int]:
    """``opt.memory_bytes()``: params, grads and the optimizer state allocated now."""
    out = opt.buffers.num_bytes()
    state = sum(t.numel() * t.element_size() for t in opt.main_params if t is not None)
    if opt.moments is not None:
        state += opt.moments.num_bytes()
    out["optimizer_state"] = state
    return out


def no_fp32_view(opt: Any, name: str) -> str:
    """Why ``opt.state_view(name, ...)`` has no fp32 view of bf16/int8 moments."""
    kinds = opt.config.to_dict()
    return (f"[dp rank {opt.dp.rank}] state_view({name!r}) is an fp32 view; this optimizer "
            f"stores its moments as {kinds['exp_avg_dtype']!r} / {kinds['exp_avg_sq_dtype']!r}: "
            "use moment_view()")
