"""Comparisons the test modules share: raw bits, dicts of tensors, a checkpoint's bytes, an
export, an optimizer's whole state gathered from every rank, and the host buffers of
asynchronous saves."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from shardopt import DistributedOptimizer, checkpoint


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so -0.0 != 0.0 and NaN == NaN compare as stored."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_tensors_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                         what: str = "") -> None:
    assert sorted(actual) == sorted(expected), what
    for k in expected:
        a, e = actual[k], expected[k]
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what} {k}: {a.dtype}{list(a.shape)}"
        assert torch.equal(a, e), f"{what} {k}: max diff {(a.double() - e.double()).abs().max()}"


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest elementwise difference between two dicts of tensors with the same keys."""
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def param_copies(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each param (tied ones once) copied to the CPU, by FQN."""
    return {fqn: p.detach().to("cpu", copy=True) for fqn, p in model.named_parameters()}


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` (params and buffers, tied weights under each name) copied to the CPU."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def checkpoint_bytes(path: Path) -> dict[str, Any]:
    """Every file of a committed checkpoint, the manifest without its creation time."""
    out: dict[str, Any] = {}
    for f in sorted(path.iterdir()):
        if f.name == "manifest.json":
            m = json.loads(f.read_text())
            m.pop("created"), m.pop("checksum")
            out[f.name] = m
        else:
            out[f.name] = f.read_bytes()
    return out


def read_export(out_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(out_dir).glob("*.safetensors")):
        tensors = load_file(str(f))
        assert not set(tensors) & set(out), f"{f.name} repeats keys"
        out.update(tensors)
    return out


def exported(path: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    checkpoint.export(path, out_dir)
    return read_export(out_dir)



def full_state(opt: DistributedOptimizer) -> dict[Any, Any]:
    """Collective. Every param's whole Adam state, step count and lr, from every rank's part."""
    sd = opt.state_dict()
    mine = {(fqn, name): (st[name].offset, st[name].local.clone(), st[name].numel())
            for fqn, st in sd["state"].items()
            for name in ("exp_avg", "exp_avg_sq", "master_param")}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    full: dict[Any, Any] = {}
    for part in parts:
        for key, (offset, local, numel) in part.items():
            t = full.setdefault(key, torch.full((numel,), float("nan")))
            t[offset:offset + local.numel()] = local
    full["steps"] = {fqn: int(st["step"]) for fqn, st in sd["state"].items()}
    full["lr"] = [g["lr"] for g in opt.param_groups]
    return full


def assert_same_state(loaded: dict[Any, Any], saved: dict[Any, Any]) -> None:
    """Bit for bit, as :func:`full_state` gives them."""
    assert loaded.keys() == saved.keys()
    for key in saved:
        if isinstance(saved[key], torch.Tensor):
            assert torch.equal(loaded[key], saved[key]), key
        else:
            assert loaded[key] == saved[key], key




def assert_trains_as_reference(ours: dict[str, Any], ref: dict[str, Any],
                               rank0: dict[str, Any], steps: int, clip: float,
                               tol: float) -> None:
    """``ours`` (a rank's ``norms``, the grad norm the framework saw before clipping at each
    step, and final ``params``) against ``ref``, the same framework's run with
    ``torch.optim.AdamW``; ``rank0``: rank 0's run of ours."""
    assert len(ours["norms"]) == steps
    assert ours["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    assert max(ref["norms"]) > clip  # clipping changed the steps
    assert max_diff(ours["params"], ref["params"]) <= tol
    assert max_diff(ours["params"], rank0["params"]) == 0  # the ranks agree


def snapshot_buffers() -> dict[int, int]:
    """Bytes of each host buffer of this process's asynchronous saves, by inode: the memfd
    mappings the writer process reads, sized exactly."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("/memfd:shardopt-snapshot"):
            st = os.fstat(int(fd))
            out[st.st_ino] = st.st_size
    return out


def new_snapshot_buffers(known: dict[int, int]) -> dict[int, int]:
    """:func:`snapshot_buffers` not in ``known`` (an earlier listing)."""
    return {ino: size for ino, size in snapshot_buffers().items() if ino not in known}


SHARED_SNAPSHOTS = pytest.mark.skipif(not hasattr(os, "memfd_create"),
                                      reason="the snapshot's shared buffers need memfd")


def snapshot_bytes(model: nn.Module, opt: DistributedOptimizer) -> int:
    """Bytes of the host snapshot of one rank's state with fp32 moments: its model shards in
    their dtypes and three fp32 states per shard (an fp32 param's main param is the param
    itself, copied once), and on rank 0 the frozen tensors and buffers. The RNG state is not
    copied: torch returns it as a new tensor at the call."""
    fp32 = sum(s.range_param.size for s in opt.shard_state.shards
               if opt.layout.buffers[s.buffer_index].dtype == torch.float32)
    state = sum(s.range_param.size for s in opt.shard_state.shards) * 3 * 4
    model_bytes = sum(s.range_param.size * opt.layout.buffers[s.buffer_index].dtype.itemsize
                      for s in opt.shard_state.shards) - fp32 * 4
    frozen = 0
    if opt.shard_state.dp.rank == 0:
        tensors = importlib.import_module("shardopt.checkpoint.state").frozen_tensors(model, opt)
        frozen = sum(t.numel() * t.element_size() for t in tensors.values())
    return state + model_bytes + frozen
