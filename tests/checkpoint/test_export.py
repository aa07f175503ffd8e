"""``checkpoint.export``: full-shape safetensors equal to the live state, split Hugging Face style,
and never written into a checkpoint or left half-written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.checks import assert_tensors_equal, exported, read_export
from shardopt import checkpoint
from shardopt.checkpoint import CheckpointError
from shardopt.optimizer import STATE_NAMES

def test_export_matches_live_state(saved3, tmp_path):
    written = checkpoint.export(saved3.path, tmp_path)
    assert sorted(Path(p).name for p in written) == ["model.safetensors", "optimizer.safetensors"]
    model = load_file(str(tmp_path / "model.safetensors"))
    optim = load_file(str(tmp_path / "optimizer.safetensors"))
    # Weights (trainable, frozen, buffers) in model dtype and full shape.
    assert_tensors_equal(model, saved3.params)
    assert sorted(optim) == sorted(f"{fqn}.{n}" for fqn in saved3.shapes if fqn != "pos"
                                   for n in STATE_NAMES)
    for key, value in optim.items():
        assert value.dtype == torch.float32
        assert torch.equal(value, saved3.state[key]), key
    for fqn, p in saved3.params.items():
        if fqn in saved3.shapes and fqn != "pos":
            assert torch.equal(optim[f"{fqn}.master_param"].to(p.dtype), p), fqn
    assert torch.count_nonzero(optim["emb.weight.exp_avg_sq"]) > 0


def test_split_export_is_hugging_face_style(saved3, tmp_path):
    whole = exported(saved3.path, tmp_path / "whole")
    max_bytes = 700
    written = checkpoint.export(saved3.path, tmp_path / "split", max_file_bytes=max_bytes)
    split = read_export(tmp_path / "split")
    assert_tensors_equal(split, whole)
    for stem in ("model", "optimizer"):
        files = sorted(Path(p).name for p in written if Path(p).name.startswith(f"{stem}-"))
        n = len(files)
        assert n > 1
        assert files == [f"{stem}-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        index = json.loads((tmp_path / "split" / f"{stem}.safetensors.index.json").read_text())
        keys = {k for f in files for k in load_file(str(tmp_path / "split" / f))}
        assert set(index["weight_map"]) == keys
        for key, f in index["weight_map"].items():
            assert key in load_file(str(tmp_path / "split" / f))
        assert index["metadata"]["total_size"] == sum(
            whole[k].numel() * whole[k].element_size() for k in keys)
        for f in files:
            tensors = load_file(str(tmp_path / "split" / f))
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            assert size <= max_bytes or len(tensors) == 1
    assert not (tmp_path / "split" / "model.safetensors").exists()


def test_export_refuses_a_checkpoint_as_output(saved3, tmp_path):
    """Export never writes into a checkpoint (``verify`` would then reject it) or over
    other files; a refused or failed export leaves nothing behind."""
    before = {p.name: p.read_bytes() for p in saved3.path.iterdir()}
    for out, needle in ((saved3.path, "inside the checkpoint"),
                        (saved3.path / "sub", "inside the checkpoint"),
                        (saved3.root, "holds a checkpoint"),
                        (saved3.path.parent.parent, "holds a checkpoint")):
        with pytest.raises(CheckpointError, match=needle):
            checkpoint.export(saved3.path, out)
    assert {p.name: p.read_bytes() for p in saved3.path.iterdir()} == before
    checkpoint.verify(saved3.path)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        checkpoint.export(saved3.path, busy)
    (tmp_path / "empty").mkdir()
    assert len(checkpoint.export(saved3.path, tmp_path / "empty")) == 2
    assert sorted(os.listdir(tmp_path)) == ["busy", "empty"]


def test_failed_export_leaves_no_output(saved3, tmp_path, monkeypatch):
    import importlib

    export_mod = importlib.import_module("shardopt.checkpoint.export")
    calls = []

    def save_then_fail(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(tensors, filename, metadata=metadata)

    real = export_mod.save_file
    monkeypatch.setattr(export_mod, "save_file", save_then_fail)
    with pytest.raises(checkpoint.CheckpointError, match="No space left"):
        checkpoint.export(saved3.path, tmp_path / "out")
    assert len(calls) == 2 and os.listdir(tmp_path) == []
