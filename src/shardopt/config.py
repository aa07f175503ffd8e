"""Optimizer configuration: one validated dataclass, and the rules for hyperparameters."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(kw_only=True)
class OptimizerConfig:
    """Hyperparameters and behaviour of :class:`shardopt.DistributedOptimizer`."""

    lr: float = 1e-3
    """Learning rate (a scheduler may change ``param_groups[i]["lr"]`` later)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW coefficients for the running averages of the gradient and its square."""
    eps: float = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW)."""
    max_grad_norm: float | None = None
    """Clip the global gradient L2 norm to this value; ``None`` or ``0`` disables clipping."""
    bucket_numel: int = 40_000_000
    """Elements per communication bucket (a param never spans two buckets)."""
    align_numel: int = 64
    """Each rank's shard of a bucket is a multiple of this many elements."""
    overlap_grad_reduce: bool = True
    """Start each bucket's reduction from backward hooks as soon as it is complete."""
    overlap_param_gather: bool = False
    """Let ``step()`` return with the param all-gathers in flight, overlapping the next forward
    (each module's forward pre-hook waits for its own params); read params otherwise only after
    ``optimizer.finish_param_sync()`` (docs/optimizer.md, "Configuration")."""
    grad_dtype: torch.dtype = torch.float32
    """Grad buffer and reduction dtype of bf16/fp16 params: ``torch.float32``, or
    ``torch.bfloat16`` (their own dtype) to halve grad memory and traffic."""
    grad_mode: str = "torch"
    """``"torch"``: after backward each ``p.grad`` is its gradient averaged over the DP ranks
    (all-reduces), as with DDP; ``"buffer"``: gradients live only in the grad buffer, ``p.grad``
    is None (reduce-scatters: half the traffic). docs/optimizer.md, "Gradients"."""
    exp_avg_dtype: torch.dtype | str = torch.float32
    """Storage of the first Adam moment: ``torch.float32``, ``torch.bfloat16`` (rounded to
    nearest even) or ``"int8"`` (one fp32 scale per block of 64, :mod:`shardopt.quant`)."""
    exp_avg_sq_dtype: torch.dtype | str = torch.float32
    """Storage of the second Adam moment, as ``exp_avg_dtype`` (int8: codes of its sqrt)."""
    low_memory_resume: bool = False
    """Default for ``checkpoint.load``: keep loaded Adam moments on the host until the first step."""
    step_kernel: str = "auto"
    """``"triton"`` (one pass per buffer, :mod:`shardopt.kernels`), ``"torch"`` (torch's fused
    AdamW, then a copy) or ``"auto"``: Triton on CUDA when it is installed, else torch."""

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"lr must be a finite number >= 0, got {self.lr!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm must be >= 0 or None, got {self.max_grad_norm!r}")
        for name in ("bucket_numel", "align_numel"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name, allowed in (("grad_mode", GRAD_MODES), ("step_kernel", STEP_KERNELS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        self.exp_avg_dtype = _state_dtype("exp_avg_dtype", self.exp_avg_dtype, MOMENT_DTYPES)
        self.exp_avg_sq_dtype = _state_dtype("exp_avg_sq_dtype", self.exp_avg_sq_dtype,
                                             MOMENT_DTYPES)
        self.grad_dtype = _state_dtype("grad_dtype", self.grad_dtype, GRAD_DTYPES)

    @property
    def param_grads(self) -> bool:
        """Whether ``p.grad`` holds each param's gradient after backward (``grad_mode="torch"``)."""
        return self.grad_mode == "torch"

    @property
    def lowprec_moments(self) -> bool:
        """Whether either Adam moment is stored in less than fp32."""
        return (self.exp_avg_dtype, self.exp_avg_sq_dtype) != (torch.float32, torch.float32)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the checkpoint manifest stores it)."""
        out = dataclasses.asdict(self)
        out["betas"] = list(self.betas)
        for key in ("grad_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            out[key] = dtype_name(out[key])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OptimizerConfig:
        """The config of :meth:`to_dict`'s ``data``; keys it does not know are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


STEP_KERNELS = ("auto", "triton", "torch")
GRAD_MODES = ("torch", "buffer")
INT8 = "int8"  # blockwise 8-bit moments (shardopt.quant)
MOMENT_DTYPES = (torch.float32, torch.bfloat16, INT8)
GRAD_DTYPES = (torch.float32, torch.bfloat16)
_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, INT8: INT8}


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (``"int8"`` stays): how state dicts, manifests and
    configs name a dtype or a moment's storage."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _state_dtype(name: str, value: Any, allowed: tuple) -> torch.dtype | str:
    """``value`` as one of ``allowed``; names (as ``to_dict`` writes them) are accepted."""
    if value == torch.int8:
        value = INT8
    elif isinstance(value, str):
        value = _BY_NAME.get(value.removeprefix("torch."), value)
    if value not in allowed:
        shown = ", ".join(a if isinstance(a, str) else str(a) for a in allowed)
        raise ValueError(f"{name} must be one of {shown}, got {value!r}")
    return value


# Hyperparameters a param group may override through ``param_group_fn``.
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


def group_value(key: str, value: Any) -> Any:
    """``value`` as a param group holds hyperparameter ``key`` (betas: a tuple of floats), or
    None if AdamW cannot take it: numbers finite and >= 0, betas two of them below 1. The one
    rule for ``param_group_fn``, ``load_state_dict`` and checkpoint manifests."""
    if key == "betas":
        ok = (isinstance(value, (list, tuple)) and len(value) == 2
              and all(_number(b) and b < 1 for b in value))
        return tuple(float(b) for b in value) if ok else None
    return value if _number(value) else None


def _number(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        as_float = float(value)  # an int past float's range (10**400) is not a number AdamW takes
    except OverflowError:
        return False
    return math.isfinite(as_float) and as_float >= 0
