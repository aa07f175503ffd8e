"""torch.optim's contract: ``state_dict()`` / ``load_state_dict()`` keyed by FQN, through
``torch.save`` and through ``torch.distributed.checkpoint``, and ``optimizer.state``.

One DP-2 spawn trains, saves both ways at step 3, resumes fresh models both ways and
checks the mismatches that only show with several ranks; the parent checks the DP-size,
model and dtype mismatches at DP 1 against the files the spawn wrote, and a DCP load at
DP 1 and DP 3 (resharding).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers.checks import assert_tensors_equal, model_state
from helpers.dist import run_distributed
from helpers.models import (MixedLM, STATE_NAMES, build, live_optimizer_state, make_config,
                            param_groups, train)
from shardopt import DistributedOptimizer, FlatShard
from shardopt.errors import StateDictError

SAVE_STEP, END_STEP = 3, 6


def everything(model: torch.nn.Module, opt: DistributedOptimizer) -> dict[str, torch.Tensor]:
    """Copies of all a load may change on this rank: weights, state, steps, hyperparameters."""
    out = {f"model.{k}": v for k, v in model_state(model).items()}
    names = STATE_NAMES if opt.shard_state.has_moments else ("master_param",)
    for s in opt.shard_state.shards:
        out.update({f"{s.fqn}.{n}@{s.range_param.start}": opt.shard_state.view(n, s).clone()
                    for n in names})
    out["steps"] = torch.tensor([opt.param_steps[f] for f in opt.shard_state.fqn_of.values()])
    out["hparams"] = torch.tensor([[g["lr"], *g["betas"], g["eps"], g["weight_decay"]]
                                   for g in opt.param_groups], dtype=torch.float64)
    return out


def full_state(parts: list[list[tuple[str, int, int, dict]]]) -> dict[str, torch.Tensor]:
    """Every rank's ``live_optimizer_state`` joined into whole flat tensors per FQN."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for rank_parts in parts:
        for fqn, start, _, state in rank_parts:
            for name, t in state.items():
                pieces[f"{fqn}.{name}"].append((start, t))
    return {k: torch.cat([t for _, t in sorted(v, key=lambda p: p[0])]) for k, v in pieces.items()}


def refused(opt: DistributedOptimizer, model: torch.nn.Module, sd: Any) -> str:
    """Load ``sd``, expect a StateDictError, check that nothing changed; return the message."""
    before = everything(model, opt)
    with pytest.raises(StateDictError) as info:
        opt.load_state_dict(sd)
    assert_tensors_equal(everything(model, opt), before, "after a refused load")
    return str(info.value)


def contract_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, opt = build(0)
    train(model, opt, range(END_STEP), rank, world_size)
    reference = everything(model, opt)

    model, opt = build(0)
    train(model, opt, range(SAVE_STEP), rank, world_size)
    saved_state = live_optimizer_state(opt)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"{root}/sd-{rank}.pt")
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
             checkpoint_id=f"{root}/dcp")
    train(model, opt, range(SAVE_STEP, END_STEP), rank, world_size)
    assert_tensors_equal(everything(model, opt), reference, "saving disturbed the run")

    resumed = {}
    for how in ("torch.save", "dcp"):
        model, opt = build(10)  # other weights: the load must bring everything back
        if how == "torch.save":
            sd = torch.load(f"{root}/sd-{rank}.pt")  # weights_only: FlatShard is allowed
        else:
            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            dcp.load(sd, checkpoint_id=f"{root}/dcp")
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        train(model, opt, range(SAVE_STEP, END_STEP), rank, world_size)
        resumed[how] = everything(model, opt)

    # Other bucket sizes give other ranges on some rank: every rank refuses.
    torch.manual_seed(0)
    model = MixedLM()
    opt = DistributedOptimizer(model, make_config(bucket_numel=300), param_group_fn=param_groups)
    other_layout = refused(opt, model, torch.load(f"{root}/sd-{rank}.pt")["optim"])
    views = {opt.shard_state.fqn_of[p]: sorted(s.keys()) for p, s in opt.state.items()}
    return {"reference": reference, "resumed": resumed, "saved_state": saved_state,
            "other_layout": other_layout, "views": views, "shards": [s.fqn for s in opt.shard_state.shards]}


def reshard_rank(rank: int, world_size: int, root: str) -> list[tuple[str, int, int, dict]]:
    model, opt = build(20)
    model_sd = model.state_dict()
    # The optimizer as a DCP Stateful: DCP calls state_dict(), loads, calls load_state_dict().
    dcp.load({"model": model_sd, "optim": opt}, checkpoint_id=f"{root}/dcp")
    model.load_state_dict(model_sd)
    assert all(opt.param_steps[f] == SAVE_STEP for f in opt.shard_state.fqn_of.values())
    return live_optimizer_state(opt)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("contract")
    return root, run_distributed(contract_rank, 2, str(root), tmp_path=root)


def test_resume_through_state_dict_is_bitwise(dp2):
    _, results = dp2
    for rank, r in enumerate(results):
        for how, state in r["resumed"].items():
            assert_tensors_equal(state, r["reference"], f"rank {rank} resumed via {how}")


def test_other_layout_is_refused_on_every_rank(dp2):
    _, results = dp2
    for r in results:
        assert any(tag in r["other_layout"] for tag in ("[dp rank 0]", "[dp rank 1]",
                                                        "[dp ranks 0-1]"))
        assert "another DP size or bucket layout" in r["other_layout"]
    assert results[0]["other_layout"] == results[1]["other_layout"]


def test_optimizer_state_shows_local_views(dp2):
    _, results = dp2
    for r in results:
        for fqn, keys in r["views"].items():
            if fqn in r["shards"]:
                assert keys == ["master_param", "offset", "step"], fqn  # no moments yet
            else:
                assert keys == ["step"], fqn
    # Tiny buckets split params: some param is held by one rank only.
    assert set(results[0]["shards"]) != set(results[1]["shards"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("world_size", [1, 3])
def test_dcp_load_reshards_exactly(dp2, world_size, tmp_path):
    root, results = dp2
    saved = full_state([r["saved_state"] for r in results])
    if world_size == 1:
        loaded = [reshard_rank(0, 1, str(root))]  # no process group: DCP runs without one
    else:
        loaded = run_distributed(reshard_rank, world_size, str(root), tmp_path=tmp_path)
    assert_tensors_equal(full_state(loaded), saved)


def test_torch_save_at_another_dp_size_is_refused_naming_the_fqn(dp2):
    root, _ = dp2
    model, opt = build(1)
    message = refused(opt, model, torch.load(root / "sd-1.pt")["optim"])
    assert "param '" in message and "dp size 1" in message


@pytest.mark.parametrize("kwargs, needle", [
    ({"extra_layer": True}, "param 'extra.weight' of the model is missing"),
    ({"down_bias": False}, "param 'down.bias' of the state dict is not a trainable param"),
    ({"fp32": ("norm",)}, "param 'router.weight' is bfloat16 here but was 'float32'"),
])
def test_other_model_is_refused_naming_the_fqn(kwargs, needle):
    _, opt = build(0)
    sd = opt.state_dict()
    model, opt = build(1, **kwargs)
    assert needle in refused(opt, model, sd)


def test_malformed_state_dicts_are_refused():
    model, opt = build(0)
    train(model, opt, range(1), 0, 1)
    sd = opt.state_dict()
    positional = {"state": {0: {}}, "param_groups": sd["param_groups"]}
    assert "positional torch.optim state dict" in refused(opt, model, positional)
    assert "'state' and 'param_groups'" in refused(opt, model, {"state": {}})
    plain = {**sd, "state": {**sd["state"], "emb.weight": {**sd["state"]["emb.weight"],
                                                           "exp_avg": torch.zeros(3)}}}
    assert "'emb.weight': exp_avg of the state dict is a Tensor" in refused(opt, model, plain)
    # A torch.optim.AdamW state dict keyed by FQN (get_optimizer_state_dict's layout)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    ref = copy.deepcopy(model).float()
    adamw = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    sum(p.sum() for p in ref.parameters() if p.requires_grad).backward()
    adamw.step()
    fqn_keyed = get_optimizer_state_dict(ref, adamw)
    assert "it is not a DistributedOptimizer.state_dict()" in refused(opt, model, fqn_keyed)


def test_step_counts_load_per_param():
    model, opt = build(0)
    train(model, opt, range(1), 0, 1)
    sd = opt.state_dict()
    # emb.weight and up.weight share a param group; step counts are per param all the same.
    own = {**sd, "state": {**sd["state"], "up.weight": {**sd["state"]["up.weight"],
                                                        "step": torch.tensor(9.0)}}}
    opt.load_state_dict(own)
    assert opt.param_steps["up.weight"] == 9 and opt.param_steps["emb.weight"] == 1
    assert float(opt.state_dict()["state"]["up.weight"]["step"]) == 9.0


def test_state_dict_before_the_first_step_resumes_as_fresh():
    model, opt = build(0)
    assert not opt.shard_state.has_moments
    sd = opt.state_dict()
    assert not opt.shard_state.has_moments  # the moments' zeros are made only when read
    fresh, fresh_opt = build(0)
    loaded_model, loaded = build(5)
    loaded_model.load_state_dict(model.state_dict())
    loaded.load_state_dict(sd)
    train(fresh, fresh_opt, range(2), 0, 1)
    train(loaded_model, loaded, range(2), 0, 1)
    assert_tensors_equal(everything(loaded_model, loaded), everything(fresh, fresh_opt))


def _build(seed: int, device: str, **cfg: Any) -> tuple[MixedLM, DistributedOptimizer]:
    torch.manual_seed(seed)
    model = MixedLM().to(device)
    return model, DistributedOptimizer(model, make_config(**cfg), param_group_fn=param_groups)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_low_memory_resume_through_load_state_dict(device, tmp_path):
    model, opt = _build(0, device)
    train(model, opt, range(END_STEP), 0, 1)
    reference = everything(model, opt)
    model, opt = _build(0, device)
    train(model, opt, range(SAVE_STEP), 0, 1)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "sd.pt")
    model, opt = _build(10, device, low_memory_resume=True)
    sd = torch.load(tmp_path / "sd.pt")
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    assert opt.shard_state.held["exp_avg.0"].where == "staged"  # on the host until step()
    assert opt.state[model.up.weight]["exp_avg"].device.type == "cpu"
    train(model, opt, range(SAVE_STEP, END_STEP), 0, 1)
    assert_tensors_equal(everything(model, opt), reference)


def test_optimizer_state_is_a_defaultdict_of_live_views():
    model, opt = build(0)
    assert isinstance(opt.state, defaultdict)
    assert sorted(opt.state[model.up.weight]) == ["master_param", "offset", "step"]
    train(model, opt, range(1), 0, 1)
    entry = opt.state[model.up.weight]
    assert entry["offset"] == 0 and float(entry["step"]) == 1.0
    assert entry["exp_avg"].numel() == model.up.weight.numel()
    entry["exp_avg"].fill_(0.5)
    assert bool((opt.state_dict()["state"]["up.weight"]["exp_avg"].local == 0.5).all())
    assert len(opt.state) == len(list(opt.state)) == len(opt.shard_state.fqn_of)
    assert opt.state[torch.zeros(1)] == {}  # unknown keys behave as in torch's defaultdict


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_async_save_and_deepcopy(tmp_path):
    model, opt = build(0)
    train(model, opt, range(2), 0, 1)
    copied = copy.deepcopy(opt.state_dict())
    dcp.async_save({"optim": opt.state_dict()}, checkpoint_id=tmp_path / "dcp").result()
    expected = everything(model, opt)
    train(model, opt, range(2, 3), 0, 1)  # the staged copy, not the live state, was saved
    for loaded in ({"optim": copied}, None):
        model2, opt2 = build(3)
        if loaded is None:
            loaded = {"optim": opt2.state_dict()}
            dcp.load(loaded, checkpoint_id=tmp_path / "dcp")
        opt2.load_state_dict(loaded["optim"])
        got = everything(model2, opt2)
        assert_tensors_equal({k: v for k, v in got.items() if not k.startswith("model.")},
                             {k: v for k, v in expected.items() if not k.startswith("model.")})


def test_state_dict_hooks_run_as_in_torch():
    model, opt = build(0)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(
        lambda o, sd: {k: v for k, v in sd.items() if k != "extra"})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("loaded"))
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict(sd)
    assert calls == ["pre", "loaded"]


def test_flat_shard_round_trips_and_refuses_arithmetic(tmp_path):
    shard = FlatShard(torch.arange(3.0), 2, 7)
    torch.save({"x": shard}, tmp_path / "x.pt")
    back = torch.load(tmp_path / "x.pt")["x"]  # weights_only=True by default
    assert (back.offset, back.shape, back.local_numel) == (2, torch.Size([7]), 3)
    assert torch.equal(back.local, torch.arange(3.0))
    with pytest.raises(TypeError, match=r"\.local"):
        shard.sum()
    with pytest.raises(ValueError, match="not within"):
        FlatShard(torch.zeros(3), 5, 7)


def test_optimizer_state_writes_take_effect_or_raise():
    """As ``torch.optim.AdamW``: writing into a state tensor, or assigning one like it,
    changes the state (a framework moving the state between devices assigns each tensor
    back). Removing an entry, assigning something else, or writing into ``step`` (a copy)
    cannot reach the sharded state: it raises instead of being silently dropped."""
    from shardopt.errors import StateWriteError

    model, opt = build(0)
    train(model, opt, range(2), 0, 1)
    p = model.up.weight
    before = everything(model, opt)
    entry = opt.state[p]
    for key, value in (("exp_avg", torch.zeros(3)), ("exp_avg", entry["exp_avg"].double()),
                       ("step", torch.tensor(0.0)), ("offset", 5)):
        with pytest.raises(StateWriteError, match="up.weight"):
            entry[key] = value
    for write in (lambda e: e.update(step=0), lambda e: e.pop("exp_avg"),
                  lambda e: e.clear(), lambda e: e.setdefault("x", 1)):
        with pytest.raises(StateWriteError, match="up.weight"):
            write(entry)
    step = entry["step"]  # torch keeps step a tensor; this one is a copy
    for write in (lambda s: s.zero_(), lambda s: s.__iadd__(1), lambda s: s.__setitem__((), 3),
                  lambda s: torch.add(s, 1, out=s)):
        with pytest.raises(StateWriteError, match=r"on the step count of optimizer\.state"
                                                  r"\['up\.weight'\].*param_steps"):
            write(step)
    assert float(step) == 2.0 and torch.equal(step + 1, torch.tensor(3.0))
    assert type(step + 1) is torch.Tensor and repr(step) == "tensor(2.)"
    assert type(copy.deepcopy(step)) is torch.Tensor and torch.equal(copy.deepcopy(step), step)
    for write in (lambda s: s.__setitem__(p, {}), lambda s: s.__delitem__(p),
                  lambda s: s.update({p: {}}), lambda s: s.pop(p)):
        with pytest.raises(StateWriteError, match="up.weight"):
            write(opt.state)
    with pytest.raises(StateWriteError, match="removing"):  # a reset that would be lost
        opt.state.clear()
    for v in opt.state.values():  # as Lightning's _optimizer_to_device does
        for key, t in v.items():
            if key != "step":
                v[key] = t.to("cpu") if isinstance(t, torch.Tensor) else t
    assert_tensors_equal(everything(model, opt), before, "after refused writes")
    assert dict(copy.deepcopy(entry)).keys() == entry.keys()  # copies are plain dicts
    entry["exp_avg"] = torch.zeros_like(entry["exp_avg"])  # copied in, as torch takes it
    entry.update(exp_avg_sq=torch.ones_like(entry["exp_avg_sq"]))
    assert not opt.state[p]["exp_avg"].any() and bool((opt.state[p]["exp_avg_sq"] == 1).all())
    opt.state[torch.zeros(1)]["k"] = 1  # tensors the optimizer does not own: as in torch


def test_weights_written_back_unchanged_keep_the_main_params():
    """Loading the optimizer before the model (or writing the weights back unchanged, as
    ``model.load_state_dict(model.state_dict())``) writes each param its own value: the fp32
    main params keep their digits and the resume is still bitwise. A param written with
    another value is re-seeded from it."""
    model, opt = build(0)
    train(model, opt, range(SAVE_STEP), 0, 1)
    saved = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    train(model, opt, range(SAVE_STEP, END_STEP), 0, 1)
    reference = everything(model, opt)
    model, opt = build(10)
    opt.load_state_dict(saved["optim"])
    model.load_state_dict(saved["model"])  # after the optimizer: the same values
    model.load_state_dict(model.state_dict())
    train(model, opt, range(SAVE_STEP, END_STEP), 0, 1)
    assert_tensors_equal(everything(model, opt), reference, "optimizer loaded first")
    with torch.no_grad():
        model.up.weight[0, 0] = 0.5
    opt.shard_state.reseed_written()
    shard = opt.shard_state.shard_of["up.weight"]
    assert float(opt.shard_state.view("master_param", shard)[0]) == 0.5
