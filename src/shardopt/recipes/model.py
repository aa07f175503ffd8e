"""A small GPT-style decoder with interleaved bf16 and fp32 parameters.

The reference training job needs a model that looks like the ones whose checkpoints break: most weights
in bf16, but LayerNorm weights/biases and MoE router weights in fp32, interleaved in module order. Some
blocks replace the dense MLP with a softly routed mixture of expert MLPs (each expert is
``d_ff / num_experts`` wide, so a preset's parameter count does not depend on where the MoE blocks are).

Mixed dtypes are handled explicitly rather than with autocast, so the forward pass runs the same way on
CPU and GPU: the residual stream is in the model dtype, norms and the router compute in fp32 and cast
back. Initialisation is deterministic from ``(seed, fqn)``, independent of the device and of the order
in which parameters are created.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INIT_STD = 0.02  # GPT-2's std for weight matrices
# A param's generator seed is ``seed * _SEED_STRIDE + crc32(fqn)``: run seeds a prime apart, so
# that the next run seed does not hand one param the stream of another.
_SEED_STRIDE = 1_000_003


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and dtypes of :class:`GPT`."""

    vocab_size: int
    """Number of token ids."""
    seq_len: int
    """Maximum sequence length (size of the learned position embedding)."""
    d_model: int
    """Width of the residual stream."""
    num_layers: int
    """Number of transformer blocks."""
    num_heads: int
    """Attention heads per block; must divide ``d_model``."""
    d_ff: int
    """Hidden width of a dense MLP (split evenly across experts in MoE blocks)."""
    num_experts: int = 2
    """Expert MLPs in an MoE block."""
    moe_every: int = 2
    """Every ``moe_every``-th block (1-based) is an MoE block; 0 disables MoE."""
    tie_embeddings: bool = True
    """Share the token embedding with the LM head."""
    model_dtype: str = "bf16"
    """Dtype of the bulk of the weights: ``bf16``, ``fp16`` or ``fp32``. Norms and routers stay fp32."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "num_layers", "num_heads", "d_ff", "num_experts"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"ModelConfig.{name} must be an int >= 1, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide d_model ({self.d_model})")
        if self.d_ff % self.num_experts:
            raise ValueError(f"num_experts ({self.num_experts}) must divide d_ff ({self.d_ff})")
        if self.moe_every < 0:
            raise ValueError(f"moe_every must be >= 0, got {self.moe_every}")
        if self.model_dtype not in _DTYPES:
            raise ValueError(f"model_dtype must be one of {sorted(_DTYPES)}, got {self.model_dtype!r}")

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.model_dtype]

    def is_moe(self, layer: int) -> bool:
        return self.moe_every > 0 and (layer + 1) % self.moe_every == 0


PRESETS: dict[str, ModelConfig] = {
    # CPU tests and the demo: ~0.1M params, a few ms per step.
    "tiny": ModelConfig(vocab_size=64, seq_len=64, d_model=64, num_layers=2, num_heads=4, d_ff=256),
    # CPU experiments: ~3.2M params.
    "small": ModelConfig(vocab_size=256, seq_len=128, d_model=256, num_layers=4, num_heads=8, d_ff=1024),
    # GPU benchmarks: ~1.3B params (GPT-2 XL shape, GPT-NeoX vocab size).
    "1b": ModelConfig(
        vocab_size=50304, seq_len=1024, d_model=2048, num_layers=24, num_heads=16, d_ff=8192,
        num_experts=4, moe_every=4,
    ),
}


def model_config(preset: str, **overrides: object) -> ModelConfig:
    """The named preset, with fields replaced by ``overrides``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose from {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[preset], **overrides)


class Norm(nn.LayerNorm):
    """LayerNorm kept in fp32 whatever the model dtype; computes in fp32, returns the input dtype."""

    def __init__(self, dim: int, device: torch.device | None = None) -> None:
        super().__init__(dim, device=device, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device | None) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        kw = {"device": device, "dtype": cfg.dtype, "bias": False}
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, **kw)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        if x.device.type == "cpu":
            # PyTorch's CPU flash kernel is several times slower than the math path at these sizes.
            with sdpa_kernel(SDPBackend.MATH):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dtype: torch.dtype, device: torch.device | None) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        self.down = nn.Linear(d_ff, d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class MoE(nn.Module):
    """Soft mixture of experts: an fp32 router weighs every expert's output (dense, deterministic)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | None) -> None:
        super().__init__()
        self.router = nn.Linear(cfg.d_model, cfg.num_experts, device=device, dtype=torch.float32)
        width = cfg.d_ff // cfg.num_experts
        self.experts = nn.ModuleList(
            MLP(cfg.d_model, width, cfg.dtype, device) for _ in range(cfg.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x.float()), dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            out = out + gates[..., i : i + 1] * expert(x)
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, device: torch.device | None) -> None:
        super().__init__()
        self.norm1 = Norm(cfg.d_model, device)
        self.attn = Attention(cfg, device)
        self.norm2 = Norm(cfg.d_model, device)
        self.mlp = MoE(cfg, device) if cfg.is_moe(layer) else MLP(cfg.d_model, cfg.d_ff, cfg.dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(tokens, targets)`` returns the mean cross-entropy loss."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = cfg
        kw = {"device": device, "dtype": cfg.dtype}
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model, **kw)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model, **kw)
        self.blocks = nn.ModuleList(Block(cfg, i, device) for i in range(cfg.num_layers))
        self.norm = Norm(cfg.d_model, device)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, **kw)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.config.seq_len}")
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        weight = self.tok_emb.weight if self.head is None else self.head.weight
        logits = F.linear(x, weight)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """Deterministic init: each param drawn from a generator seeded by ``(seed, fqn)``.

    The generator lives on the param's device (drawing 1.3B values on one CPU thread takes half a
    minute), so values are identical across DP sizes and runs, and differ between CPU and CUDA.
    """
    cfg = model.config
    # GPT-2 style: residual projections scaled down with depth (two per block).
    proj_std = INIT_STD / math.sqrt(2 * cfg.num_layers)
    for fqn, param in model.named_parameters():
        if param.ndim == 1:
            # LayerNorm gains start at 1; biases (norms, router) at 0.
            param.fill_(1.0 if fqn.endswith(".weight") else 0.0)
            continue
        gen = torch.Generator(device=param.device)
        gen.manual_seed((seed * _SEED_STRIDE + zlib.crc32(fqn.encode())) % 2**63)
        std = proj_std if fqn.endswith((".proj.weight", ".down.weight")) else INIT_STD
        value = torch.randn(param.shape, generator=gen, device=param.device, dtype=torch.float32)
        param.copy_(value.mul_(std))


def build_model(cfg: ModelConfig, *, seed: int, device: torch.device | str = "cpu") -> GPT:
    """A :class:`GPT` on ``device`` with weights initialised from ``seed``.

    Built directly on ``device`` rather than on ``meta`` + ``to_empty``: the first use of the meta
    device imports PyTorch's meta registrations, seconds per process, more than the default init it
    would save at these sizes.
    """
    model = GPT(cfg, device=device)
    init_weights(model, seed)
    return model


def no_decay(fqn: str, param: torch.Tensor) -> dict[str, float]:
    """``param_group_fn`` for the optimizer: matrices decay; vectors (norm weights, biases) do not."""
    return {} if param.ndim >= 2 else {"weight_decay": 0.0}


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
