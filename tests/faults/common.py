"""Deterministic models and on-disk checkpoint surgery for the fault-injection tests."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash
from torch import nn

from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint
from shardopt.checkpoint import commit
from shardopt.checkpoint.format import manifest_checksum
from shardopt.optimizer import STATE_NAMES


class Net(nn.Module):
    """fp32 and bf16 params (bf16 ones get a separate fp32 main copy), a frozen layer and a
    buffer (both stored in the model file), so every kind of stored tensor is present."""

    def __init__(self, width: int = 16, extra_layer: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.norm = nn.LayerNorm(width)
        self.hidden = nn.Linear(width, width).to(torch.bfloat16)
        self.out = nn.Linear(width, 3)
        self.frozen = nn.Linear(3, 2).requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0, 1, 7))
        if extra_layer:
            self.extra = nn.Linear(3, 3)


def config(**overrides: Any) -> OptimizerConfig:
    return OptimizerConfig(**{"lr": 1e-2, "bucket_numel": 256, "align_numel": 4, **overrides})


def train_step(model: nn.Module, opt: DistributedOptimizer, seed: int) -> None:
    """One optimizer step whose gradients depend on ``seed`` only (equal on every rank,
    so the result is bitwise the same at any DP size)."""
    g = torch.Generator().manual_seed(seed + 12345)
    loss = sum((p.float() * torch.randn(p.shape, generator=g)).sum()
               for p in model.parameters() if p.requires_grad)
    loss.backward()
    opt.step()
    opt.zero_grad()


def trained(seed: int, width: int = 16, extra_layer: bool = False,
            **cfg: Any) -> tuple[Net, DistributedOptimizer]:
    """Model and optimizer whose whole state (weights, main params, moments) is a function
    of ``seed``: the state a checkpoint of step ``seed`` is expected to hold."""
    torch.manual_seed(seed)
    model = Net(width, extra_layer)
    opt = DistributedOptimizer(model, config(**cfg))
    train_step(model, opt, seed)
    return model, opt


def snapshot(model: nn.Module, opt: DistributedOptimizer,
             rng: bool = True) -> dict[str, torch.Tensor]:
    """Copies of everything a load may touch on this rank."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for s in opt.shard_state.shards:
        for name in STATE_NAMES:
            where = f"{s.fqn}.{name}@{s.range_param.start}"
            if name == "master_param" or (opt.shard_state.has_moments and not opt.config.lowprec_moments):
                out[where] = opt.shard_state.view(name, s).clone()
            elif opt.shard_state.has_moments:  # as stored: values (and 8-bit scales)
                m = opt.shard_state.moment(name, s)
                out[where] = m.values.clone()
                if m.scales is not None:
                    out[f"{where}.scale"] = m.scales.clone()
    out["param_steps"] = torch.tensor([opt.param_steps[f] for f in sorted(opt.param_steps)])
    if rng:
        out["rng"] = torch.get_rng_state()
    return out


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ in any bit (or exist on one side only)."""
    out = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k].reshape(-1), b[k].reshape(-1)
        if x.dtype != y.dtype or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            out.append(k)
    return out


# ------------------------------------------------------------------ on-disk surgery
def read_json(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def write_manifest(path: Path, m: dict[str, Any], rehash: bool = True) -> None:
    """Write ``m`` as the manifest; with ``rehash`` also fix its checksum, as a crafted
    (hostile) manifest would."""
    if rehash:
        m["checksum"] = manifest_checksum(m)
    (path / "manifest.json").write_text(json.dumps(m, indent=1))


def edit_manifest(path: Path, fn: Callable[[dict[str, Any]], None], rehash: bool = True) -> None:
    m = read_json(path)
    fn(m)
    write_manifest(path, m, rehash)


def rehash_file(path: Path, name: str) -> None:
    """Recompute ``name``'s size and block hashes in the manifest (a consistent forgery)."""
    m = read_json(path)
    rec = m["files"][name]
    data = (path / name).read_bytes()
    bb = rec["block_bytes"]
    rec["size"] = len(data)
    rec["hashes"] = [xxhash.xxh3_64_hexdigest(data[i:i + bb]) for i in range(0, len(data), bb)]
    write_manifest(path, m)


def flip_byte(file: Path, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def header_length(file: Path) -> int:
    with open(file, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def data_offset(file: Path, key: str) -> int:
    """Byte offset in ``file`` of the first element of stored tensor ``key``."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return 8 + n + header[key]["data_offsets"][0]


def listing(root: Path) -> list[str]:
    return sorted(os.listdir(root))

def check_state(path: str, step: int, width: int = 16) -> None:
    """``path`` loads (here: one process, whatever DP size saved it) into exactly the state of
    ``trained(step)``."""
    model, opt = trained(10_000 + step, width=width)
    info = checkpoint.load(path, model, opt)
    assert info.step == step
    expected_model, expected_opt = trained(step, width=width)
    assert differences(snapshot(model, opt, rng=False),
                       snapshot(expected_model, expected_opt, rng=False)) == []

def check_root(root: Path) -> list[Path]:
    """Every committed checkpoint under ``root`` verifies; returns them."""
    steps = commit.complete_steps(root)
    for p in steps:
        checkpoint.verify(p)
    return steps
