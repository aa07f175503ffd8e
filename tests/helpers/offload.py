"""The offload tests' model, its training with state round trips, and its whole state."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardopt import DistributedOptimizer, OptimizerConfig

# A device parameter: the GPU case runs where there is one.
CUDA = pytest.param("cuda", marks=pytest.mark.cuda)


class Mixed(nn.Module):
    """bf16 linears around an fp32 norm: two flat buffers, several buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 24).to(torch.bfloat16)
        self.norm = nn.LayerNorm(24)
        self.down = nn.Linear(24, 4).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.up(x.bfloat16()).float()))
        return self.down(h.bfloat16()).float()


def make(device: str = "cpu", **cfg: Any) -> tuple[Mixed, DistributedOptimizer]:
    torch.manual_seed(0)
    model = Mixed().to(device)
    config = OptimizerConfig(lr=1e-2, bucket_numel=64, max_grad_norm=1.0, **cfg)
    return model, DistributedOptimizer(model, config)


def batch(i: int, rank: int = 0, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * i + rank)
    return torch.randn(6, 8, generator=g).to(device), torch.randn(6, 4, generator=g).to(device)


def train(model: nn.Module, opt: DistributedOptimizer, steps: int, offload_at: tuple[int, ...] = (),
          rank: int = 0, accumulate: bool = False, cycle: Callable[..., Any] | None = None,
          after_backward: bool = False, copy: str | None = None) -> list[float]:
    """Losses of ``steps`` iterations; before each step in ``offload_at`` the whole state
    makes a round trip (``cycle(model, opt)`` between offload and onload): before the
    forward, or with ``after_backward`` between backward (its reductions maybe still in
    flight) and ``step()``."""
    device = opt.shard_state.device
    losses = []
    for i in range(steps):
        if i in offload_at and not (accumulate or after_backward):
            opt.offload()
            if cycle is not None:
                cycle(model, opt)
            opt.onload(copy)
        x, y = batch(i, rank, device)
        if accumulate:  # the first half under no_sync; the round trip keeps its grads
            with opt.no_sync():
                F.mse_loss(model(x[:3]), y[:3]).backward()
            if i in offload_at:
                opt.offload()
                opt.onload()
            x, y = x[3:], y[3:]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if i in offload_at and after_backward:
            opt.offload()
            opt.onload()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def state_of(model: nn.Module, opt: DistributedOptimizer) -> dict[str, torch.Tensor]:
    """Every param and this rank's main params and moments, copied."""
    opt.shard_state.finish_param_sync()
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for s in opt.shard_state.shards:
        for name in ("master_param", "exp_avg", "exp_avg_sq"):
            out[f"{s.fqn}.{name}"] = opt.shard_state.view(name, s).clone()
    return out
