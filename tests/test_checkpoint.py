"""Checkpoints: bitwise resume, the on-disk format, export, errors, ``latest``.

Multi-rank scenarios run through ``_dist.run_distributed``; each spawn checks as
much as it can (save, continue, load, save again) and returns tensors, and the
parent compares them. The training model mixes bf16 and fp32 params (fp32 norm
and router registered between bf16 matmuls), has a frozen param and a 0-d
buffer, and uses tiny buckets so params are split across ranks.

``test_reshard.py`` reuses the model and helpers defined here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from _dist import device_for, require_world_size, run_distributed
from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint
from shardopt.checkpoint import CheckpointError, FormatError

VOCAB, DIM, HIDDEN, SEQ, EXPERTS = 29, 10, 14, 6, 3
GLOBAL_BATCH = 12  # every DP size tested (1..4) divides it
NUM_STEPS = 6
STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")
DOC = Path(__file__).resolve().parents[1] / "docs" / "format.md"


# ---------------------------------------------------------------- model, data

def _apply(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x.to(module.weight.dtype))


class MixedLM(nn.Module):
    """A tiny LM: bf16 matmuls with fp32 params (norm, router) registered between them.

    ``fp32`` names the modules kept in fp32 (the rest are bf16), so a test can
    change a param's dtype between save and load. The frozen ``pos`` and the
    0-d ``temperature`` buffer depend on the seed, so a load must restore them.
    """

    def __init__(self, *, tied: bool = False, dropout: float = 0.0,
                 fp32: tuple[str, ...] = ("norm", "router"), experts: int = EXPERTS,
                 down_bias: bool = True, extra_layer: bool = False) -> None:
        super().__init__()

        def dt(name: str) -> torch.dtype:
            return torch.float32 if name in fp32 else torch.bfloat16

        self.emb = nn.Embedding(VOCAB, DIM).to(dt("emb"))
        self.pos = nn.Parameter(0.1 * torch.randn(SEQ, DIM).to(dt("emb")), requires_grad=False)
        self.up = nn.Linear(DIM, HIDDEN).to(dt("up"))
        self.norm = nn.LayerNorm(HIDDEN).to(dt("norm"))
        self.router = nn.Linear(HIDDEN, experts).to(dt("router"))
        self.down = nn.Linear(HIDDEN, DIM, bias=down_bias).to(dt("down"))
        self.extra = nn.Linear(DIM, DIM).to(dt("extra")) if extra_layer else None
        self.head = nn.Linear(DIM, VOCAB, bias=False).to(dt("head"))
        if tied:
            self.head.weight = self.emb.weight
        self.drop = nn.Dropout(dropout)
        self.register_buffer("temperature", 1.0 + torch.rand(()))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos[: tokens.shape[1]]
        x = F.gelu(_apply(self.up, h))
        n = self.norm(x.to(self.norm.weight.dtype)).float()
        gate = torch.softmax(_apply(self.router, n).float() / self.temperature, dim=-1)
        x = _apply(self.down, self.drop(n)) * gate[..., :1].to(self.down.weight.dtype)
        if self.extra is not None:
            x = x + _apply(self.extra, x)
        logits = _apply(self.head, h + x.to(h.dtype))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def param_groups(fqn: str, param: nn.Parameter) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if fqn.endswith(".bias") or fqn.startswith("norm."):
        out["weight_decay"] = 0.0
    if fqn.startswith("router."):
        out["lr"] = 5e-3
    return out


def make_config(**overrides: Any) -> OptimizerConfig:
    # Tiny buckets: the big params get buckets of their own and split across ranks.
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0,
              bucket_numel=97, align_numel=4)
    kw.update(overrides)
    return OptimizerConfig(**kw)


def build(seed: int, device: torch.device | str = "cpu",
          **model_kwargs: Any) -> tuple[MixedLM, DistributedOptimizer]:
    torch.manual_seed(seed)
    model = MixedLM(**model_kwargs).to(device)
    return model, DistributedOptimizer(model, make_config(), param_group_fn=param_groups)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    return (torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=g))


def train(model: nn.Module, opt: DistributedOptimizer, steps: range, rank: int,
          world_size: int, scheduler: Any = None) -> list[float]:
    """Each rank takes its slice of the deterministic global batch of every step."""
    per = GLOBAL_BATCH // world_size
    device = next(model.parameters()).device
    losses = []
    for step in steps:
        tokens, targets = global_batch(step)
        mine = slice(rank * per, (rank + 1) * per)
        loss = model(tokens[mine].to(device), targets[mine].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def live_optimizer_state(opt: DistributedOptimizer) -> list[tuple[str, int, int, dict]]:
    """This rank's shards of every state tensor: ``(fqn, start, end, {name: tensor})``."""
    return [(s.fqn, s.range_param.start, s.range_param.end,
             {n: opt.state_view(n, s).detach().cpu().clone() for n in STATE_NAMES})
            for s in opt.shards]


# ------------------------------------------------------------ comparison helpers

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


def assert_tensors_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                         what: str = "") -> None:
    assert sorted(actual) == sorted(expected), what
    for k in expected:
        a, e = actual[k], expected[k]
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what} {k}: {a.dtype}{list(a.shape)}"
        assert torch.equal(a, e), f"{what} {k}: max diff {(a.double() - e.double()).abs().max()}"


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
    reference = snapshot(model)

    # The same run, saved at step 3; saving must not disturb it.
    model, opt = build(0, device, tied=tied, dropout=0.1)
    torch.manual_seed(1000 + rank)
    train(model, opt, range(3), rank, world_size)
    checkpoint.save(f"{root}/interrupted", model, opt, step=3, extra={"data_step": 3, "tag": "x"})
    train(model, opt, range(3, NUM_STEPS), rank, world_size)
    return {"reference": reference, "saved_and_continued": snapshot(model)}


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
    return {"params": snapshot(model), "info": info, "fresh_bytes": fresh_bytes,
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
    return {"params": snapshot(model), "lrs": [g["lr"] for g in opt.param_groups]}


def test_resume_with_lr_scheduler_state_in_extra(tmp_path):
    root = str(tmp_path / "ckpt")
    ref = run_distributed(scheduler_resume_rank, 2, root, False, tmp_path=tmp_path)
    res = run_distributed(scheduler_resume_rank, 2, root, True, tmp_path=tmp_path)
    for a, b in zip(res, ref):
        assert a["lrs"] == b["lrs"]
        assert_tensors_equal(a["params"], b["params"])


# ------------------------------------------- one checkpoint at 3 ranks, many checks

@dataclass(frozen=True)
class Saved:
    root: Path
    path: Path
    params: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]  # "{fqn}.{name}" -> full fp32 tensor, assembled from ranks
    shapes: dict[str, torch.Size]


def save_three_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, opt = build(0)
    train(model, opt, range(2), rank, world_size)
    # Small hash blocks, so files span several blocks.
    checkpoint.save(root, model, opt, step=2, extra={"data": [1, 2]},
                    config=checkpoint.CheckpointConfig(block_bytes=512))
    return {"params": snapshot(model), "state": live_optimizer_state(opt),
            "shapes": {fqn: p.shape for fqn, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def saved3(tmp_path_factory) -> Saved:
    base = tmp_path_factory.mktemp("saved3")
    root = base / "ckpt"
    results = run_distributed(save_three_rank, 3, str(root), tmp_path=base / "runs")
    shapes = results[0]["shapes"]
    state: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    for r in results:
        for fqn, start, end, tensors in r["state"]:
            numel = shapes[fqn].numel()
            for name, t in tensors.items():
                full = state.setdefault(f"{fqn}.{name}", torch.full((numel,), float("nan")))
                full[start:end] = t
            covered[fqn] = covered.get(fqn, 0) + end - start
    assert covered == {fqn: s.numel() for fqn, s in shapes.items() if fqn != "pos"}
    state = {k: v.view(shapes[k.rsplit(".", 1)[0]]) for k, v in state.items()}
    return Saved(root, root / "step_00000002", results[0]["params"], state, shapes)


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
    assert m["format"] == "shardopt" and m["version"] == 3
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
    assert (info["step"], info["dp_size"], info["format_version"]) == (2, 3, 3)
    assert info["extra"] == {"data": [1, 2]}
    rows = {r["fqn"]: r for r in info["params"]}
    assert set(rows) == set(saved3.params)
    assert rows["up.weight"]["shape"] == [HIDDEN, DIM] and rows["up.weight"]["dtype"] == "bfloat16"
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
        before = snapshot(model), opt.memory_bytes(), dict(opt.param_steps)
        checkpoint.save(f"{root}/before-{case}", model, opt, step=0)
        try:
            checkpoint.load(source, model, opt)
            error = None
        except CheckpointError as e:
            error = str(e)
        checkpoint.save(f"{root}/after-{case}", model, opt, step=0)
        after = snapshot(model), opt.memory_bytes(), dict(opt.param_steps)
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
    assert_tensors_equal(snapshot(fresh), snapshot(model))

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
