"""Optimizer state beyond the tensors that a load restores: hyperparameters, where moments live."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint


def test_load_restores_param_group_hyperparameters(tmp_path):
    """Like torch's load_state_dict: a resumed run continues with the saved lr, betas, ..."""
    def make():
        model = nn.Linear(3, 2)
        opt = DistributedOptimizer(model, OptimizerConfig(lr=1.0),
                                   param_group_fn=lambda fqn, p: {"weight_decay": 0.0}
                                   if fqn.endswith("bias") else {})
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e)

    model, opt, sched = make()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()
    opt.param_groups[0]["betas"] = (0.8, 0.9)
    checkpoint.save(tmp_path, model, opt, step=1, extra={"sched": sched.state_dict()})
    model2, opt2, sched2 = make()
    sched2.load_state_dict(checkpoint.load(tmp_path, model2, opt2).extra["sched"])
    for g, g2 in zip(opt.param_groups, opt2.param_groups):
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert g[key] == g2[key], key
    assert opt2.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_low_memory_resume_moves_moments_to_the_device_at_the_first_step(tmp_path, device):
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)).to(device)
        model[0].to(torch.bfloat16)
        return model, DistributedOptimizer(model, OptimizerConfig(lr=1e-2, bucket_numel=32))

    def train_step(model, opt):
        x = torch.randn(4, 8, device=device)
        model[2](model[1](model[0](x.bfloat16()).float())).square().mean().backward()
        opt.step()
        opt.zero_grad()

    model, opt = make()
    train_step(model, opt)
    checkpoint.save(tmp_path, model, opt, step=1)
    model2, opt2 = make()
    checkpoint.load(tmp_path, model2, opt2, low_memory_resume=True)
    assert opt2._exp_avg is None and opt2._staged_moments is not None
    for t in opt2._staged_moments[0] + opt2._staged_moments[1]:
        assert t.device.type == "cpu" and t.is_pinned() == (device == "cuda")
    if device == "cuda":  # before the first step the GPU holds what a fresh run holds
        fresh_model, fresh_opt = make()
        assert opt2.memory_bytes() == fresh_opt.memory_bytes()
    torch.manual_seed(1)
    train_step(model, opt)
    torch.manual_seed(1)
    train_step(model2, opt2)
    assert opt2._staged_moments is None
    for t in opt2._exp_avg + opt2._exp_avg_sq:
        assert t.device == opt2.device
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
