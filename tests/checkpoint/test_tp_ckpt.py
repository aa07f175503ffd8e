"""Checkpoints of tensor- and expert-parallel models: saved as N-D boxes of each param's
global tensor, loaded at any other (DP, TP, EP) layout (gloo, up to 4 ranks)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from faults.common import data_offset, edit_manifest, flip_byte
from helpers.checks import bits, exported
from helpers.dist import run_distributed
from helpers.parallel_models import (Run, build, checkpoint_rank, full_params, mismatch,
                                     reference, train_step)
from shardopt import checkpoint, cli
from shardopt.errors import CheckpointError, FormatError
from shardopt.parallel import local_tensor


def _save(tmp: Path, run: Run, name: str, load_from: str | None = None, first: int = 0,
          steps: int = 2) -> str:
    world = run.dp * run.mp
    out = run_distributed(checkpoint_rank, world, run, str(tmp / name), load_from, first,
                          steps, True, tmp_path=tmp)
    return out[0]["path"]


def _assert_same_export(tmp: Path, a: str, b: str) -> None:
    """The exports of ``a`` and ``b`` (model and optimizer state) are the same files, byte
    for byte (tensor by tensor first, to name the one that differs)."""
    want, got = exported(a, tmp / "export_a"), exported(b, tmp / "export_b")
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(bits(got[key]), bits(want[key])), key
    files = sorted(f.name for f in (tmp / "export_a").iterdir())
    assert files == sorted(f.name for f in (tmp / "export_b").iterdir())
    for name in files:
        assert (tmp / "export_a" / name).read_bytes() == (tmp / "export_b" / name).read_bytes()


@pytest.fixture(scope="module")
def saved_tp(tmp_path_factory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("tp")
    return tmp, _save(tmp, Run("tp", dp=2, mp=2), "source")


@pytest.mark.parametrize("dp,tp", [(4, 1), (1, 4), (1, 2), (3, 1)])
def test_tp_checkpoint_loads_at_another_layout(saved_tp, dp, tp):
    """Loaded at the new layout and saved again without a step: the same export, bit for bit."""
    tmp, source = saved_tp
    again = _save(tmp, Run("tp", dp=dp, mp=tp), f"at_{dp}_{tp}", source, first=2, steps=0)
    _assert_same_export(tmp / f"cmp_{dp}_{tp}", source, again)


def test_tp_resume_at_the_same_layout_is_bit_identical(saved_tp):
    tmp, source = saved_tp
    run = Run("tp", dp=2, mp=2)
    straight = run_distributed(checkpoint_rank, 4, run, str(tmp / "straight"), None, 0, 5,
                               False, tmp_path=tmp)
    resumed = run_distributed(checkpoint_rank, 4, run, str(tmp / "resumed"), source, 2, 3,
                              False, tmp_path=tmp)
    for a, b in zip(straight, resumed):
        for fqn in a["params"]:
            assert torch.equal(bits(a["params"][fqn]), bits(b["params"][fqn])), fqn


def test_tp_checkpoint_describes_global_shapes_and_boxes(saved_tp, capsys):
    _, source = saved_tp
    assert checkpoint.verify(source)["files"] == 4 * 5
    rows = {r["fqn"]: r for r in checkpoint.inspect(source)["params"]}
    assert rows["down.weight"]["shape"] == [8, 16]
    assert rows["down.weight"]["placements"] == ["Shard(dim=1)"]
    boxes = rows["down.weight"]["boxes"]
    assert sum(b["lengths"][0] * b["lengths"][1] for b in boxes) == 8 * 16
    assert {b["offsets"][1] for b in boxes} == {0, 8}  # each TP rank's half of the columns
    assert rows["norm.weight"]["placements"] == []
    cli.print_inspect(checkpoint.inspect(source))
    table = capsys.readouterr().out
    down = next(line for line in table.splitlines() if line.startswith("down.weight"))
    assert down.split()[1] == "8x16" and down.endswith(f"{len(boxes)} boxes of Shard(dim=1)")


@pytest.mark.parametrize("ep", [1, 4])
def test_moe_checkpoint_loads_at_another_expert_parallel_size(tmp_path, ep):
    source = _save(tmp_path, Run("moe", dp=2, mp=2), "source")
    again = _save(tmp_path, Run("moe", dp=2 if ep == 1 else 1, mp=ep), f"ep{ep}", source,
                  first=2, steps=0)
    _assert_same_export(tmp_path / "cmp", source, again)


def test_a_checkpoint_without_tensor_parallelism_loads_into_one_with(tmp_path):
    source = _save(tmp_path, Run("tp", dp=4, mp=1), "plain")
    again = _save(tmp_path, Run("tp", dp=2, mp=2), "tp", source, first=2, steps=0)
    _assert_same_export(tmp_path / "cmp", source, again)


def test_a_version_3_checkpoint_loads(tmp_path):
    """Version 3 held data-parallel checkpoints in the files version 4 writes for them."""
    source = _save(tmp_path, Run("tp", dp=2, mp=1), "v3")
    edit_manifest(Path(source), lambda m: m.__setitem__("version", 3))
    assert checkpoint.inspect(source)["format_version"] == 3
    again = _save(tmp_path, Run("tp", dp=1, mp=2), "tp", source, first=2, steps=0)
    _assert_same_export(tmp_path / "cmp", source, again)


def _local_state(model, opt) -> dict[str, torch.Tensor]:
    out = {f"param.{f}": local_tensor(p).detach().clone() for f, p in model.named_parameters()}
    out.update({k: t.clone() for k, t in opt.shard_state.sources().items()})
    return out


def failed_load_rank(rank: int, world_size: int, run: Run, path: str, low_memory: bool):
    model, opt, piece = build(run)
    train_step(model, opt, run, piece, 0)
    before = _local_state(model, opt)
    with pytest.raises(CheckpointError, match="content hash mismatch"):
        checkpoint.load(path, model, opt)
    after = _local_state(model, opt)
    assert sorted(after) == sorted(before)
    assert all(torch.equal(bits(after[k]), bits(before[k])) for k in before)


def test_a_failed_load_at_another_layout_changes_nothing(saved_tp):
    tmp, source = saved_tp
    broken = tmp / "broken"
    shutil.copytree(source, broken)
    name = "exp_avg-00001.safetensors"
    flip_byte(broken / name, data_offset(broken / name, "down.weight.exp_avg") + 3)
    run_distributed(failed_load_rank, 2, Run("tp", dp=1, mp=2), str(broken), False,
                    tmp_path=tmp)


def low_memory_rank(rank: int, world_size: int, run: Run, path: str) -> dict[str, Any]:
    model, opt, piece = build(run)
    checkpoint.load(path, model, opt, low_memory_resume=True)
    staged = sorted(k for k, h in opt.shard_state.held.items() if h.where == "staged")
    train_step(model, opt, run, piece, 2)
    return {"staged": staged, "params": full_params(model)}


def test_low_memory_resume_of_a_tp_checkpoint_matches_the_default(saved_tp):
    tmp, source = saved_tp
    run = Run("tp", dp=2, mp=2)
    low = run_distributed(low_memory_rank, 4, run, source, tmp_path=tmp)
    plain = run_distributed(checkpoint_rank, 4, run, str(tmp / "plain"), source, 2, 1, False,
                            tmp_path=tmp)
    assert all(r["staged"] for r in low), "the moments were not kept on the host"
    for a, b in zip(low, plain):
        for fqn in a["params"]:
            assert torch.equal(bits(a["params"][fqn]), bits(b["params"][fqn])), fqn


def background_rank(rank: int, world_size: int, run: Run, root: str) -> dict[str, Any]:
    model, opt, piece = build(run)
    for step in range(2):
        train_step(model, opt, run, piece, step)
    out = {"blocking": checkpoint.save(f"{root}/blocking", model, opt, step=2)}
    handle = checkpoint.save(f"{root}/background", model, opt, step=2, blocking=False)
    train_step(model, opt, run, piece, 2)  # the background save holds the state of the call
    out["background"] = handle.wait()
    return out


def test_a_background_save_of_a_tp_model_holds_the_state_at_the_call(tmp_path):
    out = run_distributed(background_rank, 4, Run("tp"), str(tmp_path), tmp_path=tmp_path)
    _assert_same_export(tmp_path / "cmp", out[0]["blocking"], out[0]["background"])


def int8_rank(rank: int, world_size: int, run: Run, root: str) -> None:
    model, opt, piece = build(run)
    train_step(model, opt, run, piece, 0)
    with pytest.raises(CheckpointError, match="param 'up.weight' is sharded by tensor or "
                                              "expert parallelism and has 8-bit moments"):
        checkpoint.save(root, model, opt, step=1)


def test_8_bit_moments_of_tp_sharded_params_are_refused_by_name(tmp_path):
    run = Run("tp", extra={"exp_avg_dtype": "int8"})
    run_distributed(int8_rank, 4, run, str(tmp_path / "root"), tmp_path=tmp_path)


def test_hf_llama_trains_at_dp2_tp2_and_reshards_to_dp4(tmp_path):
    """parallelize_module over a Hugging Face Llama: the reference check, then the checkpoint
    loads at (dp4) with the same export."""
    run = Run("llama", steps=2)
    trained = run_distributed(checkpoint_rank, 4, run, str(tmp_path / "tp"), None, 0, 2, True,
                              tmp_path=tmp_path)
    ref = reference(run)
    for rank, result in enumerate(trained):
        assert mismatch(result, ref) == [], f"rank {rank}"
    source = trained[0]["path"]
    again = _save(tmp_path, Run("llama", dp=4, mp=1), "dp4", source, first=2, steps=0)
    _assert_same_export(tmp_path / "cmp", source, again)


def dcp_rank(rank: int, world_size: int, run: Run, root: str, load: bool) -> str:
    """Save (``load`` False: after 2 steps, through DCP and ``checkpoint.save``) or load
    through DCP at ``run``'s layout and save with ``checkpoint.save``."""
    import torch.distributed.checkpoint as dcp

    model, opt, piece = build(run)
    if load:
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=f"{root}/dcp")
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        return checkpoint.save(f"{root}/at_{run.dp}_{run.mp}", model, opt, step=2)
    for step in range(2):
        train_step(model, opt, run, piece, step)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=f"{root}/dcp")
    return checkpoint.save(f"{root}/ours", model, opt, step=2)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_state_dict_of_a_tp_model_reshards_through_dcp(tmp_path):
    """State at the params' global shapes: DCP loads it at another TP size, and without
    tensor parallelism into an optimizer given a dp_group_fn (a model-parallel plan)."""
    source = run_distributed(dcp_rank, 4, Run("tp"), str(tmp_path), False, tmp_path=tmp_path)[0]
    for dp, tp in [(4, 1), (1, 4)]:
        run = Run("tp", dp=dp, mp=tp, plan=True)
        again = run_distributed(dcp_rank, dp * tp, run, str(tmp_path), True,
                                tmp_path=tmp_path)[0]
        _assert_same_export(tmp_path / f"cmp_{dp}_{tp}", source, again)


def _box_chunk(m: dict, key: str) -> list:
    return next(c for f in m["files"].values() for c in f.get("chunks", [])
                if c[0] == key and len(c) == 4)


def _overlap(m: dict) -> None:
    _box_chunk(m, "down.weight")[3][0][0][0] += 1  # its first box one row down


def _outside(m: dict) -> None:
    _box_chunk(m, "down.weight")[3][0][0][1] = 15


def _too_few(m: dict) -> None:
    _box_chunk(m, "down.weight")[3][0][1][0] -= 1


def _version_3(m: dict) -> None:
    m["version"] = 3


@pytest.mark.parametrize("forge, needle", [
    (_overlap, "stored chunks of 'down.weight': boxes .* overlap"),
    (_outside, "stored chunks of 'down.weight': box .* lies outside shape \\[8, 16\\]"),
    (_too_few, "the boxes of chunk 'down.weight' in model-0000\\d.safetensors hold 16 elements, "
               "the chunk 24"),
    (_version_3, "malformed chunk .*down.weight"),
], ids=["overlap", "outside", "too-few", "boxes-in-version-3"])
def test_forged_boxes_are_refused_naming_the_key(saved_tp, forge, needle):
    tmp, source = saved_tp
    forged = tmp / f"forged_{forge.__name__}"
    shutil.copytree(source, forged)
    edit_manifest(forged, forge)
    with pytest.raises(FormatError, match=needle):
        checkpoint.inspect(forged)
