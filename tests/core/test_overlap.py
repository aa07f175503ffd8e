"""overlap_param_gather: all-gathers that step() leaves in flight, and everything that must
wait for them (the next forward, model.state_dict())."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from helpers.checks import bits, param_copies
from helpers.dist import device_for, require_world_size, run_distributed
from helpers.models import GROUP_FNS, Scenario
from shardopt import DistributedOptimizer


def _overlap_rank(rank: int, world_size: int, backend: str, overlap: bool) -> dict[str, Any]:
    sc = Scenario(world_size=world_size, steps=4, groups="no_decay", tied=True, branch=True,
                  max_grad_norm=0.5)
    device = device_for(backend, rank)
    model = sc.model().to(device)
    cfg = dataclasses.replace(sc.config(), overlap_param_gather=overlap)
    opt = DistributedOptimizer(model, cfg, param_group_fn=GROUP_FNS["no_decay"])
    tokens, targets = sc.batches()
    history = []
    for step in range(sc.steps):
        loss = model(tokens[step, 0, rank].to(device), targets[step, 0, rank].to(device),
                     sc.uses_branch(step, 0, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append(float(loss))
    in_flight = opt.shard_state.gathers_in_flight
    with torch.no_grad():  # each module's pre-hook waits for (and drops) its buckets' gathers
        model(tokens[0, 0, rank].to(device), targets[0, 0, rank].to(device), True)
    after_forward = opt.shard_state.gathers_in_flight
    opt.shard_state.finish_param_sync()
    return {"losses": history, "params": param_copies(model), "in_flight": in_flight,
            "after_forward": after_forward}


def test_overlap_param_gather_trains_bit_identically(backend, tmp_path):
    """Gathers left in flight by step() and awaited by each module's forward pre-hook give
    the same losses and params, bit for bit, as waiting inside step()."""
    require_world_size(backend, 2)
    runs = {o: run_distributed(_overlap_rank, 2, backend, o, backend=backend, tmp_path=tmp_path)
            for o in (False, True)}
    assert all(r["in_flight"] > 0 for r in runs[True])  # step() really returned early
    assert all(r["after_forward"] == 0 for r in runs[True])
    assert all(r["in_flight"] == 0 for r in runs[False])
    for plain, overlapped in zip(runs[False], runs[True]):
        assert plain["losses"] == overlapped["losses"]
        for fqn, t in plain["params"].items():
            assert torch.equal(bits(t), bits(overlapped["params"][fqn])), fqn


def _overlap_state_dict_rank(rank: int, world_size: int) -> dict[str, Any]:
    sc = Scenario(world_size=world_size, steps=2)
    model = sc.model()
    opt = DistributedOptimizer(model, dataclasses.replace(sc.config(), overlap_param_gather=True))
    tokens, targets = sc.batches()
    model(tokens[0, 0, rank], targets[0, 0, rank], False).backward()
    opt.step()
    in_flight = opt.shard_state.gathers_in_flight
    saved = {k: v.clone() for k, v in model.state_dict().items()}  # as torch.save would read
    left = opt.shard_state.gathers_in_flight
    opt.shard_state.finish_param_sync()
    return {"in_flight": in_flight, "left": left, "saved": saved, "params": param_copies(model)}


def test_model_state_dict_after_an_overlapped_step_holds_the_updated_params(tmp_path):
    """model.state_dict() (torch.save, logging, an export) right after step() waits for the
    all-gathers that step() left in flight instead of reading half-gathered params."""
    for r in run_distributed(_overlap_state_dict_rank, 2, tmp_path=tmp_path):
        assert r["in_flight"] > 0 and r["left"] == 0
        for fqn, t in r["params"].items():
            assert torch.equal(bits(r["saved"][fqn]), bits(t)), fqn
