"""Checkpoints of an optimizer with Muon params: the momentum buffers in model space.

A Muon matrix's ``"{fqn}.momentum_buffer"`` is written by its owner and read by whichever
rank owns it at the loading DP size, so a save at DP 2 loads at DP 3 and DP 1 into the same
state (the export of a re-save is the export of the save, bit for bit); a resume at the
same DP size continues bit for bit, also through ``low_memory_resume`` and a background
save; Muon state never loads into an AdamW param, nor the reverse.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardopt
from helpers.checks import assert_tensors_equal, checkpoint_bytes, exported, param_copies
from helpers.dist import run_distributed
from helpers.muon import MuonNet, config, groups, train_step
from shardopt import CheckpointError, DistributedOptimizer, checkpoint


def _build(**cfg) -> tuple[MuonNet, DistributedOptimizer]:
    model = MuonNet()
    return model, DistributedOptimizer(model, config(**cfg), param_group_fn=groups(model))


def _state(model: MuonNet, opt: DistributedOptimizer) -> dict[str, torch.Tensor]:
    """Params and, on their owner, the momentum buffers."""
    out = {f"param.{f}": t for f, t in param_copies(model).items()}
    for fqn, p in model.named_parameters():
        if "momentum_buffer" in opt.state[p]:
            out[f"momentum.{fqn}"] = opt.state[p]["momentum_buffer"].clone()
    return out


def _train_and_save(rank: int, world: int, root: str) -> str:
    model, opt = _build()
    for step in range(1, 4):
        train_step(model, opt, step, rank, world)
    return checkpoint.save(root, model, opt, step=3)


def _load_and_save(rank: int, world: int, path: str, root: str) -> str:
    model, opt = _build()
    checkpoint.load(path, model, opt)
    return checkpoint.save(root, model, opt, step=3)


def test_save_at_2_loads_at_3_and_1_into_the_same_state(tmp_path):
    path = run_distributed(_train_and_save, 2, str(tmp_path / "dp2"), tmp_path=tmp_path)[0]
    saved = exported(path, tmp_path / "export2")
    assert saved["up.weight.momentum_buffer"].shape == (40, 16)
    assert "up.weight.exp_avg" not in saved and "up.bias.exp_avg" in saved
    for world in (3, 1):
        again = run_distributed(_load_and_save, world, path, str(tmp_path / f"dp{world}"),
                                tmp_path=tmp_path)[0]
        assert_tensors_equal(exported(again, tmp_path / f"export{world}"), saved, f"dp {world}")


def _resume(rank: int, world: int, root: str) -> dict:
    model, opt = _build()
    for step in range(1, 4):
        train_step(model, opt, step, rank, world)
    checkpoint.save(root, model, opt, step=3)
    for step in range(4, 7):
        train_step(model, opt, step, rank, world)
    straight = _state(model, opt)
    out = {"straight": straight}
    for low_memory in (False, True):
        model, opt = _build()
        checkpoint.load(root, model, opt, low_memory_resume=low_memory)
        staged = {k: h.where for k, h in opt.shard_state.held.items()
                  if k.startswith("momentum_buffer.")}
        for step in range(4, 7):
            train_step(model, opt, step, rank, world)
        out[low_memory] = {"state": _state(model, opt), "staged": staged}
    return out


def test_same_dp_resume_is_bit_identical_over_3_steps(tmp_path):
    for r in run_distributed(_resume, 2, str(tmp_path / "root"), tmp_path=tmp_path):
        for low_memory in (False, True):
            assert_tensors_equal(r[low_memory]["state"], r["straight"], f"low {low_memory}")
            assert set(r[low_memory]["staged"].values()) == {
                "staged" if low_memory else "device"}  # momentum waits on the host


def _background(rank: int, world: int, root: str) -> list[str]:
    model, opt = _build()
    for step in range(1, 3):
        train_step(model, opt, step, rank, world)
    blocking = checkpoint.save(f"{root}/blocking", model, opt, step=2)
    handle = checkpoint.save(f"{root}/background", model, opt, step=2, blocking=False)
    train_step(model, opt, 3, rank, world)  # changes the state while it is written
    return [blocking, handle.wait()]


def test_background_save_holds_the_state_at_the_call(tmp_path):
    blocking, background = run_distributed(_background, 2, str(tmp_path), tmp_path=tmp_path)[0]
    assert checkpoint_bytes(Path(background)) == checkpoint_bytes(Path(blocking))


def test_muon_state_never_loads_into_an_adamw_param_nor_the_reverse(tmp_path):
    model, opt = _build()
    train_step(model, opt, 1, 0, 1)
    with_muon = checkpoint.save(tmp_path / "muon", model, opt, step=1)
    plain = MuonNet()
    adamw = DistributedOptimizer(plain, config())
    train_step(plain, adamw, 1, 0, 1)
    without = checkpoint.save(tmp_path / "adamw", plain, adamw, step=1)
    before = param_copies(plain)
    with pytest.raises(CheckpointError, match="param 'up.weight' has Muon's state in the "
                                              "checkpoint .momentum_buffer. but is AdamW's"):
        checkpoint.load(with_muon, plain, adamw)
    assert_tensors_equal(param_copies(plain), before)  # a refused load changes nothing
    with pytest.raises(CheckpointError, match="param 'up.weight' has AdamW's state in the "
                                              "checkpoint .exp_avg, exp_avg_sq. but is Muon's"):
        checkpoint.load(without, model, opt)


def test_manifest_and_inspect_describe_muon_params(tmp_path):
    model, opt = _build()
    train_step(model, opt, 1, 0, 1)
    path = checkpoint.save(tmp_path, model, opt, step=1)
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    group = manifest["params"]["mix.0.weight"]["group"]
    assert group["optimizer"] == "muon" and group["nesterov"] is False
    assert group["ns_coefficients"] == list(shardopt.MuonSettings().ns_coefficients)
    assert "optimizer" not in manifest["params"]["up.bias"]["group"]
    rows = {r["fqn"]: r for r in checkpoint.inspect(path)["params"]}
    assert rows["up.weight"]["state_bytes"] == 2 * 4 * 40 * 16  # main param, momentum
    assert rows["up.bias"]["state_bytes"] == 3 * 4 * 40
    exported_state = exported(path, tmp_path / "out")
    assert torch.equal(exported_state["up.weight.momentum_buffer"],
                       opt.state[model.up.weight]["momentum_buffer"])
    # Hyperparameters resume as saved (a scheduler may have changed them since).
    opt.param_groups[opt.shard_state.group_of["mix.0.weight"]]["momentum"] = 0.5
    checkpoint.load(path, model, opt)
    assert opt.param_groups[opt.shard_state.group_of["mix.0.weight"]]["momentum"] == 0.9


def test_8_bit_adam_moments_beside_muon_convert_on_load(tmp_path):
    """Low-precision storage is AdamW's: Muon's momentum stays fp32 and loads as stored."""
    model, opt = _build(exp_avg_dtype="int8", exp_avg_sq_dtype="bfloat16")
    for step in range(1, 3):
        train_step(model, opt, step, 0, 1)
    assert opt.state[model.up.weight]["momentum_buffer"].dtype == torch.float32
    assert opt.state[model.up.bias]["exp_avg"].dtype == torch.int8
    path = checkpoint.save(tmp_path, model, opt, step=2)
    other, fp32 = _build()
    checkpoint.load(path, other, fp32)  # the Adam moments converted to fp32
    assert torch.equal(fp32.state[other.up.weight]["momentum_buffer"],
                       opt.state[model.up.weight]["momentum_buffer"])
    decoded = exported(path, tmp_path / "out")["up.bias.exp_avg"]
    assert torch.equal(fp32.state[other.up.bias]["exp_avg"], decoded)
