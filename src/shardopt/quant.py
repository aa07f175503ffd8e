"""Low-precision storage of Adam moments: bf16, and blockwise 8-bit ("fp8").

The optimizer math always runs in fp32; this module only says how a moment is
kept between steps and converts a rank's local state tensor to and from fp32.

* ``torch.bfloat16``: the fp32 result rounded to nearest even (torch's cast).
* ``"fp8"``: float8 e4m3 values (``torch.float8_e4m3fn``, 1 byte) and one fp32
  scale per block of :data:`QBLOCK` elements. A block's scale is its absolute
  maximum over 448 (e4m3's largest value), and a value is stored as
  ``round_to_nearest_even(x / scale)``. ``exp_avg_sq`` is stored as its square
  root (``v = (q * scale) ** 2``): sqrt halves the exponent range (v spans ~1e-20
  to 1e2 in one tensor), so small entries of a block keep their relative
  precision instead of flushing to zero next to a large one.

Why a block is defined in the param's flattened (model) space: block ``k`` of a
param is its elements ``[k * QBLOCK, (k + 1) * QBLOCK)``. The layout
(``build_layout(param_align=QBLOCK)``) starts every param on a multiple of
QBLOCK in its buffer and cuts shards at multiples of it, so a block lies whole on
one rank at every DP size and a rank's local tensor is a whole number of blocks.
A checkpoint can then store each param's values (``numel`` bytes) and scales
(``ceil(numel / QBLOCK)`` fp32) by FQN and load them at another DP size without
re-quantising. Padding elements are always zero (value 0 whatever the scale).

Memory per element: 1 + 4 / QBLOCK bytes (1.0625 with QBLOCK = 64), against 4
for fp32 and 2 for bf16.
"""

from __future__ import annotations

import torch

from .config import FP8

QBLOCK = 64
"""Elements per fp8 scale. Divides the default ``align_numel`` (64), so the default shard
cut already falls on block boundaries; 64 rather than 128 or 256 because a smaller block
tracks local magnitude better (see docs/lowprec.md) at 1/16 byte per element more."""
E4M3_MAX = 448.0
E4M3 = torch.float8_e4m3fn


def storage_dtype(kind: torch.dtype | str) -> torch.dtype:
    """The element dtype a moment of ``kind`` is stored in."""
    return E4M3 if kind == FP8 else kind  # type: ignore[return-value]


def num_scales(numel: int) -> int:
    """Scales an 8-bit tensor of ``numel`` elements carries (0 for other kinds)."""
    return -(-numel // QBLOCK)


def bytes_per_element(kind: torch.dtype | str) -> float:
    """Storage cost of one moment element, scales included."""
    if kind == FP8:
        return 1 + 4 / QBLOCK
    return kind.itemsize  # type: ignore[union-attr]


class Moment:
    """One moment of one local state tensor in its storage form.

    ``values`` has the local tensor's element count in :func:`storage_dtype`;
    ``scales`` (fp8 only, else None) has one fp32 entry per :data:`QBLOCK` block.
    ``sqrt`` marks that the stored quantity is the moment's square root.
    """

    def __init__(self, kind: torch.dtype | str, numel: int, device: torch.device,
                 sqrt: bool = False) -> None:
        if kind == FP8 and numel % QBLOCK:
            raise ValueError(f"an fp8 moment needs a multiple of {QBLOCK} elements, got {numel}")
        self.kind = kind
        self.sqrt = sqrt and kind == FP8
        self.values = torch.zeros(numel, dtype=storage_dtype(kind), device=device)
        self.scales = (torch.zeros(num_scales(numel), dtype=torch.float32, device=device)
                       if kind == FP8 else None)

    def num_bytes(self) -> int:
        out = self.values.numel() * self.values.element_size()
        if self.scales is not None:
            out += self.scales.numel() * 4
        return out

    def to_fp32(self) -> torch.Tensor:
        """A new fp32 tensor with the moment's values."""
        if self.scales is None:
            return self.values.float()
        x = (self.values.float().view(-1, QBLOCK) * self.scales[:, None]).view(-1)
        return x.square_() if self.sqrt else x

    def store_(self, x: torch.Tensor) -> None:
        """Replace the stored values by fp32 ``x`` (rounded to nearest even)."""
        if self.scales is None:
            self.values.copy_(x)
            return
        y = (x.sqrt() if self.sqrt else x).view(-1, QBLOCK)
        torch.div(y.abs().amax(dim=1), E4M3_MAX, out=self.scales)
        safe = torch.where(self.scales == 0, 1.0, self.scales)  # an all-zero block stays 0
        self.values.view(-1, QBLOCK).copy_(
            (y / safe[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3))
