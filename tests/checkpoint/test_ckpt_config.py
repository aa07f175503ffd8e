"""CheckpointConfig: the checkpoint settings in one validated object, beside the few
arguments of save (blocking, keep_last) and load (low_memory_resume), each set in one
place."""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path

import pytest

from faults.common import differences, read_json, snapshot, trained
from shardopt import checkpoint
from shardopt.checkpoint import CheckpointConfig


@pytest.mark.parametrize("field, bad", [
    ("verify", None), ("verify", "yes"), ("io_threads", 0), ("io_threads", True),
    ("staging_bytes", 0), ("staging_bytes", 2.5), ("block_bytes", 0),
    ("block_bytes", (1 << 30) + 1), ("rollback", 1), ("hyperparameters", "mine"),
])
def test_bad_settings_are_refused_by_name(field: str, bad) -> None:
    with pytest.raises(checkpoint.CheckpointError, match=rf"^{field} must be .*got {bad!r}$"):
        CheckpointConfig(**{field: bad})


def test_config_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        CheckpointConfig(True)  # noqa: FBT003 - the point of the test
    with pytest.raises(AttributeError):
        CheckpointConfig().verify = False  # type: ignore[misc]


def test_each_setting_has_one_place() -> None:
    """blocking, keep_last and low_memory_resume are arguments of save and load, not fields;
    the settings of the config are not arguments."""
    fields = {f.name for f in dataclasses.fields(CheckpointConfig)}
    assert not fields & {"blocking", "keep_last", "low_memory_resume"}
    for fn in (checkpoint.save, checkpoint.load):
        assert not fields & set(inspect.signature(fn).parameters)
    with pytest.raises(TypeError):
        checkpoint.save("unused", None, None, 1, io_threads=2)  # type: ignore[call-arg]


def test_save_takes_its_settings_from_the_config(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cfg = CheckpointConfig(block_bytes=4096, io_threads=1)
    for step in (1, 2):
        checkpoint.save(root, *trained(step), step=step, keep_last=1, config=cfg)
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000002"]
    assert {r["block_bytes"] for r in read_json(root / "step_00000002")["files"].values()} == {4096}
    checkpoint.save(root, *trained(3), step=3, keep_last=2,
                    config=CheckpointConfig(block_bytes=512))
    assert {r["block_bytes"] for r in read_json(root / "step_00000003")["files"].values()} == {512}
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000002",
                                                                           "step_00000003"]


@pytest.mark.parametrize("arguments, needle", [
    ({"keep_last": 0}, r"keep_last must be an int >= 1 or None, got 0$"),
    ({"blocking": None}, r"blocking must be a bool, got None$"),
    ({"config": {"keep_last": 2}}, "config must be a CheckpointConfig"),
])
def test_a_bad_setting_fails_the_save_and_commits_nothing(tmp_path: Path, arguments: dict,
                                                         needle: str) -> None:
    with pytest.raises(checkpoint.CheckpointError, match=needle):
        checkpoint.save(tmp_path / "root", *trained(1), step=1, **arguments)
    assert checkpoint.latest(tmp_path / "root") is None


def test_load_settings(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path / "root", *trained(1), step=1)
    expected = snapshot(*trained(1), rng=False)
    # low_memory_resume None: the optimizer config's; a True or False given wins over it.
    for given, opt_value, host in ((None, True, True), (None, False, False),
                                   (False, True, False), (True, False, True)):
        model, opt = trained(5, low_memory_resume=opt_value)
        checkpoint.load(path, model, opt, given, config=CheckpointConfig(io_threads=2))
        staged = opt.shard_state.held["exp_avg.0"].where == "staged"
        assert staged == host, (given, opt_value)
        assert differences(snapshot(model, opt, rng=False), expected) == []
    model, opt = trained(5)
    before = snapshot(model, opt)
    for arguments, needle in (({"low_memory_resume": 1}, "low_memory_resume must be a bool "
                               "or None, got 1"),
                              ({"config": {"staging_bytes": -1}}, "config must be a "
                               "CheckpointConfig, got dict")):
        with pytest.raises(checkpoint.CheckpointError, match=needle):
            checkpoint.load(path, model, opt, **arguments)
        assert differences(snapshot(model, opt), before) == []
