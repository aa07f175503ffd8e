"""What a save holds follows the model between saves: frozen tensors and buffers added,
made non-persistent, replaced or hooked, blocking or not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from helpers.checks import model_state
from shardopt import checkpoint
from shardopt.checkpoint import CheckpointError


def test_what_a_save_holds_follows_the_model_as_it_changes_between_saves(trained_model,
                                                                         tmp_path):
    """Each save, blocking or not, holds the frozen tensors the model's state dict has at
    its call, whatever changed since the last save: a buffer added, one made
    non-persistent, a frozen param replaced, a state-dict hook; a frozen param made
    trainable is refused naming it."""
    model, opt = trained_model

    def check(step: int) -> None:
        for blocking in (False, True):
            out = checkpoint.save(tmp_path / "ckpt", model, opt, step=2 * step + blocking,
                                  blocking=blocking)
            path = Path(out if blocking else out.wait())
            names = {k for k, v in json.loads((path / "manifest.json").read_text())[
                "params"].items() if not v["trainable"]}
            expected = {k: v for k, v in model_state(model).items() if k not in opt.layout.slots}
            assert names == expected.keys(), (step, blocking, names ^ expected.keys())
            exported = tmp_path / f"export-{step}-{blocking}"
            checkpoint.export(path, exported)
            got = safetensors.torch.load_file(exported / "model.safetensors")
            for k, v in expected.items():
                assert torch.equal(got[k], v), (step, blocking, k)

    check(1)
    model.register_buffer("added", torch.arange(5.0))
    check(2)
    model.register_buffer("added", torch.arange(5.0) + 1, persistent=False)
    check(3)
    model.pos = torch.nn.Parameter(torch.ones_like(model.pos), requires_grad=False)
    check(4)
    model.norm.register_state_dict_post_hook(
        lambda module, sd, prefix, local: sd.__setitem__(prefix + "hooked", torch.ones(2)))
    check(5)
    check(6)
    model.pos.requires_grad_(True)
    with pytest.raises(CheckpointError, match="'pos'"):
        checkpoint.save(tmp_path, model, opt, step=20, blocking=False)
