"""Checkpoints of Adam moments stored in bf16 or blockwise int8: stored as they are kept
(codes and scales by FQN), resumed bitwise, resharded without re-quantising, converted
explicitly into an optimizer configured otherwise, and as well guarded as fp32 state."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.dist import run_distributed
from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint
from shardopt.checkpoint.format import StoredTensor
from shardopt.checkpoint.manifest import parse
from shardopt.quant import QBLOCK, Moment

BF16, FP32, INT8 = torch.bfloat16, torch.float32, "int8"
MOMENTS = ("exp_avg", "exp_avg_sq")


class Net(nn.Module):
    """Params whose sizes are not multiples of the 64-element block, so blocks end ragged."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(24, 37)
        self.b = nn.Linear(37, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def make(m: Any = FP32, v: Any = FP32, device: str = "cpu", **kw: Any
         ) -> tuple[Net, DistributedOptimizer]:
    torch.manual_seed(0)
    model = Net().to(device)
    cfg = OptimizerConfig(lr=3e-2, exp_avg_dtype=m, exp_avg_sq_dtype=v, bucket_numel=700,
                          step_kernel="torch", **kw)
    return model, DistributedOptimizer(model, cfg)


def train(model: Net, opt: DistributedOptimizer, first: int, last: int) -> None:
    for i in range(first, last):
        g = torch.Generator().manual_seed(1000 + i)
        x, y = torch.randn(8, 24, generator=g), torch.randn(8, 5, generator=g)
        x, y = x.to(opt.shard_state.device), y.to(opt.shard_state.device)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def pieces(opt: DistributedOptimizer) -> dict[str, Any]:
    """This rank's moments by FQN as stored: (start in the param, values, scales)."""
    out: dict[str, Any] = {}
    for s in opt.shard_state.shards:
        for name in MOMENTS:
            m = opt.shard_state.moment(name, s)
            out.setdefault(f"{s.fqn}.{name}", []).append(
                (s.range_param.start, m.values.cpu().clone(),
                 None if m.scales is None else m.scales.cpu().clone()))
    return out


def assemble(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Full per-param values and scales from every rank's :func:`pieces`."""
    full: dict[str, list] = {}
    for rank in ranks:
        for key, parts in rank.items():
            full.setdefault(key, []).extend(parts)
    out = {}
    for key, parts in full.items():
        parts.sort(key=lambda p: p[0])
        out[key] = torch.cat([p[1] for p in parts])
        if parts[0][2] is not None:
            out[key + ".scale"] = torch.cat([p[2] for p in parts])
    return out


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,v", [(BF16, BF16), (INT8, INT8), (INT8, BF16)])
def test_resume_is_bitwise_at_the_same_dp_size(m, v, device, tmp_path):
    model, opt = make(m, v, device)
    train(model, opt, 0, 3)
    path = checkpoint.save(tmp_path, model, opt, step=3)
    saved = assemble([pieces(opt)])
    train(model, opt, 3, 6)
    model2, opt2 = make(m, v, device)
    checkpoint.load(path, model2, opt2)
    assert_equal(assemble([pieces(opt2)]), saved)
    train(model2, opt2, 3, 6)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_manifest_records_each_moments_encoding(tmp_path):
    model, opt = make(INT8, BF16)
    train(model, opt, 0, 1)
    m = parse(Path(checkpoint.save(tmp_path, model, opt, step=1)))
    assert m.moments["exp_avg"].to_json() == {"dtype": "int8", "block": QBLOCK,
                                              "map": "linear", "code_max": 127}
    assert m.moments["exp_avg_sq"].to_json() == {"dtype": "bfloat16"}
    stored = m.stored()
    assert stored["a.weight.exp_avg"] == StoredTensor(24 * 37, torch.int8)
    assert stored["a.weight.exp_avg.scale"] == StoredTensor(-(-24 * 37 // QBLOCK), FP32)
    assert stored["a.weight.exp_avg_sq"] == StoredTensor(24 * 37, BF16)
    assert "a.weight.exp_avg_sq.scale" not in stored
    info = checkpoint.inspect(m.path)
    assert info["moments"] == {k: e.to_json() for k, e in m.moments.items()}


@pytest.mark.parametrize("name", ["exp_avg", "exp_avg_sq"])
def test_decoding_a_stored_piece_at_any_offset_is_the_moments_own_fp32(name):
    # A piece starts where a shard of the loading optimizer starts: with fp32 or bf16 moments
    # its layout does not align params, so anywhere inside a block.
    from shardopt.checkpoint.manifest import MomentEncoding
    numel = 5 * QBLOCK
    moment = Moment(INT8, numel, torch.device("cpu"), sqrt=name == "exp_avg_sq")
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3
    moment.store_(x.square() if moment.sqrt else x)
    want, codes = moment.to_fp32(), moment.values.clone()
    enc = MomentEncoding.of(INT8, name)
    for start, n in [(0, numel), (3, 10), (5, QBLOCK), (QBLOCK - 1, 2 * QBLOCK + 3),
                     (QBLOCK, QBLOCK), (130, 0), (17, numel - 17), (2 * QBLOCK + 1, QBLOCK - 1)]:
        got = enc.decode(moment.values[start:start + n], moment.scales[start // QBLOCK:], start)
        assert torch.equal(got.view(torch.int32), want[start:start + n].view(torch.int32)), start
    assert torch.equal(moment.values, codes)  # decoding leaves the stored codes alone


def _edit_manifest(path: Path, edit) -> None:
    from shardopt.checkpoint.format import manifest_checksum
    file = path / "manifest.json"
    data = json.loads(file.read_text())
    edit(data)
    data["checksum"] = manifest_checksum(data)
    file.write_text(json.dumps(data))


@pytest.mark.parametrize("bad", [{"dtype": "int8", "block": 128, "map": "linear", "code_max": 127},
                                 {"dtype": "uint8", "block": 64, "map": "linear", "code_max": 255},
                                 {"dtype": "float16"}, "int8"])
def test_manifest_refuses_an_unknown_moment_encoding(bad, tmp_path):
    model, opt = make(INT8, INT8)
    path = Path(checkpoint.save(tmp_path, model, opt, step=0))
    _edit_manifest(path, lambda d: d["optimizer"]["moments"].update(exp_avg=bad))
    with pytest.raises(checkpoint.FormatError, match="manifest.json.*encoding of exp_avg"):
        parse(path)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(checkpoint.CheckpointError, match="encoding of exp_avg"):
        checkpoint.load(path, model, opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_manifest_without_moment_encodings_means_fp32(tmp_path):
    model, opt = make()
    train(model, opt, 0, 2)
    path = Path(checkpoint.save(tmp_path, model, opt, step=2))
    _edit_manifest(path, lambda d: d["optimizer"].pop("moments"))
    model2, opt2 = make()
    checkpoint.load(path, model2, opt2)
    assert_equal(assemble([pieces(opt2)]), assemble([pieces(opt)]))


def _reference(values: torch.Tensor, scales: torch.Tensor | None, kind: Any, sqrt: bool
               ) -> dict[str, torch.Tensor]:
    """A param's stored moment decoded to fp32 and stored as ``kind`` (blocks of the param)."""
    src = Moment.wrap(INT8 if scales is not None else values.dtype, values, scales, sqrt)
    n = values.numel()
    pad = -(-n // QBLOCK) * QBLOCK
    if scales is not None:
        src = Moment.wrap(INT8, torch.cat([values, values.new_zeros(pad - n)]),
                          scales, sqrt)
    wide = src.to_fp32()[:n]
    out = Moment(kind, pad if kind == INT8 else n, torch.device("cpu"), sqrt=sqrt)
    out.store_(torch.cat([wide, wide.new_zeros(out.values.numel() - n)]))
    res = {"v": out.values[:n]}
    if out.scales is not None:
        res["s"] = out.scales
    return res


@pytest.mark.parametrize("src,dst,into", [
    ((FP32, FP32), (BF16, BF16), "new"), ((INT8, INT8), (FP32, FP32), "new"),
    ((BF16, BF16), (INT8, INT8), "new"), ((INT8, BF16), (BF16, INT8), "new"),
    ((INT8, INT8), (BF16, FP32), "stepped"), ((BF16, FP32), (INT8, INT8), "low_memory")])
def test_load_converts_to_the_optimizers_format_and_says_so(src, dst, into, tmp_path, caplog):
    """Into a new optimizer, one whose moments exist (converted in place) and a
    low_memory_resume (converted on the host)."""
    model, opt = make(*src)
    train(model, opt, 0, 3)
    path = checkpoint.save(tmp_path, model, opt, step=3)
    saved = assemble([pieces(opt)])
    model2, opt2 = make(*dst)
    if into == "stepped":
        train(model2, opt2, 5, 6)
    with caplog.at_level(logging.INFO, logger="shardopt.checkpoint"):
        checkpoint.load(path, model2, opt2, low_memory_resume=into == "low_memory")
    assert (opt2.shard_state.held["exp_avg.0"].where == "staged") == (into == "low_memory")
    lines = [r for r in caplog.records if "converting Adam moments" in r.getMessage()]
    assert len(lines) == 1 and lines[0].name == "shardopt.checkpoint"
    got = assemble([pieces(opt2)])
    for key in [k for k in saved if not k.endswith(".scale")]:
        name = key.rsplit(".", 1)[1]
        kind = dst[MOMENTS.index(name)]
        assert (f"{name} " in lines[0].getMessage()) == (src != dst and
                                                          kind != src[MOMENTS.index(name)])
        want = _reference(saved[key], saved.get(key + ".scale"), kind, name == "exp_avg_sq")
        assert torch.equal(got[key], want["v"]), key
        if "s" in want:
            assert torch.equal(got[key + ".scale"], want["s"]), key
    train(model2, opt2, 3, 4)  # and it trains on


@pytest.mark.parametrize("device", DEVICES)
def test_low_memory_resume_with_int8_moments(device, tmp_path):
    model, opt = make(INT8, INT8, device)
    train(model, opt, 0, 3)
    path = checkpoint.save(tmp_path, model, opt, step=3)
    train(model, opt, 3, 5)
    model2, opt2 = make(INT8, INT8, device)
    checkpoint.load(path, model2, opt2, low_memory_resume=True)
    assert opt2.shard_state.held["exp_avg.0"].where == "staged"  # on the host until step()
    train(model2, opt2, 3, 5)
    moments = [h for h in opt2.shard_state.held.values() if h.kind == "moments"]
    assert all(h.where == "device" and h.tensor.device == opt2.shard_state.device
               for h in moments)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def _chunk_bytes(file: Path, key: str) -> tuple[int, int]:
    """Byte range of tensor ``key`` in safetensors ``file``."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    start, end = json.loads(raw[8:8 + n])[key]["data_offsets"]
    return 8 + n + start, 8 + n + end


def test_verify_and_load_detect_damage_in_the_scales(tmp_path):
    model, opt = make(INT8, INT8)
    train(model, opt, 0, 2)
    path = Path(checkpoint.save(tmp_path, model, opt, step=2))
    hits = [f for f in path.glob("exp_avg_sq-*.safetensors")
            if b"a.weight.exp_avg_sq.scale" in f.read_bytes()[:4096]]
    assert len(hits) == 1
    start, _ = _chunk_bytes(hits[0], "a.weight.exp_avg_sq.scale")
    data = bytearray(hits[0].read_bytes())
    data[start + 5] ^= 0x10
    hits[0].write_bytes(bytes(data))
    with pytest.raises(checkpoint.FormatError, match=hits[0].name):
        checkpoint.verify(path)
    model2, opt2 = make(INT8, INT8)
    with pytest.raises(checkpoint.CheckpointError, match=hits[0].name):
        checkpoint.load(path, model2, opt2, config=checkpoint.CheckpointConfig(verify=True))
    assert not opt2.shard_state.has_moments  # the failed load left the optimizer as it was


def _save_rank(rank: int, world_size: int, root: str, kinds: tuple) -> dict[str, Any]:
    model, opt = make(*kinds)
    train(model, opt, 0, 3)
    checkpoint.save(root, model, opt, step=3)
    return pieces(opt)


def _load_rank(rank: int, world_size: int, root: str, kinds: tuple) -> dict[str, Any]:
    model, opt = make(*kinds)
    checkpoint.load(checkpoint.latest(root), model, opt)
    out = pieces(opt)
    checkpoint.save(root + f"-again{world_size}", model, opt, step=3)
    return out


@pytest.mark.parametrize("kinds", [(INT8, INT8), (BF16, INT8)])
def test_reshards_without_requantising(kinds, tmp_path):
    """2 -> 3 -> 1: every rank's codes and scales are pieces of the saved ones, bit for bit."""
    root = str(tmp_path / "ck")
    saved = assemble(run_distributed(_save_rank, 2, root, kinds, tmp_path=tmp_path / "s"))
    at3 = assemble(run_distributed(_load_rank, 3, root, kinds, tmp_path=tmp_path / "l"))
    assert_equal(at3, saved)
    at1 = assemble([_load_rank(0, 1, root + "-again3", kinds)])
    assert_equal(at1, saved)


@pytest.mark.parametrize("device", DEVICES)
def test_offload_round_trips_lowprec_moments_bit_for_bit(device, tmp_path):
    model, opt = make(INT8, BF16, device)
    train(model, opt, 0, 2)
    before = assemble([pieces(opt)])
    opt.offload()
    assert_equal(assemble([pieces(opt)]), before)  # the host copies
    path = checkpoint.save(tmp_path, model, opt, step=2)  # saved from the host copies
    opt.onload()
    assert_equal(assemble([pieces(opt)]), before)
    train(model, opt, 2, 4)
    model2, opt2 = make(INT8, BF16, device)
    checkpoint.load(path, model2, opt2)
    train(model2, opt2, 2, 4)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_export_writes_fp32_moments_by_default_or_as_stored(tmp_path, capsys):
    from safetensors.torch import load_file

    from shardopt import cli

    model, opt = make(INT8, BF16)
    train(model, opt, 0, 2)
    path = checkpoint.save(tmp_path / "ck", model, opt, step=2)
    saved = assemble([pieces(opt)])
    wide = load_file(checkpoint.export(path, tmp_path / "wide")[-1])
    assert cli.main(["export", path, str(tmp_path / "stored"), "--moments-dtype", "stored"]) == 0
    stored = load_file(str(tmp_path / "stored" / "optimizer.safetensors"))
    for fqn, p in model.named_parameters():
        m, v = f"{fqn}.exp_avg", f"{fqn}.exp_avg_sq"
        pad = -(-p.numel() // QBLOCK) * QBLOCK
        codes = Moment.wrap(INT8, torch.cat([saved[m], saved[m].new_zeros(pad - p.numel())]),
                            saved[m + ".scale"])
        assert wide[m].dtype == wide[v].dtype == FP32 and wide[m].shape == p.shape
        assert torch.equal(wide[m].view(-1), codes.to_fp32()[:p.numel()])
        assert torch.equal(wide[v].view(-1), saved[v].float())
        assert torch.equal(stored[m].view(-1), saved[m]) and stored[m].shape == p.shape
        assert torch.equal(stored[m + ".scale"], saved[m + ".scale"])
        assert torch.equal(stored[v].view(-1), saved[v]) and v + ".scale" not in stored
    with pytest.raises(ValueError, match="moments_dtype"):
        checkpoint.export(path, tmp_path / "x", moments_dtype="bfloat16")
    assert cli.main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "exp_avg int8 (int8 codes of x, fp32 scale per 64), exp_avg_sq bfloat16" in out


@pytest.mark.parametrize("m,v", [(INT8, BF16), (BF16, INT8)])
def test_state_dict_holds_moments_as_stored_and_resumes_bitwise(m, v):
    from shardopt.flat_shard import FlatShard
    from shardopt.state_dict import StateDictError

    model, opt = make(m, v)
    fresh = opt.state_dict()  # before the first step: zeros in the stored dtypes
    entry = fresh["state"]["a.weight"]
    assert entry["exp_avg"].dtype == (torch.int8 if m == INT8 else BF16)
    assert ("exp_avg.scale" in entry) == (m == INT8) and ("exp_avg_sq.scale" in entry) == (v == INT8)
    train(model, opt, 0, 3)
    sd = opt.state_dict()
    entry = sd["state"]["a.weight"]
    scaled = "exp_avg.scale" if m == INT8 else "exp_avg_sq.scale"
    assert entry[scaled].dtype == FP32 and entry[scaled].shape[0] == -(-24 * 37 // QBLOCK)
    saved = {f: {k: t.local.clone() for k, t in e.items() if hasattr(t, "local")}
             for f, e in sd["state"].items()}
    state = opt.state[model.a.weight]
    assert torch.equal(state[scaled], entry[scaled].local)
    weights = {k: t.clone() for k, t in model.state_dict().items()}
    copy = {"state": {f: {**e, **{k: FlatShard(saved[f][k], e[k].offset, e[k].shape[0])
                                   for k in saved[f]}} for f, e in sd["state"].items()},
            "param_groups": sd["param_groups"]}
    train(model, opt, 3, 5)
    model2, opt2 = make(m, v)
    opt2.load_state_dict(copy)
    model2.load_state_dict(weights)
    train(model2, opt2, 3, 5)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    other = make(FP32, FP32)[1]
    with pytest.raises(StateDictError, match="exp_avg.*this optimizer keeps"):
        other.load_state_dict(copy)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("src,dst,into", [
    ((INT8, INT8), (FP32, FP32), "fresh"), ((INT8, BF16), (BF16, BF16), "stepped"),
    ((BF16, BF16), (FP32, BF16), "stepped")])
def test_dcp_load_across_moment_dtypes_refuses_codes_read_as_values(src, dst, into, tmp_path,
                                                                     caplog):
    """torch.distributed.checkpoint casts whatever is stored into the state dict's tensors:
    8-bit codes land in fp32 or bf16 moments as if they were values. The state dict records
    each moment's dtype, so load_state_dict refuses that, naming the param; a cast between
    float dtypes is the conversion checkpoint.load makes, and it says so."""
    import torch.distributed.checkpoint as dcp

    from shardopt.state_dict import StateDictError

    model, opt = make(*src)
    train(model, opt, 0, 3)
    saved = assemble([pieces(opt)])
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=tmp_path / "dcp")
    model2, opt2 = make(*dst)
    if into == "stepped":
        train(model2, opt2, 5, 6)
    sd = {"optim": opt2.state_dict()}
    dcp.load(sd, checkpoint_id=tmp_path / "dcp")
    if INT8 not in src:
        with caplog.at_level(logging.INFO, logger="shardopt"):
            opt2.load_state_dict(sd["optim"])
        assert any("exp_avg bfloat16 -> float32" in r.getMessage() for r in caplog.records)
        got = assemble([pieces(opt2)])
        for key, want in saved.items():
            assert torch.equal(got[key], want.to(got[key].dtype)), key
        return
    steps = dict(opt2.param_steps)
    with pytest.raises(StateDictError, match=r"param 'a.weight'.*exp_avg.*int8"):
        opt2.load_state_dict(sd["optim"])
    assert opt2.param_steps == steps
