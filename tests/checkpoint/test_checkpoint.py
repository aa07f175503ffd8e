"""Checkpoints: bitwise resume, the on-disk format, export, errors, ``latest``.

Multi-rank scenarios run through ``helpers.dist.run_distributed``; each spawn checks as
much as it can (save, continue, load, save again) and returns tensors, and the
parent compares them. The training model (``helpers.models.MixedLM``) mixes bf16 and fp32
params (fp32 norm and router registered between bf16 matmuls), has a frozen param and a 0-d
buffer, and uses tiny buckets so params are split across ranks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file

from helpers.checks import assert_tensors_equal, exported, model_state
from helpers.dist import device_for, require_world_size, run_distributed
from helpers.models import LM_DIM, LM_HIDDEN, STATE_NAMES, build, train
from shardopt import checkpoint
from shardopt.checkpoint import CheckpointError, FormatError

NUM_STEPS = 6
DOC = Path(__file__).resolve().parents[2] / "docs" / "format.md"


def flip_byte(file: Path, position: int) -> None:
    data = bytearray(file.read_bytes())
    data[position] ^= 0xFF
    file.write_bytes(bytes(data))


# ------------------------------------------------------------------ bitwise resume

def resume_reference_rank(rank: int, world_size: int, backend: str, root: str,
                          tied: bool) -> dict[str, Any]:
    device = device_for(backend, rank)
    model, opt = build(0, device, tied=tied, dropout=0.1)
    torch.manual_seed(1000 + rank)  # dropout masks differ per rank
    train(model, opt, range(NUM_STEPS), rank, world_size)
    checkpoint.save(f"{root}/uninterrupted", model, opt, step=NUM_STEPS)
    reference = model_state(model)

    # The same run, saved at step 3; saving must not disturb it.
    model, opt = build(0, device, tied=tied, dropout=0.1)
    torch.manual_seed(1000 + rank)
    train(model, opt, range(3), rank, world_size)
    checkpoint.save(f"{root}/interrupted", model, opt, step=3, extra={"data_step": 3, "tag": "x"})
    train(model, opt, range(3, NUM_STEPS), rank, world_size)
    return {"reference": reference, "saved_and_continued": model_state(model)}


def resume_rank(rank: int, world_size: int, backend: str, root: str, tied: bool,
                low_memory: bool) -> dict[str, Any]:
    device = device_for(backend, rank)
    torch.manual_seed(5000 + rank)  # a different RNG state: load must restore the saved one
    model, opt = build(123, device, tied=tied, dropout=0.1)  # different weights
    fresh_bytes = opt.memory_bytes()["optimizer_state"]
    info = checkpoint.load(f"{root}/interrupted", model, opt, low_memory_resume=low_memory)
    loaded_bytes = opt.memory_bytes()["optimizer_state"]
    train(model, opt, range(info.step, NUM_STEPS), rank, world_size)
    checkpoint.save(f"{root}/resumed-{low_memory}", model, opt, step=NUM_STEPS)
    return {"params": model_state(model), "info": info, "fresh_bytes": fresh_bytes,
            "loaded_bytes": loaded_bytes}


@pytest.mark.parametrize("world_size,tied", [(1, False), (2, False), (3, False), (2, True)],
                         ids=["dp1", "dp2", "dp3", "dp2-tied"])
def test_bitwise_resume(backend, world_size, tied, tmp_path):
    require_world_size(backend, world_size)
    root = tmp_path / "ckpt"
    refs = run_distributed(resume_reference_rank, world_size, backend, str(root), tied,
                           backend=backend, tmp_path=tmp_path)
    for r in refs:
        assert_tensors_equal(r["saved_and_continued"], r["reference"], "save disturbed the run")
        assert_tensors_equal(r["reference"], refs[0]["reference"], "ranks disagree")
    reference_state = exported(root / "uninterrupted", tmp_path / "export-ref")

    for low_memory in (False, True):
        results = run_distributed(resume_rank, world_size, backend, str(root), tied, low_memory,
                                  backend=backend, tmp_path=tmp_path)
        for rank, r in enumerate(results):
            assert_tensors_equal(r["params"], refs[rank]["reference"], f"low_memory={low_memory}")
            info = r["info"]
            assert (info.step, info.extra, info.dp_size_saved) == (3, {"data_step": 3, "tag": "x"},
                                                                    world_size)
            assert Path(info.path) == root / "interrupted" / "step_00000003"
            # The optimizer's own count of the state it holds on its device (bookkeeping:
            # moments wait off-device until the first step). The allocator's measurement of
            # the same is test_resume_memory's, on CUDA.
            if low_memory:
                assert r["loaded_bytes"] == r["fresh_bytes"]
            else:
                assert r["loaded_bytes"] > r["fresh_bytes"]
        # Moments, main params and step counts too, not only the weights.
        resumed = exported(root / f"resumed-{low_memory}", tmp_path / f"export-{low_memory}")
        assert_tensors_equal(resumed, reference_state, f"low_memory={low_memory}")


def scheduler_resume_rank(rank: int, world_size: int, root: str, resume: bool) -> dict:
    def lr_lambda(epoch: int) -> float:
        return 0.5 ** epoch

    model, opt = build(4 if resume else 0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    if resume:
        info = checkpoint.load(root, model, opt)
        sched.load_state_dict(info.extra["scheduler"])
        # load() restores step counts, not the groups' lr: the scheduler state says it.
        for group, lr in zip(opt.param_groups, sched.get_last_lr()):
            group["lr"] = lr
        train(model, opt, range(info.step, 4), rank, world_size, sched)
    else:
        train(model, opt, range(2), rank, world_size, sched)
        checkpoint.save(root, model, opt, step=2, extra={"scheduler": sched.state_dict()})
        train(model, opt, range(2, 4), rank, world_size, sched)
    return {"params": model_state(model), "lrs": [g["lr"] for g in opt.param_groups]}


def test_resume_with_lr_scheduler_state_in_extra(tmp_path):
    root = str(tmp_path / "ckpt")
    ref = run_distributed(scheduler_resume_rank, 2, root, False, tmp_path=tmp_path)
    res = run_distributed(scheduler_resume_rank, 2, root, True, tmp_path=tmp_path)
    for a, b in zip(res, ref):
        assert a["lrs"] == b["lrs"]
        assert_tensors_equal(a["params"], b["params"])



def test_every_file_is_safetensors_or_json(saved3):
    files = sorted(p for p in saved3.root.rglob("*") if p.is_file())
    names = {p.relative_to(saved3.root).as_posix() for p in files}
    # Only the commit protocol's lock file may sit beside them (empty).
    locks = {n for n in names if n.startswith(".") and "/" not in n}
    assert all((saved3.root / n).stat().st_size == 0 for n in locks)
    expected = {"latest", "step_00000002/manifest.json"} | {
        f"step_00000002/{kind}-{r:05d}.safetensors"
        for kind in ("model", "optim", "exp_avg", "exp_avg_sq", "rng")
        for r in range(3)}
    assert names - locks == expected  # one file per kind and writing rank; no world size
    assert (saved3.root / "latest").read_text() == "step_00000002\n"
    for f in files:
        raw = f.read_bytes()
        if f.suffix == ".safetensors":
            (n,) = struct.unpack("<Q", raw[:8])
            assert raw[8:9] == b"{" and isinstance(json.loads(raw[8:8 + n]), dict)
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    assert st.get_tensor(key).dim() == 1
        else:
            assert not (raw[:1] == b"\x80" and raw[1:2] in b"\x02\x03\x04\x05"), f
            raw.decode("utf-8")  # text
            if f.suffix == ".json":
                assert isinstance(json.loads(raw), dict)
        assert raw[:4] != b"PK\x03\x04", f"{f} is a zip archive (the torch.save format)"
        # Nothing only torch.load can read (torch 2.13 also reads safetensors: same tensors).
        try:
            via_torch = torch.load(f, weights_only=False)
        except Exception:  # noqa: BLE001 - any failure to unpickle is what we want
            continue
        assert f.suffix == ".safetensors", f"torch.load reads {f}"
        assert_tensors_equal(via_torch, load_file(str(f)))


def test_manifest_fields_chunks_and_block_hashes(saved3):
    m = json.loads((saved3.path / "manifest.json").read_text())
    assert m["format"] == "shardopt" and m["version"] == 4
    assert (m["step"], m["dp_size"], m["extra"]) == (2, 3, {"data": [1, 2]})
    assert m["config"]["bucket_numel"] == 97 and m["config"]["betas"] == [0.9, 0.95]
    assert set(m["params"]) == set(saved3.params)
    for fqn, info in m["params"].items():
        assert info["shape"] == list(saved3.params[fqn].shape)
        assert info["dtype"] == str(saved3.params[fqn].dtype).removeprefix("torch.")
        assert info["trainable"] == (fqn not in ("pos", "temperature"))
        if info["trainable"]:
            assert info["step"] == 2
            assert info["group"]["lr"] == (5e-3 if fqn.startswith("router.") else 1e-2)
    for name, rec in m["files"].items():
        raw = (saved3.path / name).read_bytes()
        assert rec["size"] == len(raw) and rec["block_bytes"] == 512
        blocks = [raw[i:i + 512] for i in range(0, len(raw), 512)]
        assert len(blocks) > 1
        assert rec["hashes"] == [xxhash.xxh3_64_hexdigest(b) for b in blocks]
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        sharding = json.loads(header.pop("__metadata__")["DCP_SHARDING_INFO"])
        assert (8 + n) % 8 == 0
        chunks = sorted([k, sharding[k]["saved_offsets"][0], v["shape"][0]]
                        for k, v in header.items())
        if name.startswith("rng-"):
            assert "torch_cpu" in header
        else:
            assert chunks == sorted(rec["chunks"])


def test_torch_hf_storage_reader_reads_our_files(saved3, tmp_path):
    import torch.distributed.checkpoint as dcp

    whole = exported(saved3.path, tmp_path)
    # Split across all three ranks, of one rank only, bf16 model weights, fp32 params.
    keys = ["emb.weight.exp_avg", "up.weight.exp_avg_sq", "router.weight.master_param",
            "router.bias.exp_avg", "up.weight", "down.bias"]
    sd = {k: torch.empty(whole[k].numel(), dtype=whole[k].dtype) for k in keys}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(str(saved3.path)), no_dist=True)
    for k in keys:
        assert torch.equal(sd[k], whole[k].reshape(-1)), k


def test_format_doc_snippet_reassembles_every_tensor(saved3, tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, f"no python snippet in {DOC}"
    namespace: dict[str, Any] = {}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)  # noqa: S102 - our own doc
    whole = exported(saved3.path, tmp_path)
    for key, expected in whole.items():
        got = namespace["read_full"](str(saved3.path), key)
        assert got.dtype == expected.dtype and torch.equal(got, expected), key


def test_inspect_and_verify(saved3, tmp_path):
    info = checkpoint.inspect(saved3.root)  # a root means its latest checkpoint
    assert Path(info["path"]) == saved3.path
    assert (info["step"], info["dp_size"], info["format_version"]) == (2, 3, 4)
    assert info["extra"] == {"data": [1, 2]}
    rows = {r["fqn"]: r for r in info["params"]}
    assert set(rows) == set(saved3.params)
    assert rows["up.weight"]["shape"] == [LM_HIDDEN, LM_DIM]
    assert rows["up.weight"]["dtype"] == "bfloat16"
    assert rows["pos"]["trainable"] is False and rows["router.bias"]["dtype"] == "float32"
    assert info["num_files"] == 15
    assert checkpoint.verify(saved3.path)["step"] == 2

    def damaged(name: str) -> Path:
        copy = tmp_path / name / "step_00000002"
        shutil.copytree(saved3.path, copy)
        return copy

    p = damaged("flip")
    flip_byte(p / "optim-00001.safetensors", 1500)
    with pytest.raises(FormatError, match="optim-00001.safetensors"):
        checkpoint.verify(p)
    p = damaged("missing")
    (p / "model-00002.safetensors").unlink()
    with pytest.raises(FormatError, match="model-00002.safetensors"):
        checkpoint.verify(p)
    p = damaged("truncated")
    raw = (p / "rng-00000.safetensors").read_bytes()
    (p / "rng-00000.safetensors").write_bytes(raw[:-1])
    with pytest.raises(FormatError, match="rng-00000.safetensors"):
        checkpoint.verify(p)
    p = damaged("manifest")
    (p / "manifest.json").write_text('{"format": "shardopt", ')
    with pytest.raises(FormatError, match="manifest.json"):
        checkpoint.verify(p)
    assert issubclass(FormatError, ValueError) and issubclass(CheckpointError, ValueError)


# ------------------------------------------------------------ dtype change on load

def dtype_change_rank(rank: int, world_size: int, root: str) -> list[float]:
    model, opt = build(0)  # norm and router fp32, up bf16
    train(model, opt, range(2), rank, world_size)
    checkpoint.save(f"{root}/a", model, opt, step=2)
    model, opt = build(1, fp32=("norm", "up"))  # router now bf16, up now fp32
    checkpoint.load(f"{root}/a", model, opt)
    checkpoint.save(f"{root}/b", model, opt, step=2)
    losses = train(model, opt, range(2, 3), rank, world_size)
    model, opt = build(2)  # back to the original dtypes
    checkpoint.load(f"{root}/b", model, opt)
    checkpoint.save(f"{root}/c", model, opt, step=2)
    return losses


def test_param_dtype_change_keeps_optimizer_state_exact(tmp_path):
    root = tmp_path / "ckpt"
    losses = run_distributed(dtype_change_rank, 2, str(root), tmp_path=tmp_path)
    assert all(torch.isfinite(torch.tensor(x)).all() for x in losses)
    a, b, c = (exported(root / k, tmp_path / f"export-{k}") for k in "abc")
    state = [k for k in a if k.endswith(STATE_NAMES)]
    assert_tensors_equal({k: b[k] for k in state}, {k: a[k] for k in state}, "fp32 state a -> b")
    assert b["router.weight"].dtype == torch.bfloat16 and b["up.weight"].dtype == torch.float32
    assert torch.equal(b["router.weight"], a["router.weight"].to(torch.bfloat16))
    assert torch.equal(b["up.weight"], a["up.weight.master_param"])
    assert_tensors_equal(c, a, "a -> b -> c round trip")
    m = json.loads((root / "b" / "step_00000002" / "manifest.json").read_text())
    assert (m["params"]["router.weight"]["dtype"], m["params"]["up.weight"]["dtype"]) == \
        ("bfloat16", "float32")


# ---------------------------------------------------- failed loads change nothing

MISMATCHES = {
    # case: (model kwargs, text the error must contain)
    "missing": (dict(extra_layer=True), "'extra."),
    "unexpected": (dict(down_bias=False), "'down.bias'"),
    "shape": (dict(experts=4), "'router."),
    "corrupt": ({}, "exp_avg_sq-00001.safetensors"),
    "no_file": ({}, "model-00000.safetensors"),
    "corrupt_fresh": ({}, "exp_avg_sq-00001.safetensors"),  # no step taken: no moments yet
}


def failed_load_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, opt = build(0)
    train(model, opt, range(2), rank, world_size)
    good = Path(checkpoint.save(f"{root}/good", model, opt, step=2))
    if rank == 0:
        shutil.copytree(good, f"{root}/corrupt/{good.name}")
        flip_byte(Path(f"{root}/corrupt/{good.name}/exp_avg_sq-00001.safetensors"), -3)
        shutil.copytree(good, f"{root}/no_file/{good.name}")
        os.remove(f"{root}/no_file/{good.name}/model-00000.safetensors")
    dist.barrier()
    out = {}
    for case, (kwargs, _) in MISMATCHES.items():
        model, opt = build(7, **kwargs)
        if case != "corrupt_fresh":
            train(model, opt, range(5, 6), rank, world_size)
        source = f"{root}/{case}" if case.startswith(("corrupt", "no_file")) else f"{root}/good"
        source = source.removesuffix("_fresh")
        before = model_state(model), opt.memory_bytes(), dict(opt.param_steps)
        checkpoint.save(f"{root}/before-{case}", model, opt, step=0)
        try:
            checkpoint.load(source, model, opt)
            error = None
        except CheckpointError as e:
            error = str(e)
        checkpoint.save(f"{root}/after-{case}", model, opt, step=0)
        after = model_state(model), opt.memory_bytes(), dict(opt.param_steps)
        out[case] = {"error": error, "before": before, "after": after}
    return out


def test_failed_load_names_the_problem_and_changes_nothing(tmp_path):
    root = tmp_path / "ckpt"
    results = run_distributed(failed_load_rank, 2, str(root), tmp_path=tmp_path)
    for case, (_, needle) in MISMATCHES.items():
        for rank, r in enumerate(results):
            error = r[case]["error"]
            assert error is not None, f"{case}: load did not fail on rank {rank}"
            assert needle in error and "dp rank" in error, f"{case}: {error}"
            before, after = r[case]["before"], r[case]["after"]
            assert_tensors_equal(after[0], before[0], f"{case} params")
            assert after[1:] == before[1:], case
        assert_tensors_equal(exported(root / f"after-{case}", tmp_path / f"a-{case}"),
                             exported(root / f"before-{case}", tmp_path / f"b-{case}"), case)


# --------------------------------------------------- latest, retention, save errors

def test_latest_and_retention(tmp_path):
    root = tmp_path / "ckpt"
    assert checkpoint.latest(root) is None
    model, opt = build(0)
    for step in range(1, 6):
        train(model, opt, range(step - 1, step), 0, 1)
        checkpoint.save(root, model, opt, step=step, keep_last=2)
    def listing() -> list[str]:
        return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))

    assert listing() == ["latest", "step_00000004", "step_00000005"]
    newest = str(root / "step_00000005")
    assert checkpoint.latest(root) == newest

    # Leftovers of unfinished saves are never "latest", even if they hold a manifest.
    tmp = root / ".tmp-step_00000009-0123456789ab"
    shutil.copytree(root / "step_00000005", tmp)
    (root / "step_00000008").mkdir()
    (root / "step_00000007").mkdir()
    (root / "step_00000007" / "model-00000.safetensors").write_bytes(b"\0" * 16)
    assert checkpoint.latest(root) == newest
    (root / "latest").write_text("step_00000008\n")  # marker naming an incomplete directory
    assert checkpoint.latest(root) == newest
    (root / "latest").unlink()
    assert checkpoint.latest(root) == newest
    (root / "latest").write_text("step_00000004\n")  # a complete checkpoint: followed
    assert checkpoint.latest(root) == str(root / "step_00000004")
    (root / "latest").write_text("step_00000005\n")

    fresh, fresh_opt = build(3)
    assert checkpoint.load(root, fresh, fresh_opt).step == 5
    assert_tensors_equal(model_state(fresh), model_state(model))

    # Saving over an incomplete step directory, or with non-JSON extra, fails and writes
    # nothing.
    before = listing()
    with pytest.raises(CheckpointError, match="step_00000008 exists and is not a committed"):
        checkpoint.save(root, model, opt, step=8)
    with pytest.raises(CheckpointError, match="JSON"):
        checkpoint.save(root, model, opt, step=6, extra={"bad": object()})
    assert listing() == before
    assert checkpoint.latest(root) == newest
    with pytest.raises(CheckpointError):
        checkpoint.load(tmp_path / "nowhere", model, opt)


def test_extra_whose_json_would_change_its_keys_is_refused(tmp_path):
    """JSON keys are strings: ``{0: 5}`` would resume as ``{"0": 5}``, so a lookup by the
    int finds nothing (or a ``.get`` default) without an error. Refused, naming where."""
    model, opt = build(0)
    with pytest.raises(CheckpointError, match=r"extra\['data'\]\['pos'\].*key 0 \(int\)"):
        checkpoint.save(tmp_path, model, opt, step=1, extra={"data": {"pos": {0: 5}}})
    assert checkpoint.latest(tmp_path) is None
    checkpoint.save(tmp_path, model, opt, step=1, extra={"data": {"pos": {"0": 5}}, "t": (1, 2)})
