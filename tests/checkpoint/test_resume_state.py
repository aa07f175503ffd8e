"""Optimizer state beyond the tensors that a load restores: hyperparameters, where moments live."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint
from shardopt.pinned import PinnedBuffer


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
    assert opt2.shard_state.held["exp_avg.0"].where == "staged"
    staged = [h.host for h in opt2.shard_state.held.values() if h.kind == "moments"]
    for t in staged:
        assert t.device.type == "cpu" and t.is_pinned() == (device == "cuda")
    if device == "cuda":  # before the first step the GPU holds what a fresh run holds
        fresh_model, fresh_opt = make()
        assert opt2.memory_bytes() == fresh_opt.memory_bytes()
    torch.manual_seed(1)
    train_step(model, opt)
    torch.manual_seed(1)
    train_step(model2, opt2)
    moments = [h for h in opt2.shard_state.held.values() if h.kind == "moments"]
    assert moments and all(h.where == "device" and h.host is None for h in moments)
    for h in moments:
        assert h.tensor.device == opt2.shard_state.device
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    if device == "cuda":  # the host copies were unlocked once they had reached the device
        assert all(not t.is_pinned() for t in staged)


@pytest.mark.cuda
def test_pinned_buffer_locks_exactly_its_size_and_unlocks():
    """Not the caching host allocator, which would round 3 MiB + 4 bytes up to 4 MiB."""
    numel = (3 << 20) // 4 + 1
    buf = PinnedBuffer(numel, torch.float32)
    assert buf.pinned and buf.tensor.is_pinned() and buf.tensor.numel() == numel
    view = buf.tensor[1:]
    src = torch.arange(numel, dtype=torch.float32)
    buf.tensor.copy_(src)
    out = buf.tensor.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    buf.release()
    buf.release()  # idempotent
    assert not buf.pinned and not view.is_pinned()
    assert torch.equal(out.cpu(), src) and torch.equal(view, src[1:])  # memory stays valid


def test_malformed_saved_hyperparameter_is_refused_before_anything_changes(tmp_path):
    import json

    from shardopt.checkpoint.format import manifest_checksum

    model = nn.Linear(3, 2)
    opt = DistributedOptimizer(model, OptimizerConfig(lr=0.5))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    path = checkpoint.save(tmp_path, model, opt, step=1)
    manifest_path = tmp_path / "step_00000001" / "manifest.json"
    m = json.loads(manifest_path.read_text())
    for fqn in ("weight", "bias"):
        m["params"][fqn]["group"]["lr"] = "fast"
    m["checksum"] = manifest_checksum(m)
    manifest_path.write_text(json.dumps(m))
    model2 = nn.Linear(3, 2)
    opt2 = DistributedOptimizer(model2, OptimizerConfig(lr=1.0))
    before = [p.detach().clone() for p in model2.parameters()]
    with pytest.raises(ValueError, match=r"lr='fast' of '(weight|bias)' is malformed"):
        checkpoint.load(path, model2, opt2)
    with pytest.raises(ValueError, match=r"lr='fast' of '(weight|bias)' is malformed"):
        checkpoint.verify(path)  # the same validation
    assert all(torch.equal(a, b) for a, b in zip(before, model2.parameters()))
    assert opt2.param_groups[0]["lr"] == 1.0


@pytest.mark.parametrize("before, after", [
    (None, lambda fqn, p: {"weight_decay": 0.0} if fqn.endswith("bias") else {}),  # split
    (lambda fqn, p: {"weight_decay": 0.0} if fqn.endswith("bias") else {}, None),  # merged
])
def test_resume_with_another_param_grouping_is_an_error_or_an_explicit_override(
        tmp_path, before, after):
    """Restoring the saved values into regrouped params would silently undo the new
    param_group_fn (or keep values the checkpoint contradicts): refused unless asked for."""
    def make(fn):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
        return model, DistributedOptimizer(model, OptimizerConfig(lr=0.1, weight_decay=0.1),
                                           param_group_fn=fn)

    model, opt = make(before)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    checkpoint.save(tmp_path, model, opt, step=1)
    model2, opt2 = make(after)
    fresh = [p.detach().clone() for p in model2.parameters()]
    wanted = [dict(g) for g in opt2.param_groups]
    with pytest.raises(checkpoint.CheckpointError, match=r"'0\.(weight|bias)' and "
                       r"'0\.(weight|bias)'.*param_group_fn.*hyperparameters='current'"):
        checkpoint.load(tmp_path, model2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(fresh, model2.parameters()))
    checkpoint.load(tmp_path, model2, opt2,
                    config=checkpoint.CheckpointConfig(hyperparameters="current"))
    assert [dict(g) for g in opt2.param_groups] == wanted
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert opt2.param_steps == opt.param_steps
