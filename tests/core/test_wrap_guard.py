"""A model wrapped in DistributedDataParallel or deep-copied after the optimizer was built is a
loud error (:mod:`shardopt.wrap_guard`), and the error recommends nothing that trains wrongly;
the unwrapped model, DataParallel-style callers and a pickled model are left alone."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from helpers.dist import run_distributed
from shardopt import DistributedOptimizer, OptimizerConfig
from shardopt.errors import WrappedModelError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _ddp_after_build(rank: int, world_size: int) -> dict:
    model = _model()
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-2))
    out = {}
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    try:
        wrapped(torch.randn(2, 4)).sum().backward()
        out["ddp"] = None
    except WrappedModelError as e:
        out["ddp"] = str(e)
    # A DDP over another module, whose forward calls ours, reduces none of our grads.
    other = torch.nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    other.module.register_forward_hook(lambda m, a, y: model(y))
    other(torch.randn(2, 4))
    # Unwrapped, the model trains.
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    out["stepped"] = True
    return out


def test_ddp_wrapped_after_building_raises_at_the_first_forward(tmp_path):
    results = run_distributed(_ddp_after_build, 2, tmp_path=tmp_path)
    for r, out in enumerate(results):
        msg = out["ddp"]
        assert msg is not None and msg.startswith(f"[dp rank {r}]")
        assert "DistributedDataParallel" in msg
        for adapter in ("ShardoptStrategy", "integrations.accelerate.prepare", "ShardoptTrainer"):
            assert adapter in msg
        assert "overlap_grad_reduce" not in msg  # that setting trains DDP on near-zero grads
        assert out["stepped"]


def test_a_deep_copy_trained_in_place_of_the_model_raises_at_step():
    model = _model()
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-2))
    twin = copy.deepcopy(model)
    twin(torch.randn(2, 4)).sum().backward()
    with pytest.raises(WrappedModelError, match=r"param '2.bias' of a deep copy"):
        opt.step()
    # The model's own gradients make the step fine, and the note is gone after a step.
    twin(torch.randn(2, 4)).sum().backward()
    model(torch.randn(2, 4)).sum().backward()
    before = model[0].weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model[0].weight)
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()


def test_a_copy_used_without_gradients_and_a_pickled_model_pass():
    model = _model()
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-2))
    ema = copy.deepcopy(model)
    with torch.no_grad():
        ema(torch.randn(2, 4))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded(torch.randn(2, 4)).sum().backward()  # its hook checks nothing
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
