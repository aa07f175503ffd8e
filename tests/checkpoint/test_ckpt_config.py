"""CheckpointConfig: the checkpoint settings in one validated object, and the keyword
arguments of save and load that override it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from faults.common import differences, read_json, snapshot, trained
from shardopt import checkpoint
from shardopt.checkpoint import CheckpointConfig


@pytest.mark.parametrize("field, bad", [
    ("low_memory_resume", 1), ("verify", None), ("verify", "yes"), ("io_threads", 0),
    ("io_threads", True), ("staging_bytes", 0), ("staging_bytes", 2.5), ("keep_last", 0),
    ("block_bytes", 0), ("block_bytes", (1 << 30) + 1),
])
def test_bad_settings_are_refused_by_name(field: str, bad) -> None:
    with pytest.raises(checkpoint.CheckpointError, match=rf"^{field} must be .*got {bad!r}$"):
        CheckpointConfig(**{field: bad})


def test_config_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        CheckpointConfig(True)  # noqa: FBT003 - the point of the test
    with pytest.raises(AttributeError):
        CheckpointConfig().verify = False  # type: ignore[misc]


def test_save_takes_its_settings_from_the_config_and_keywords_override(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cfg = CheckpointConfig(block_bytes=4096, keep_last=1, io_threads=1)
    for step in (1, 2):
        checkpoint.save(root, *trained(step), step=step, config=cfg)
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000002"]
    assert {r["block_bytes"] for r in read_json(root / "step_00000002")["files"].values()} == {4096}
    checkpoint.save(root, *trained(3), step=3, config=cfg, block_bytes=512, keep_last=2)
    assert {r["block_bytes"] for r in read_json(root / "step_00000003")["files"].values()} == {512}
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000002",
                                                                           "step_00000003"]


def test_a_bad_setting_fails_the_save_and_commits_nothing(tmp_path: Path) -> None:
    with pytest.raises(checkpoint.CheckpointError, match="keep_last must be"):
        checkpoint.save(tmp_path / "root", *trained(1), step=1, keep_last=0)
    with pytest.raises(checkpoint.CheckpointError, match="config must be a CheckpointConfig"):
        checkpoint.save(tmp_path / "root", *trained(1), step=1, config={"keep_last": 2})
    assert checkpoint.latest(tmp_path / "root") is None


def test_load_settings_from_the_config(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path / "root", *trained(1), step=1)
    expected = snapshot(*trained(1), rng=False)
    # low_memory_resume None: the optimizer config's; a config's True or False wins over it.
    for cfg_value, opt_value, host in ((None, True, True), (None, False, False),
                                       (False, True, False), (True, False, True)):
        model, opt = trained(5, low_memory_resume=opt_value)
        checkpoint.load(path, model, opt, config=CheckpointConfig(low_memory_resume=cfg_value,
                                                                  io_threads=2))
        assert (opt._host.staged is not None) == host, (cfg_value, opt_value)
        assert differences(snapshot(model, opt, rng=False), expected) == []
    model, opt = trained(5)
    checkpoint.load(path, model, opt, config=CheckpointConfig(low_memory_resume=True),
                    low_memory_resume=False)  # the keyword overrides the config
    assert opt._host.staged is None
    before = snapshot(model, opt)
    with pytest.raises(checkpoint.CheckpointError, match="staging_bytes must be"):
        checkpoint.load(path, model, opt, config=CheckpointConfig(), staging_bytes=-1)
    assert differences(snapshot(model, opt), before) == []
