"""Fault injection for checkpoints: crashes, damage, hostile files, failed saves and loads.

What each test shows is listed in docs/reliability.md. Process kills use
SIGKILL on real saving processes; disk-full and permission errors are
simulated by patching ``os`` functions inside the ranks (file permissions
would not stop a test run as root).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers.dist import run_distributed
from faults import ranks
from faults.common import (Net, check_root, check_state, data_offset, differences, edit_manifest,
                           flip_byte, header_length, read_json, rehash_file, snapshot, trained,
                           write_manifest)
from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint
from shardopt.checkpoint.format import FormatError

FILES = ("model-00000.safetensors", "optim-00000.safetensors", "exp_avg-00000.safetensors",
         "exp_avg_sq-00000.safetensors", "rng-00000.safetensors")


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A committed single-process checkpoint of ``trained(1)``."""
    model, opt = trained(1)
    return Path(checkpoint.save(tmp_path / "root", model, opt, step=1, extra={"pos": 5}))


def _assert_refused(path: Path, needle: str) -> None:
    """``verify`` and ``load`` both fail, naming ``needle``; the model is left untouched."""
    with pytest.raises(ValueError, match=needle):
        checkpoint.verify(path)
    model, opt = trained(2)
    before = snapshot(model, opt)
    with pytest.raises(checkpoint.CheckpointError, match=needle):
        checkpoint.load(path, model, opt)
    assert differences(before, snapshot(model, opt)) == []


# ------------------------------------------------------------------------ integrity
def test_roundtrip_baseline(saved: Path) -> None:
    assert checkpoint.verify(saved)["files"] == len(FILES)
    model, opt = trained(2)
    info = checkpoint.load(saved.parent, model, opt)
    assert (info.step, info.extra) == (1, {"pos": 5})
    check_state(str(saved), 1)


@pytest.mark.parametrize("version", [1, 2, 5, "3", "4"])
def test_other_format_versions_are_refused(saved: Path, version) -> None:
    """One format (version 4, which reads the data-parallel version 3 too): a manifest of
    any other version (even with a valid checksum) is refused by name, with the versions read."""
    edit_manifest(saved, lambda m: m.__setitem__("version", version))
    _assert_refused(saved, rf"manifest.json: format version {version!r}; this shardopt reads "
                           "versions 3, 4")


def _damage(path: Path, name: str, how: str) -> None:
    file = path / name
    if how == "flip-header":
        flip_byte(file, header_length(file) // 2)
    elif how == "flip-data":  # a byte that a single-process load reads
        kind = name.split("-")[0]
        key = {"model": "scale", "optim": "out.bias.master_param", "exp_avg": "out.bias.exp_avg",
               "exp_avg_sq": "out.bias.exp_avg_sq", "rng": "torch_cpu"}[kind]
        flip_byte(file, data_offset(file, key) + 1)
    elif how == "truncate":
        os.truncate(file, os.path.getsize(file) - 1)
    elif how == "extend":
        with open(file, "ab") as f:
            f.write(b"\0")
    elif how == "missing":
        os.unlink(file)


@pytest.mark.parametrize("how", ["flip-header", "flip-data", "truncate", "extend", "missing"])
@pytest.mark.parametrize("name", FILES)
def test_damaged_data_file_is_detected_and_named(saved: Path, name: str, how: str) -> None:
    _damage(saved, name, how)
    _assert_refused(saved, name)


def test_what_load_verifies_is_what_it_reads(tmp_path: Path) -> None:
    """``load`` hash-checks every block it reads. It does not read the model-dtype copy of a
    trainable param (the weights are rebuilt from the fp32 main params), so damage there is
    reported by ``verify`` and cannot reach the loaded state; damage to the main param it
    reads is refused by both."""
    saved = Path(checkpoint.save(tmp_path / "root", *trained(1), step=1,
                                 config=checkpoint.CheckpointConfig(block_bytes=64)))
    model_file = saved / "model-00000.safetensors"
    flip_byte(model_file, data_offset(model_file, "hidden.weight") + 200)  # a block of its own
    with pytest.raises(FormatError, match="model-00000.safetensors: content hash mismatch"):
        checkpoint.verify(saved)
    check_state(str(saved), 1)  # bit-exact: the damaged bytes were never used
    flip_byte(model_file, data_offset(model_file, "hidden.weight") + 200)  # repaired
    checkpoint.verify(saved)
    optim_file = saved / "optim-00000.safetensors"
    flip_byte(optim_file, data_offset(optim_file, "hidden.weight.master_param") + 1)
    _assert_refused(saved, "optim-00000.safetensors: content hash mismatch")


def test_verify_false_skips_hashes_but_verify_catches_it(saved: Path) -> None:
    _damage(saved, "optim-00000.safetensors", "flip-data")
    model, opt = trained(2)
    checkpoint.load(saved, model, opt,
                    config=checkpoint.CheckpointConfig(verify=False))  # what the caller asked for
    _assert_refused(saved, "optim-00000.safetensors")


@pytest.mark.parametrize("how", ["flip-step", "flip-hash", "truncate", "missing", "garbage",
                                 "deep"])
def test_damaged_manifest_is_detected(saved: Path, how: str) -> None:
    file = saved / "manifest.json"
    text = file.read_text()
    if how == "flip-step":
        i = text.index('"step": 1') + len('"step": ')
        file.write_text(text[:i] + "3" + text[i + 1:])
    elif how == "flip-hash":
        i = text.index('"', text.index('"hashes": [') + len('"hashes": [')) + 1
        file.write_text(text[:i] + ("0" if text[i] != "0" else "1") + text[i + 1:])
    elif how == "truncate":
        file.write_text(text[: len(text) // 2])
    elif how == "missing":
        file.unlink()
    elif how == "deep":
        file.write_text('{"format": ' + "[" * 100_000 + "]" * 100_000 + "}")
    else:
        file.write_bytes(os.urandom(300))
    if how == "missing":
        with pytest.raises(ValueError, match="manifest.json"):
            checkpoint.verify(saved)
        assert checkpoint.latest(saved.parent) is None  # no longer a committed checkpoint
        return
    _assert_refused(saved, "manifest.json")


def test_unknown_file_is_reported_by_verify(saved: Path) -> None:
    (saved / "optimizer.pt").write_bytes(b"not ours")
    with pytest.raises(FormatError, match="optimizer.pt"):
        checkpoint.verify(saved)
    model, opt = trained(2)
    checkpoint.load(saved, model, opt)  # load reads only what the manifest lists


@pytest.fixture(scope="module")
def fuzz_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, opt = trained(1)
    root = tmp_path_factory.mktemp("fuzz")
    return Path(checkpoint.save(root, model, opt, step=1,
                                config=checkpoint.CheckpointConfig(block_bytes=512)))


@given(which=st.integers(0, 3), where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_single_bit_flip_is_detected(fuzz_ckpt: Path, which: int, where: float,
                                         bit: int) -> None:
    """Flip one bit anywhere in any file: verify raises, unless the flip leaves the manifest
    meaning exactly the same (e.g. ``1e-08`` -> ``1E-08``)."""
    file = fuzz_ckpt / (FILES + ("manifest.json",))[which]
    original = file.read_bytes()
    pos = int(where * len(original))
    damaged = bytearray(original)
    damaged[pos] ^= 1 << bit
    file.write_bytes(bytes(damaged))
    try:
        checkpoint.verify(fuzz_ckpt)
        assert file.name == "manifest.json"
        assert json.loads(bytes(damaged)) == json.loads(original)
    except (ValueError, UnicodeDecodeError) as e:
        assert isinstance(e, ValueError), e  # always one of our errors
    finally:
        file.write_bytes(original)


# -------------------------------------------------------------------- hostile input
@pytest.mark.parametrize("bad_name", ["../model-00000.safetensors", "/etc/passwd",
                                      "sub/model-00000.safetensors", "model-00000.safetensors\n",
                                      "model-00001.safetensors", "model-0000.safetensors"])
def test_manifest_cannot_name_files_outside_the_checkpoint(saved: Path, bad_name: str) -> None:
    def rename(m: dict) -> None:
        m["files"][bad_name] = m["files"].pop("model-00000.safetensors")

    edit_manifest(saved, rename)
    _assert_refused(saved, "refusing data file name|belongs to no rank")


def test_symlinks_and_special_files_are_refused(saved: Path, tmp_path: Path) -> None:
    name = "optim-00000.safetensors"
    outside = tmp_path / "outside.safetensors"
    shutil.move(saved / name, outside)
    (saved / name).symlink_to(outside)  # identical bytes: only the link itself is wrong
    _assert_refused(saved, "symlink")

    (saved / name).unlink()
    os.mkfifo(saved / name)  # opening a FIFO for reading would block forever

    def blocked(signum, frame):
        raise TimeoutError("opening the FIFO blocked")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(20)
    try:
        _assert_refused(saved, "not a regular file")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)

    (saved / name).unlink()
    (saved / name).mkdir()
    _assert_refused(saved, "not a regular file")

    shutil.rmtree(saved / name)
    shutil.move(outside, saved / name)
    manifest_copy = tmp_path / "manifest.json"
    shutil.move(saved / "manifest.json", manifest_copy)
    (saved / "manifest.json").symlink_to(manifest_copy)
    _assert_refused(saved, "symlink")


def test_huge_or_malformed_headers_are_refused_before_allocating(
        saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "optim-00000.safetensors"
    file = saved / name
    real_pread, largest = os.pread, [0]

    def pread(fd: int, n: int, offset: int) -> bytes:
        largest[0] = max(largest[0], n)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", pread)
    body = file.read_bytes()
    cases = {
        "claims 2**60 bytes": (2**60).to_bytes(8, "little") + body[8:],
        "claims 64 KiB (inside the file)": (65536).to_bytes(8, "little") + body[8:] + bytes(65536),
        "nested 5000 deep": (10000).to_bytes(8, "little") + b"[" * 5000 + b"]" * 5000 + body[8:],
        "not JSON": (16).to_bytes(8, "little") + b"\x80\x04\x95pickle!!" + body[24:],
        "shorter than 8 bytes": b"\x01\x02",
    }
    for why, data in cases.items():
        file.write_bytes(data)
        rehash_file(saved, name)  # a consistent forgery: sizes and hashes match
        largest[0] = 0
        _assert_refused(saved, name)
        assert largest[0] < 1 << 20, (why, largest[0])


@pytest.mark.parametrize("edit", [
    "block_bytes", "dp_size", "drop_rng", "size", "hash_format", "dtype", "shape", "nested",
    "step_type", "chunk_past_end"])
def test_inconsistent_manifest_is_refused(saved: Path, edit: str) -> None:
    """Crafted manifests (checksum recomputed, so only validation can stop them)."""
    m = read_json(saved)
    rec = m["files"]["optim-00000.safetensors"]
    if edit == "block_bytes":
        rec["block_bytes"] = 1 << 40
    elif edit == "dp_size":
        m["dp_size"] = 10**12
    elif edit == "drop_rng":
        del m["files"]["rng-00000.safetensors"]
    elif edit == "size":
        rec["size"] = -1
    elif edit == "hash_format":
        rec["hashes"][0] = "../../etc/passwd"
    elif edit == "dtype":
        m["params"]["out.weight"]["dtype"] = "float64"
    elif edit == "shape":
        m["params"]["out.weight"]["shape"] = [3, 17]
    elif edit == "nested":
        m["extra"] = json.loads("[" * 500 + "]" * 500)
    elif edit == "step_type":
        m["step"] = "1; rm -rf /"
    elif edit == "chunk_past_end":
        rec["chunks"][0][2] += 1000
    write_manifest(saved, m)
    with pytest.raises(ValueError):
        checkpoint.verify(saved)
    model, opt = trained(2)
    before = snapshot(model, opt)
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load(saved, model, opt)
    assert differences(before, snapshot(model, opt)) == []


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m["optimizer"].__setitem__("kind", "sgd"), "holds 'sgd' optimizer state"),
    (lambda m: m["optimizer"].__setitem__("state", ["momentum"]), r"\['momentum'\]"),
    (lambda m: m["params"]["out.bias"]["group"].__setitem__("lr", float("nan")),
     "lr=nan of 'out.bias' is malformed"),
    (lambda m: m["params"]["out.bias"]["group"].__setitem__("lr", -0.1),
     "lr=-0.1 of 'out.bias' is malformed"),
    (lambda m: m["params"]["out.bias"]["group"].__setitem__("eps", float("inf")),
     "eps=inf of 'out.bias' is malformed"),
    (lambda m: m["params"]["out.bias"]["group"].__setitem__("betas", [0.9, 1.5]),
     r"betas=\[0.9, 1.5\] of 'out.bias' is malformed"),
    (lambda m: m["params"]["out.bias"].pop("group"), "'out.bias' lacks its hyperparameters"),
    (lambda m: m["params"]["out.weight"].__setitem__("shape", [3, 17]),
     "stored chunks of 'out.weight' cover 48 of 51 elements"),
    (lambda m: m["params"]["out.weight"].__setitem__("shape", [3, 15]),
     "stored chunks of 'out.weight' cover 48 of 45 elements"),
    (lambda m: m["params"].pop("out.bias"),
     r"stores 'out\.bias(\.\w+)?', which no param describes"),
])
def test_verify_applies_the_manifest_checks_of_load(saved: Path, edit, needle: str) -> None:
    """One validation (the manifest parser) for ``load`` and ``verify``: crafted manifests
    with a valid checksum are refused by both, naming the manifest and the field."""
    edit_manifest(saved, edit)
    _assert_refused(saved, f"manifest.json: .*{needle}")


class _Payload:
    """Unpickling this creates ``marker``: evidence that a pickle was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_pickle_payloads_are_never_executed(saved: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Payload(control)))
    assert control.exists()  # the payload is live

    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))
    torch_zip = tmp_path / "zip.pt"
    torch.save({"state": _Payload(marker)}, torch_zip)
    assert not marker.exists()
    for name in FILES + ("manifest.json",):
        for data in (payload, torch_zip.read_bytes()):
            copy = tmp_path / f"ckpt-{name}-{len(data)}"
            shutil.copytree(saved, copy)
            (copy / name).write_bytes(data)
            if name != "manifest.json":
                rehash_file(copy, name)  # even with matching sizes and hashes
            with pytest.raises(ValueError):
                checkpoint.verify(copy)
            for fn in (checkpoint.inspect,  # reads the manifest only
                       lambda p: checkpoint.export(p, tmp_path / "export", verify=False)):
                with contextlib.suppress(ValueError):
                    fn(copy)
            for verify in (True, False):
                model, opt = trained(2)
                with pytest.raises(checkpoint.CheckpointError):
                    checkpoint.load(copy, model, opt,
                                    config=checkpoint.CheckpointConfig(verify=verify))
    assert not marker.exists()

    # And nothing on the read path unpickles at all, even a good checkpoint.
    def forbidden(*args, **kwargs):
        raise AssertionError("pickle used on the checkpoint read path")

    for mod, attr in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"),
                      (torch, "load")):
        monkeypatch.setattr(mod, attr, forbidden)
    model, opt = trained(2)
    checkpoint.load(saved, model, opt)
    checkpoint.verify(saved)
    checkpoint.inspect(saved)
    checkpoint.export(saved, tmp_path / "export-good")


def test_checkpoint_package_has_no_unpickling_code() -> None:
    src = Path(checkpoint.__file__).parent
    for file in src.glob("*.py"):
        text = file.read_text()
        for needle in ("import pickle", "torch.load(", "weights_only", "load_file("):
            assert needle not in text, f"{file.name} contains {needle!r}"


# ------------------------------------------------------------------------ mismatches
def test_mismatches_name_the_fqn_and_change_nothing(tmp_path: Path) -> None:
    plain = Path(checkpoint.save(tmp_path / "plain", *trained(1), step=1))
    extra = Path(checkpoint.save(tmp_path / "extra", *trained(1, extra_layer=True), step=1))
    wide = Path(checkpoint.save(tmp_path / "wide", *trained(1, width=20), step=1))
    torch.manual_seed(1)  # a param belongs to one optimizer: this model gets its first
    frozen_model = Net(16, False)
    frozen_model.out.requires_grad_(False)
    frozen = Path(checkpoint.save(tmp_path / "frozen", frozen_model,
                                  DistributedOptimizer(frozen_model, OptimizerConfig()), step=1))
    sgd = tmp_path / "sgd"
    shutil.copytree(plain, sgd)
    edit_manifest(sgd, lambda m: m["optimizer"].update(kind="sgd"))
    cases = [
        (plain, {"extra_layer": True}, "'extra.weight' of the model is missing"),
        (extra, {}, "checkpoint param 'extra.weight' does not exist in the model"),
        (wide, {}, r"'inp.weight': checkpoint shape \[20, 8\] != model shape \[16, 8\]"),
        (frozen, {}, "'out.weight' is trainable but the checkpoint holds no optimizer state"),
        (sgd, {}, "holds 'sgd' optimizer state"),
    ]
    for path, kwargs, needle in cases:
        model, opt = trained(2, **kwargs)
        before = snapshot(model, opt)
        with pytest.raises(checkpoint.CheckpointError, match=needle):
            checkpoint.load(path, model, opt)
        assert differences(before, snapshot(model, opt)) == []

    # Changed hyperparameters and bucketing are not a mismatch.
    model, opt = trained(2, lr=0.5, betas=(0.8, 0.9), weight_decay=0.0, bucket_numel=64)
    checkpoint.load(plain, model, opt)


def test_failed_load_on_one_rank_fails_every_rank_and_changes_nothing(tmp_path: Path) -> None:
    out = run_distributed(ranks.failed_loads, 2, str(tmp_path / "ckpts"), tmp_path=tmp_path,
                          timeout=120)
    for rank, res in enumerate(out):
        for kind, error in res["errors"].items():
            assert error is not None, (rank, kind)
            assert error == out[0]["errors"][kind]  # the same error on every rank
            if "rank1" in kind:
                assert "[dp rank 1]" in error and "[dp rank 0]" not in error, error
            assert res["changed"][kind] == [], (rank, kind, res["changed"][kind])
        assert res["diverged_from_twin"] == []
        assert "reading" in res["read_error"] and "[dp rank 1] OSError" in res["read_error"]
    errors = out[0]["errors"]
    assert "optim-00001.safetensors: content hash mismatch" in errors["flip_rank1_data"]
    assert "rng-00001.safetensors" in errors["rng_rank1_missing"]
    assert "invalid torch_cpu RNG state" in errors["rng_rank1_invalid"]
    assert "model-00000.safetensors: size is" in errors["truncated_model0"]
    assert "checksum mismatch" in errors["manifest_flipped"]
    assert "'inp.weight': checkpoint shape [20, 8]" in errors["shape_mismatch"]


# ---------------------------------------------------------------------- save failures
def test_save_failures_raise_on_every_rank_and_commit_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    out = run_distributed(ranks.save_faults, 2, str(root), tmp_path=tmp_path, timeout=120)
    for i, (name, bad_rank, _, _) in enumerate(ranks.SAVE_FAULTS):
        r0, r1 = out[0][i], out[1][i]
        assert r0["name"] == name
        assert r0["error"] is not None and r0["error"] == r1["error"], (name, r0, r1)
        if not name.startswith("ranks disagree"):
            assert f"[dp rank {bad_rank}]" in r0["error"], (name, r0["error"])
        assert r0["seconds"] < 60, name
        assert not [n for n in r0["listing"] if n.startswith(".tmp-")], (name, r0["listing"])
        assert r0["latest_after"] == r0["latest_before"] == str(root / "step_00000001"), name
        committed = f"step_{r0['step']:08d}" in r0["listing"]
        assert committed == (name == "the latest marker cannot be updated"), name
    assert "No space left on device" in out[0][0]["error"]
    assert "Permission denied" in out[0][2]["error"]
    assert "Boom" in out[0][5]["error"]
    assert "extra must be JSON-serialisable" in out[0][6]["error"]
    assert "disagree on the step or on blocking" in out[0][8]["error"]
    assert "is complete, but" in out[0][10]["error"]
    last = out[0][-1]
    assert last["latest_after"] == str(root / "step_00000099")
    assert [n for n in last["listing"] if n.startswith(".")] == [".lock"]
    check_root(root)


class _Tied(torch.nn.Module):
    """An embedding and a head sharing one weight; ``head_first`` declares the head first,
    so ``named_parameters()`` names the tied weight ``head.weight`` instead of ``emb.weight``."""

    def __init__(self, head_first: bool) -> None:
        super().__init__()
        emb, head = torch.nn.Embedding(11, 6), torch.nn.Linear(6, 11, bias=False)
        head.weight = emb.weight
        if head_first:
            self.head, self.emb = head, emb
        else:
            self.emb, self.head = emb, head
        self.norm = torch.nn.LayerNorm(6)
        self.register_buffer("scale", torch.full((6,), 1.001))


def test_a_tie_declared_the_other_way_and_buffers_of_another_dtype_are_told(tmp_path: Path,
                                                                           caplog) -> None:
    """A tied weight the model now names by its other name is refused saying it is the tie
    (not "missing"); a buffer stored in another dtype is cast into the model's, as
    ``model.load_state_dict`` does, with a warning naming it."""
    torch.manual_seed(0)
    saved = _Tied(head_first=False)
    path = checkpoint.save(tmp_path, saved, DistributedOptimizer(saved, OptimizerConfig()),
                           step=1)
    other = _Tied(head_first=True)
    with pytest.raises(checkpoint.CheckpointError, match=r"'head\.weight' of the model is tied "
                                                         r"to 'emb\.weight'"):
        checkpoint.load(path, other, DistributedOptimizer(other, OptimizerConfig()))
    narrow = _Tied(head_first=False)
    narrow.scale = narrow.scale.to(torch.bfloat16)
    with caplog.at_level("WARNING", logger="shardopt.checkpoint"):
        checkpoint.load(path, narrow, DistributedOptimizer(narrow, OptimizerConfig()))
    assert "scale (float32 -> bfloat16)" in caplog.text
    assert torch.equal(narrow.scale, torch.full((6,), 1.001).to(torch.bfloat16))


def test_a_temporary_directory_given_explicitly_is_not_loaded(tmp_path: Path) -> None:
    """A save's temporary directory may hold a manifest (written just before the rename that
    commits it): loading it by name is refused, as latest() never returns it."""
    model, opt = trained(1)
    path = Path(checkpoint.save(tmp_path / "root", model, opt, step=1))
    tmp = path.parent / ".tmp-step_00000002-abc"
    shutil.copytree(path, tmp)
    with pytest.raises(checkpoint.CheckpointError, match="not a committed checkpoint"):
        checkpoint.load(tmp, *trained(2))
