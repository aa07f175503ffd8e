"""Low-precision storage of Adam moments: bf16, and blockwise 8-bit ("int8").

The optimizer math runs in fp32; this module says how a moment is kept between steps and
converts a rank's local state tensor to and from fp32 (docs/lowprec.md, "Formats").

* ``torch.bfloat16``: the fp32 result rounded to nearest even.
* ``"int8"``: codes and one fp32 scale per block of :data:`QBLOCK` elements (absmax):
  ``exp_avg`` as signed codes ``rne(m * 127 / max|m|)``, ``exp_avg_sq`` as unsigned codes of
  its square root ``rne(sqrt(v) * 255 / max sqrt(v))``, read back as ``(q * scale) ** 2``.

Block ``k`` of a param is its flattened elements ``[k * QBLOCK, (k + 1) * QBLOCK)``; the
layout (``param_align=QBLOCK``) keeps each block whole on one rank at every DP size, so
checkpoints store codes and scales by FQN and reshard them without re-quantising.
"""

from __future__ import annotations

import torch

from .config import INT8

QBLOCK = 64
"""Elements per scale: divides the default ``align_numel``; why 64: docs/lowprec.md."""


def storage_dtype(kind: torch.dtype | str, sqrt: bool = False) -> torch.dtype:
    """The element dtype a moment of ``kind`` is stored in (``sqrt``: the exp_avg_sq one)."""
    if kind == INT8:
        return torch.uint8 if sqrt else torch.int8
    return kind  # type: ignore[return-value]


def code_max(sqrt: bool) -> float:
    """The largest 8-bit code: the block maximum is stored as it."""
    return 255.0 if sqrt else 127.0


def num_scales(numel: int) -> int:
    """Scales an 8-bit tensor of ``numel`` elements carries."""
    return -(-numel // QBLOCK)


def bytes_per_element(kind: torch.dtype | str) -> float:
    """Storage cost of one moment element, scales included."""
    if kind == INT8:
        return 1 + 4 / QBLOCK
    return kind.itemsize  # type: ignore[union-attr]


class Moment:
    """One moment of one local state tensor in its storage form: ``values`` (the local
    tensor's element count, in :func:`storage_dtype`) and, for int8 only, ``scales`` (one fp32
    per block) and ``sqrt`` (the stored quantity is the moment's square root)."""

    def __init__(self, kind: torch.dtype | str, numel: int, device: torch.device,
                 sqrt: bool = False) -> None:
        if kind == INT8 and numel % QBLOCK:
            raise ValueError(f"an int8 moment needs a multiple of {QBLOCK} elements, got {numel}")
        self.kind = kind
        self.sqrt = sqrt and kind == INT8
        self.values = torch.zeros(numel, dtype=storage_dtype(kind, self.sqrt), device=device)
        self.scales = (torch.zeros(num_scales(numel), dtype=torch.float32, device=device)
                       if kind == INT8 else None)

    @classmethod
    def wrap(cls, kind: torch.dtype | str, values: torch.Tensor, scales: torch.Tensor | None,
             sqrt: bool = False) -> Moment:
        """A moment over existing storage tensors (no copy)."""
        out = cls.__new__(cls)
        out.kind, out.sqrt, out.values, out.scales = kind, sqrt and kind == INT8, values, scales
        return out

    def to_fp32(self) -> torch.Tensor:
        """A new fp32 tensor with the moment's values."""
        if self.scales is None:
            return self.values.float()
        x = (self.values.float().view(-1, QBLOCK) * self.scales[:, None]).view(-1)
        return x.square_() if self.sqrt else x

    def store_(self, x: torch.Tensor) -> None:
        """Replace the stored values by fp32 ``x`` (rounded to nearest, ties to even)."""
        if self.scales is None:
            self.values.copy_(x)
            return
        top = code_max(self.sqrt)
        y = (x.sqrt() if self.sqrt else x).view(-1, QBLOCK)
        amax = y.abs().amax(dim=1)
        torch.div(amax, top, out=self.scales)
        inv = top / torch.where(amax == 0, 1.0, amax)  # an all-zero block stays 0
        self.values.view(-1, QBLOCK).copy_((y * inv[:, None]).round_().clamp_(-top, top))
