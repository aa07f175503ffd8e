"""Format version 3: a rank's data split into files of about equal size (parts of a kind)."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from faults.common import Net, config, differences, read_json, snapshot, trained, write_manifest
from shardopt import DistributedOptimizer, checkpoint
from shardopt.checkpoint import storage
from shardopt.checkpoint.storage import WriteEntry, entry_bytes, part_counts, split_entries
from shardopt.checkpoint.transfer import io_threads


def test_part_counts_even_out_the_largest_file():
    # bf16 weights (2 bytes per param) beside three fp32 states (4 each): splitting each
    # state in two gives 7 files of 2 bytes per param, where 4 files had one of 4.
    sizes = {"model": 2000, "optim": 4000, "exp_avg": 4000, "exp_avg_sq": 4000}
    assert part_counts(sizes, 8, min_part=1) == {"model": 1, "optim": 2, "exp_avg": 2,
                                                 "exp_avg_sq": 2}
    assert part_counts(sizes, 16, min_part=1) == {"model": 2, "optim": 4, "exp_avg": 4,
                                                  "exp_avg_sq": 4}
    # Fewer files than kinds: one each. Parts below min_part: not split.
    assert part_counts(sizes, 2, min_part=1) == dict.fromkeys(sizes, 1)
    assert part_counts(sizes, 16, min_part=1500) == {"model": 1, "optim": 2, "exp_avg": 2,
                                                     "exp_avg_sq": 2}
    # Frozen weights dominate (a fine-tune of a few params): the model file takes the parts.
    assert part_counts({"model": 10_000, "optim": 10, "exp_avg": 10, "exp_avg_sq": 10}, 8,
                       min_part=1) == {"model": 5, "optim": 1, "exp_avg": 1, "exp_avg_sq": 1}
    assert part_counts({"model": 100, "optim": 0}, 8, min_part=1)["optim"] == 1


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_split_entries_tiles_every_chunk_in_near_equal_runs(parts):
    torch.manual_seed(0)
    entries = [WriteEntry("a", torch.float32, 1001, 0, torch.randn(1001)),
               WriteEntry("empty", torch.float32, 0, 0, torch.zeros(0)),
               WriteEntry("b", torch.bfloat16, 333, 50, torch.randn(333).bfloat16()),
               WriteEntry("zeros", torch.float32, 17, 3, None),
               WriteEntry("c", torch.float64, 200, 7, torch.randn(200).double())]
    runs = split_entries(entries, parts)
    assert len(runs) == parts
    sizes = [entry_bytes(r) for r in runs]
    assert sum(sizes) == entry_bytes(entries)
    # Cuts fall between elements, so a run is off the mean by less than an element.
    assert max(sizes) - min(sizes) <= 2 * 8
    for e in entries:  # each key's pieces, in order, tile the original chunk exactly
        pieces = [p for r in runs for p in r if p.key == e.key]
        assert len(pieces) == len({id(r) for r in runs if any(p.key == e.key for p in r)})
        assert [p.offset for p in pieces] == [e.offset + sum(q.numel for q in pieces[:i])
                                              for i in range(len(pieces))]
        assert sum(p.numel for p in pieces) == e.numel
        if e.source is not None and e.numel:
            assert torch.equal(torch.cat([p.source for p in pieces]), e.source)
        else:
            assert all(p.source is None for p in pieces) or e.numel == 0


def test_io_threads_default_and_bad_values(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    n = io_threads()
    assert 2 <= n <= 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "10000")
    assert io_threads() == 2
    assert io_threads(5) == 5
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="io_threads must be an int >= 1"):
            checkpoint.CheckpointConfig(io_threads=bad)


@pytest.fixture
def split_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(storage, "MIN_PART_BYTES", 256)
    model, opt = trained(1, width=64)
    return Path(checkpoint.save(tmp_path / "root", model, opt, step=1,
                                config=checkpoint.CheckpointConfig(io_threads=12)))


def test_a_split_save_loads_exactly_in_place_and_into_a_new_optimizer(split_save: Path):
    m = read_json(split_save)
    names = sorted(m["files"])
    assert m["version"] == 4
    # Mostly bf16 weights and three fp32 states: at most 12 files besides the RNG's.
    assert "exp_avg-00000-p2.safetensors" in names and 9 <= len(names) - 1 <= 12
    sizes = [(split_save / n).stat().st_size for n in names if not n.startswith("rng-")]
    assert max(sizes) < 1.5 * min(sizes), sizes
    assert checkpoint.verify(split_save)["files"] == len(names)
    expected = snapshot(*trained(1, width=64), rng=False)
    for how in ("in place", "new optimizer"):
        if how == "in place":
            model, opt = trained(7, width=64)
        else:  # no step taken: no moments yet, so they are read in one verifying pass
            torch.manual_seed(7)
            model = Net(64, False)
            opt = DistributedOptimizer(model, config())
        checkpoint.load(split_save, model, opt, config=checkpoint.CheckpointConfig(io_threads=3))
        assert differences(snapshot(model, opt, rng=False), expected) == [], how


@pytest.mark.parametrize("edit, needle", [
    (lambda f: f.pop("exp_avg-00000-p1.safetensors"),
     "lists parts of exp_avg-00000.safetensors up to exp_avg-00000-p2.safetensors but not "
     "exp_avg-00000-p1.safetensors"),
    (lambda f: f.__setitem__("rng-00000-p1.safetensors", f["rng-00000.safetensors"]),
     "a version 4 checkpoint has no file rng-00000-p1"),
    (lambda f: f.__setitem__("model-00000-p1000.safetensors", f["model-00000.safetensors"]),
     "refusing data file name 'model-00000-p1000.safetensors'"),
])
def test_a_gap_in_the_parts_is_refused_by_name(split_save: Path, edit, needle):
    m = read_json(split_save)
    assert "exp_avg-00000-p2.safetensors" in m["files"]
    edit(m["files"])
    write_manifest(split_save, m)
    model, opt = trained(7, width=64)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=needle):
        checkpoint.load(split_save, model, opt)
    assert differences(snapshot(model, opt), before) == []


def test_parts_per_kind_stay_within_what_file_names_allow(tmp_path, monkeypatch):
    import importlib

    ckpt_save = importlib.import_module("shardopt.checkpoint.save")

    monkeypatch.setattr(storage, "MIN_PART_BYTES", 1)
    monkeypatch.setattr(ckpt_save, "MAX_PARTS", 3)  # as if -p1, -p2 were the last names
    model, opt = trained(1, width=64)
    path = Path(checkpoint.save(tmp_path / "root", model, opt, step=1,
                                config=checkpoint.CheckpointConfig(io_threads=40)))
    names = sorted(read_json(path)["files"])
    per_kind = collections.Counter(n.split("-")[0] for n in names)
    assert max(per_kind.values()) <= 3, per_kind  # 40 files would need up to 16 per kind
    assert checkpoint.verify(path)["files"] == len(names)
