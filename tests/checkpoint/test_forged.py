"""Hostile values in a checkpoint, each with its checksum and hashes forged to match, so only
validation can stop it: refused with a ``CheckpointError`` naming the file and the field by
``load``, ``verify``, ``inspect`` and ``export`` alike, and in one ``shardopt: error:`` line by
the command; nothing loaded changes. Also a ``latest`` marker that is not a regular file, and
an export onto a full disk (docs/reliability.md lists what each shows)."""

from __future__ import annotations

import errno
import importlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors import safe_open

from faults.common import (Net, config, data_offset, differences, edit_manifest, header_length,
                           read_json, rehash_file, snapshot, train_step, trained)
from shardopt import DistributedOptimizer, checkpoint, cli


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model, opt = trained(1)
    return Path(checkpoint.save(tmp_path / "root", model, opt, step=1))


def _cli_error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """Run the command; it must fail with exactly one ``shardopt: error:`` line, returned."""
    capsys.readouterr()
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardopt: error: "), err
    return err


def _refused_everywhere(path: Path, needle: str, tmp_path: Path,
                        capsys: pytest.CaptureFixture) -> None:
    """``verify``, ``inspect``, ``export`` (and ``load``, changing nothing) raise a
    CheckpointError matching ``needle``; ``shardopt verify/inspect/export`` print one line."""
    for fn in (checkpoint.verify, checkpoint.inspect):
        with pytest.raises(checkpoint.CheckpointError, match=needle):
            fn(path)
    out = tmp_path / "exported"
    with pytest.raises(checkpoint.CheckpointError, match=needle):
        checkpoint.export(path, out)
    assert not out.exists() and not list(tmp_path.glob(".exported.export-*"))
    model, opt = trained(2)
    before = snapshot(model, opt)
    with pytest.raises(checkpoint.CheckpointError, match=needle):
        checkpoint.load(path, model, opt)
    assert differences(before, snapshot(model, opt)) == []
    for argv in (["verify", str(path)], ["inspect", str(path)], ["export", str(path), str(out)]):
        assert "manifest.json" in _cli_error(argv, capsys)


def _group(key: str, value: Any) -> Callable[[dict], None]:
    return lambda m: m["params"]["out.bias"]["group"].__setitem__(key, value)


# ------------------------------------------------------- forged manifest values
FORGED = {
    "dtype as a list": (lambda m: m["params"]["out.weight"].__setitem__("dtype", ["float32"]),
                        r"param 'out\.weight' has unknown dtype \['float32'\]"),
    "dtype as a dict": (lambda m: m["params"]["scale"].__setitem__("dtype", {"a": 1}),
                        r"param 'scale' has unknown dtype \{'a': 1\}"),
    "lr of 401 digits": (_group("lr", 10**400), r"lr=1000000.*characters\) of 'out\.bias' "
                                                r"is malformed"),
    "betas of 401 digits": (_group("betas", [10**400, 0.9]),
                            r"betas=\[1000.*of 'out\.bias' is malformed"),
    "eps of 401 digits": (_group("eps", -(10**400)), r"eps=-1000.*of 'out\.bias' is malformed"),
    "step count 10**400": (lambda m: m["params"]["out.bias"].__setitem__("step", 10**400),
                           r"step of 'out\.bias' must be an int in \[0, 2\*\*63 - 1\], got "
                           r"1000"),
    "step count 2**63": (lambda m: m["params"]["inp.weight"].__setitem__("step", 2**63),
                         r"step of 'inp\.weight' must be an int in \[0, 2\*\*63 - 1\]"),
    "checkpoint step 10**400": (lambda m: m.__setitem__("step", 10**400),
                                r"step must be an int in \[0, 2\*\*63 - 1\]"),
    "a dimension of 10**30": (lambda m: m["params"]["scale"].__setitem__("shape", [0, 10**30]),
                              r"a dimension of 'scale' must be an int in \[0, 2\*\*63 - 1\]"),
    "alias of no stored param": (lambda m: m["aliases"].__setitem__("head.weight", "nothing"),
                                 r"alias 'head\.weight' names 'nothing', which is not a "
                                 r"stored param"),
    "alias that is also stored": (lambda m: m["aliases"].__setitem__("out.bias", "inp.bias"),
                                  r"alias 'out\.bias' of 'inp\.bias' is empty or also a "
                                  r"stored param"),
}


@pytest.mark.parametrize("name", list(FORGED))
def test_forged_manifest_values_are_refused_everywhere(saved: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture,
                                                       name: str) -> None:
    edit, needle = FORGED[name]
    edit_manifest(saved, edit)
    _refused_everywhere(saved, f"manifest.json: .*{needle}", tmp_path, capsys)


def test_a_step_count_at_the_bound_loads_and_steps(saved: Path) -> None:
    """The bound is int64's: a count there is still a count the next step() takes."""
    edit_manifest(saved, lambda m: m["params"]["out.bias"].__setitem__("step", 2**63 - 1))
    model, opt = trained(2)
    checkpoint.load(saved, model, opt)
    train_step(model, opt, 5)
    assert opt.param_steps["out.bias"] == 2**63
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())


def test_a_forged_alias_of_a_param_the_model_lacks_is_refused(saved: Path) -> None:
    """An alias (tie) is a param name: one the model lacks is refused as any unknown param,
    naming it; nothing changes."""
    edit_manifest(saved, lambda m: m["aliases"].__setitem__("ghost.weight", "inp.weight"))
    checkpoint.verify(saved)  # well-formed: it names a stored param; the model decides
    model, opt = trained(2)
    before = snapshot(model, opt)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"checkpoint param 'ghost\.weight' \(tied to 'inp\.weight'\) "
                             r"does not exist in the model"):
        checkpoint.load(saved, model, opt)
    assert differences(before, snapshot(model, opt)) == []


# ------------------------------------------------------------- int8 moment scales
def _int8_checkpoint(tmp_path: Path) -> Path:
    model, opt = trained(1, exp_avg_dtype="int8", exp_avg_sq_dtype="int8")
    train_step(model, opt, 2)
    return Path(checkpoint.save(tmp_path / "int8", model, opt, step=2))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5], ids=["nan", "inf", "neg"])
def test_non_finite_or_negative_int8_scales_are_refused(tmp_path: Path, value: float,
                                                        capsys: pytest.CaptureFixture) -> None:
    """A scale that is NaN, infinite or negative (hashes forged to match) is refused wherever
    moments are read: load into an optimizer with moments (read in place), into a new one,
    with low_memory_resume, into fp32 moments (converted), and by verify and export; the
    file and key are named and nothing changes."""
    path = _int8_checkpoint(tmp_path)
    name, key = "exp_avg-00000.safetensors", "hidden.weight.exp_avg.scale"
    file = path / name
    data = bytearray(file.read_bytes())
    start = data_offset(file, key)
    data[start + 4:start + 8] = struct.pack("<f", value)  # block 1 of the key
    file.write_bytes(bytes(data))
    rehash_file(path, name)
    needle = rf"{name}: '{key}' holds the scale {value} for block 1"
    cases = {"in place": (dict(exp_avg_dtype="int8", exp_avg_sq_dtype="int8"), {}, True),
             "new optimizer": (dict(exp_avg_dtype="int8", exp_avg_sq_dtype="int8"), {}, False),
             "low_memory_resume": (dict(exp_avg_dtype="int8", exp_avg_sq_dtype="int8"),
                                   {"low_memory_resume": True}, True),
             "converted to fp32": ({}, {}, True)}
    for case, (cfg, kwargs, stepped) in cases.items():
        torch.manual_seed(7)
        model = Net()
        opt = DistributedOptimizer(model, config(**cfg))
        if stepped:
            train_step(model, opt, 3)
        before = snapshot(model, opt)
        with pytest.raises(checkpoint.CheckpointError, match=needle):
            checkpoint.load(path, model, opt, **kwargs)
        assert differences(before, snapshot(model, opt)) == [], case
    with pytest.raises(checkpoint.CheckpointError, match=needle):
        checkpoint.verify(path)
    for moments in ("float32", "stored"):
        with pytest.raises(checkpoint.CheckpointError, match=needle):
            checkpoint.export(path, tmp_path / "out", moments_dtype=moments)
    assert name in _cli_error(["verify", str(path)], capsys)


def test_zero_scales_are_valid(tmp_path: Path) -> None:
    """The control: before the first step the moments are stored as zeros, every scale 0."""
    cfg = config(exp_avg_dtype="int8", exp_avg_sq_dtype="int8")
    model = Net()
    path = checkpoint.save(tmp_path / "zeros", model, DistributedOptimizer(model, cfg), step=0)
    checkpoint.verify(path)
    model, opt = trained(1, exp_avg_dtype="int8", exp_avg_sq_dtype="int8")
    checkpoint.load(path, model, opt)


# ------------------------------------------------------------- safetensors headers
def _forge_file(path: Path, name: str, layout: Callable[[dict, bytes], tuple[dict, bytes]]
                ) -> None:
    """Rewrite data file ``name`` with ``layout(header, data) -> (header, data)`` and forge
    the manifest's size and hashes to match."""
    file = path / name
    raw = file.read_bytes()
    n = header_length(file)
    header, data = layout(json.loads(raw[8:n]), raw[n:])
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)
    rehash_file(path, name)


def _overlap(header: dict, data: bytes) -> tuple[dict, bytes]:
    """The second tensor starts 4 bytes inside the first; the data section ends with it."""
    entries = sorted((k for k in header if k != "__metadata__"),
                     key=lambda k: header[k]["data_offsets"][0])
    first, second = header[entries[0]], header[entries[1]]
    assert first["data_offsets"][1] == second["data_offsets"][0]
    shift = 4
    for key in entries[1:]:
        begin, end = header[key]["data_offsets"]
        header[key]["data_offsets"] = [begin - shift, end - shift]
    return header, data[:-shift]


def _trailing(header: dict, data: bytes) -> tuple[dict, bytes]:
    return header, data + bytes(8)


@pytest.mark.parametrize("layout", [_overlap, _trailing], ids=["overlapping", "trailing"])
def test_safetensors_header_rules_are_the_librarys(saved: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture,
                                                   layout) -> None:
    """Overlapping tensors, or bytes no tensor covers, with the manifest's chunk list, sizes
    and hashes all forged to match: the safetensors library refuses the file, and so does
    every reader of ours."""
    name = "optim-00000.safetensors"
    _forge_file(saved, name, layout)
    with pytest.raises(Exception) as refused:  # the library's own verdict: not safetensors
        with safe_open(str(saved / name), framework="pt") as f:
            f.keys()
    assert "safetensors" in type(refused.value).__module__.lower() or \
        "Safetensor" in type(refused.value).__name__
    needle = "overlaps the tensor before it" if layout is _overlap else \
        "the tensors cover .* of the .* bytes of the data section"
    for fn in (checkpoint.verify, lambda p: checkpoint.export(p, tmp_path / "out")):
        with pytest.raises(checkpoint.CheckpointError, match=f"{name}: .*{needle}"):
            fn(saved)
    model, opt = trained(2)
    before = snapshot(model, opt)
    with pytest.raises(checkpoint.CheckpointError, match=f"{name}: .*{needle}"):
        checkpoint.load(saved, model, opt)
    assert differences(before, snapshot(model, opt)) == []
    assert name in _cli_error(["verify", str(saved)], capsys)


def test_our_files_follow_the_librarys_header_rules(saved: Path) -> None:
    """The control: every file we write is one the library opens."""
    for name in read_json(saved)["files"]:
        with safe_open(str(saved / name), framework="pt") as f:
            assert f.keys() is not None


# ------------------------------------------------------------------ latest marker
class Blocked(Exception):
    """Not an OSError, which the code under test may catch."""


def _unblocked(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, failing the test if it blocks for 20 s (opening a FIFO for reading
    blocks until a writer comes)."""
    def blocked(signum, frame):
        raise Blocked(f"{fn.__name__} blocked")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(20)
    try:
        return fn(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_latest_marker_that_is_not_a_regular_file_is_a_damaged_one(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A FIFO (or a directory) in place of ``latest``: ``latest()``, ``load(root)`` and
    ``shardopt verify ROOT`` do not block; they fall back to the newest complete
    checkpoint, as for any damaged marker, and the next save replaces it."""
    root = tmp_path / "root"
    for step in (1, 2):
        checkpoint.save(root, *trained(step), step=step)
    (root / "latest").unlink()
    os.mkfifo(root / "latest")
    newest = str(root / "step_00000002")
    assert _unblocked(checkpoint.latest, root) == newest
    model, opt = trained(5)
    assert _unblocked(checkpoint.load, root, model, opt).step == 2
    capsys.readouterr()
    assert _unblocked(cli.main, ["verify", str(root)]) == 0
    assert capsys.readouterr().out.startswith(f"OK {newest}")
    checkpoint.save(root, *trained(3), step=3)
    assert (root / "latest").read_text() == "step_00000003\n"
    (root / "latest").unlink()
    (root / "latest").mkdir()
    assert checkpoint.latest(root) == str(root / "step_00000003")


# ------------------------------------------------------------------ full disk
def _needed(path: Path) -> int:
    return sum(t["weight_bytes"] + t["state_bytes"] for t in checkpoint.inspect(path)["params"])


def test_export_onto_a_full_disk_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The export's writer failing with ENOSPC (as a full disk makes it): one line naming
    the output directory and the free space the export needs; no partial output."""
    path = Path(checkpoint.save(tmp_path / "root", *trained(1, width=64), step=1))
    export_module = importlib.import_module("shardopt.checkpoint.export")
    real, calls = export_module.save_file, []

    def full_at_the_second_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")  # what a write raises
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(export_module, "save_file", full_at_the_second_file)
    out = tmp_path / "out"
    err = _cli_error(["export", str(path), str(out)], capsys)
    assert f"{out}" in err and "No space left on device" in err
    assert "needs" in err and "free" in err
    assert len(calls) == 2 and not out.exists() and os.listdir(tmp_path) == ["root"]


def _tmpfs_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True).returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _tmpfs_works(),
                    reason="needs unshare and a tmpfs mount in a private mount namespace")
def test_export_onto_a_really_full_file_system(tmp_path: Path) -> None:
    """``shardopt export`` into a 64 KiB tmpfs (mounted in a private mount namespace, so
    nothing outside sees it) that the export does not fit: one ``shardopt: error:`` line
    naming the output directory and the space needed, nothing left behind."""
    path = Path(checkpoint.save(tmp_path / "root", *trained(1, width=128), step=1))
    assert _needed(path) > 64 << 10
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "out"
    script = (f"mount -t tmpfs -o size=64k tmpfs {disk} && "
              f"{sys.executable} -m shardopt export {path} {out}; code=$?; "
              f"ls -A {disk}; exit $code")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardopt: error: "), proc.stderr
    assert str(out) in lines[0] and "needs" in lines[0], lines[0]
    assert proc.stdout.strip() == ""  # the listing of the full file system: empty
