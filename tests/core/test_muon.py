"""Muon in the sharded optimizer against ``torch.optim.Muon`` + ``torch.optim.AdamW``.

Tolerances. Where the same kernels run in the same order the results are bit for bit
torch's: each rank's averaged gradients replayed through torch's optimizers on a full
replica give the same params at every DP size (the owner runs torch's lerp, Newton-Schulz,
weight decay and add on the same fp32 values; AdamW is torch's fused kernel either way).
Only against the full global batch do the gradients differ, in the last bits (the ranks
average per-rank gradients, the replica accumulates per-slice ones on more threads).
Newton-Schulz rounds its input to bf16, as torch's does, so such a difference now and then
flips a bf16 rounding, which moves that matrix's orthogonalised update (elements below 1)
by about one bf16 step, 2**-8: the params then differ by up to the largest adjusted
learning rate times 2**-8 per step, ``ATOL_FULL_BATCH`` over five steps.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shardopt
from helpers.dist import run_distributed
from helpers.muon import (MuonNet, config, groups, local, muon_fqns, reference_run, replay,
                          scheduler, train_muon, uses_branch)
from shardopt import DistributedOptimizer, OptimizerConfig, UsageError, muon
from shardopt.layout import ParamSpec, Range, build_layout

# The largest adjusted learning rate of helpers.muon's groups is the 40 x 16 matrix's.
ATOL_FULL_BATCH = 5 * muon.adjusted_lr(0.02, None, (40, 16)) * 2**-8


# ------------------------------------------------------------------------- settings
def test_settings_are_torchs_names_and_defaults():
    signature = inspect.signature(torch.optim.Muon).parameters
    torch_defaults = {k: v.default for k, v in signature.items() if k != "params"}
    assert muon.MuonSettings().group() == {"optimizer": "muon", **torch_defaults}


@pytest.mark.parametrize("shape", [(24, 8), (8, 24), (16, 16), (1, 5), (130, 70)])
def test_newton_schulz_is_torchs_and_a_batch_is_each_matrix(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.Generator().manual_seed(sum(shape))
    xs = torch.randn(3, *shape, generator=g)
    coefficients = muon.MuonSettings().ns_coefficients
    each = [muon.newton_schulz(x, coefficients, 5, 1e-7) for x in xs]
    for x, y in zip(xs, each):
        assert torch.equal(y, _zeropower_via_newtonschulz(x.clone(), coefficients, 5, 1e-7))
    assert torch.equal(muon.newton_schulz(xs, coefficients, 5, 1e-7), torch.stack(each))
    assert torch.equal(xs, torch.randn(3, *shape, generator=torch.Generator().manual_seed(
        sum(shape))))  # the input is left as it was


# --------------------------------------------------------------------------- layout
shapes = st.one_of(st.tuples(st.integers(0, 4), st.integers(0, 4)),
                   st.tuples(st.integers(1, 90), st.integers(1, 90)))


@st.composite
def param_lists(draw: st.DrawFn) -> list[ParamSpec]:
    entries = draw(st.lists(st.tuples(shapes, st.sampled_from([torch.bfloat16, torch.float32]),
                                      st.booleans()), max_size=30))
    return [ParamSpec(f"p{i}", shape, dtype, whole) for i, (shape, dtype, whole)
            in enumerate(entries)]


@given(param_lists(), st.integers(1, 8), st.integers(1, 5000), st.sampled_from([1, 4, 64]))
def test_muon_matrices_lie_whole_on_their_owner(specs, dp_size, bucket_numel, align_numel):
    layout = muon.plan_layout(specs, dp_size, bucket_numel, align_numel)
    plain = build_layout([s for s in specs if not s.whole], dp_size, bucket_numel, align_numel)
    assert layout.buffers[:len(plain.buffers)] == plain.buffers  # AdamW's: as without Muon
    whole = [s for s in specs if s.whole]
    owner = muon.assign_owners(whole, dp_size)
    assert {b.dtype for b in layout.buffers[len(plain.buffers):]} == {s.dtype for s in whole}
    shards = [layout.shards(r) for r in range(dp_size)]
    for s in whole:
        slot = layout.slots[s.fqn]
        buf = layout.buffers[slot.buffer_index]
        assert buf.whole and buf.dtype == s.dtype and slot.shape == s.shape
        bucket = buf.buckets[slot.bucket_index]
        own = bucket.shard_range_global(owner[s.fqn])
        assert own.start <= slot.range_global.start and slot.range_global.end <= own.end
        held = [r for r in range(dp_size) if any(x.fqn == s.fqn for x in shards[r])]
        assert held == ([owner[s.fqn]] if s.numel else [])
        for x in shards[owner[s.fqn]]:
            if x.fqn == s.fqn:
                assert x.range_param == Range(0, s.numel)
    for buf in layout.buffers[len(plain.buffers):]:
        cursor = 0
        for k, bucket in enumerate(buf.buckets):
            assert (bucket.index, bucket.range_global.start) == (k, cursor)
            assert bucket.shard_numel % align_numel == 0 and bucket.shard_numel > 0
            assert bucket.range_global.size == dp_size * bucket.shard_numel
            cursor = bucket.range_global.end
            slots = sorted((layout.slots[f].range_global for f in bucket.param_fqns),
                           key=lambda r: r.start)
            assert all(a.end <= b.start for a, b in zip(slots, slots[1:]))
            # Each shard is as long as its fullest rank's matrices need, and no longer.
            used = [sum(r.size for r in slots if bucket.shard_range_global(q).start <= r.start
                        < bucket.shard_range_global(q).end) for q in range(dp_size)]
            assert bucket.shard_numel == -(-max(max(used), 1) // align_numel) * align_numel
        assert cursor == buf.numel
    assert muon.plan_layout(list(specs), dp_size, bucket_numel, align_numel) == layout


def _model_layout(model: torch.nn.Module, dp_size: int) -> shardopt.layout.Layout:
    fn = shardopt.muon_groups(model)
    specs = [ParamSpec(f, tuple(p.shape), p.dtype, bool(fn(f, p)))
             for f, p in model.named_parameters()]
    return muon.plan_layout(specs, dp_size, OptimizerConfig().bucket_numel, 64)


def _24_layer_models() -> list[tuple[str, torch.nn.Module]]:
    from shardopt.recipes.model import GPT, model_config
    out = [("gpt 1b", GPT(model_config("1b"), device="meta"))]
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5504, num_hidden_layers=24,
                                   num_attention_heads=16, num_key_value_heads=4,
                                   vocab_size=32000)
    with torch.device("meta"):
        out.append(("llama 1b", transformers.LlamaForCausalLM(cfg)))
    return out


def test_newton_schulz_work_is_balanced_on_24_layers():
    """Layout only: the 1.3B GPT preset (24 layers, MoE every 4th) and a 24-layer Llama."""
    for name, model in _24_layer_models():
        muon_numel = sum(p.numel() for f, p in model.named_parameters()
                         if shardopt.muon_groups(model)(f, p))
        assert muon_numel > 0.85 * sum(p.numel() for p in model.parameters()), name
        for dp_size in (4, 8):
            layout = _model_layout(model, dp_size)
            costs = muon.rank_costs(layout)
            assert max(costs) / min(costs) <= 1.10, (name, dp_size, costs)
            padded = sum(b.numel for b in layout.buffers if b.whole)
            assert padded <= 1.05 * muon_numel, (name, dp_size)  # little padding


def test_muon_groups_rule():
    model = MuonNet()
    fn = shardopt.muon_groups(model, lr=0.05)
    chosen = {f for f, p in model.named_parameters() if fn(f, p)}
    assert chosen == {"up.weight", "down.weight", "mix.0.weight", "mix.1.weight",
                      "mix.2.weight", "branch.weight"}  # not emb, head, norm, biases
    assert fn("up.weight", model.up.weight) == {"optimizer": "muon", "lr": 0.05}
    with pytest.raises(ValueError, match="ns_steps"):
        shardopt.muon_groups(model, ns_steps=100)
    with pytest.raises(TypeError):
        shardopt.muon_groups(model, betas=(0.9, 0.9))


# ------------------------------------------------------------ against torch, DP 1 to 4
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_matches_torch_muon_and_adamw_bit_for_bit(world_size, tmp_path):
    """Five steps with a scheduler, two Muon groups, a param without a gradient in step 1
    and with one on some ranks later: the ranks' gradients replayed through torch's
    optimizers give the same params bit for bit, and the full batch's within the
    tolerance of the module docstring."""
    results = run_distributed(train_muon, world_size, 5, {}, tmp_path=tmp_path)
    first = results[0]
    expected, momentum = replay(first["grads"], {})
    for step, (ours, theirs) in enumerate(zip(first["params"], expected)):
        for fqn in theirs:
            assert torch.equal(ours[fqn], theirs[fqn]), (step, fqn)
    for other in results[1:]:  # every rank holds the same params, gradients alike
        assert all(torch.equal(a[f], b[f]) for a, b in zip(other["params"], first["params"])
                   for f in a)
    full, _ = reference_run(5, world_size, {})
    assert max((first["params"][-1][f] - full[f]).abs().max() for f in full) <= ATOL_FULL_BATCH
    # Momentum as torch's Muon keeps it, on the owner alone, which alone orthogonalised.
    assert sorted(f for r in results for f in r["momentum"]) == sorted(momentum)
    for r in results:
        for fqn, buf in r["momentum"].items():
            assert buf.shape == momentum[fqn].shape and torch.equal(buf, momentum[fqn])
        assert sorted(r["momentum"]) == r["owned"]
    got_branch = [any(uses_branch(step, r) for r in range(world_size)) for step in range(1, 6)]
    assert [sum(r["counted"][k] for r in results) for k in range(5)] == [
        len(momentum) - (not got) for got in got_branch]  # "branch": not without a gradient
    assert first["steps"]["branch.weight"] == sum(got_branch)
    assert first["steps"]["up.weight"] == 5


def test_buffer_grad_mode_steps_as_torch_grad_mode(tmp_path):
    torch_mode = run_distributed(train_muon, 3, 3, {}, tmp_path=tmp_path)
    buffer_mode = run_distributed(train_muon, 3, 3, {"grad_mode": "buffer"}, tmp_path=tmp_path)
    for a, b in zip(torch_mode, buffer_mode):
        assert all(torch.equal(a["params"][-1][f], b["params"][-1][f]) for f in a["params"][-1])


def test_clipping_counts_muon_grads(tmp_path):
    cfg = {"max_grad_norm": 0.05}
    results = run_distributed(_clipped, 2, cfg, tmp_path=tmp_path)
    full, norms = reference_run(4, 2, cfg)
    assert results[0]["norms"] == pytest.approx(norms, rel=1e-5)
    assert all(n > 0.05 for n in norms)  # every step was clipped
    assert max((results[0]["params"][f] - full[f]).abs().max() for f in full) <= ATOL_FULL_BATCH


def _clipped(rank: int, world: int, cfg: dict) -> dict:
    model = MuonNet()
    opt = DistributedOptimizer(model, config(**cfg), param_group_fn=groups(model))
    sched = scheduler(opt)
    norms = []
    for step in range(1, 5):
        opt.zero_grad()
        model(*local(step, rank, world), uses_branch(step, rank)).backward()
        opt.step()
        sched.step()
        norms.append(opt.last_grad_norm)
    return {"norms": norms, "params": {f: p.detach().clone() for f, p in model.named_parameters()}}


# --------------------------------------------------------------- state and refusals
def _stepped(steps: int = 2, **cfg) -> tuple[MuonNet, DistributedOptimizer]:
    model = MuonNet()
    opt = DistributedOptimizer(model, config(**cfg), param_group_fn=groups(model))
    for step in range(1, steps + 1):
        opt.zero_grad()
        model(*local(step, 0, 1), uses_branch(step, 0)).backward()
        opt.step()
    return model, opt


def test_state_dict_and_opt_state_show_the_momentum_buffer():
    model, opt = _stepped()
    st = opt.state[model.up.weight]
    assert set(st) == {"step", "offset", "master_param", "momentum_buffer"}
    assert st["momentum_buffer"].shape == model.up.weight.shape
    sd = opt.state_dict()
    entry = sd["state"]["up.weight"]
    assert set(entry) == {"step", "momentum_buffer", "master_param", "param_dtype"}
    assert torch.equal(entry["momentum_buffer"].local, st["momentum_buffer"].view(-1))
    assert "exp_avg" in sd["state"]["up.bias"] and "momentum_buffer" not in sd["state"]["up.bias"]
    group = next(g for g in sd["param_groups"] if "mix.0.weight" in g["params"])
    assert group["optimizer"] == "muon" and group["nesterov"] is False
    # A round trip through load_state_dict, and writes through opt.state, reach the state.
    other, opt2 = _stepped(steps=0)
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.state[other.up.weight]["momentum_buffer"], st["momentum_buffer"])
    opt2.state[other.up.weight]["momentum_buffer"] = torch.ones(model.up.weight.shape)
    assert opt2.state[other.up.weight]["momentum_buffer"].eq(1).all()


def test_state_dict_of_the_other_optimizer_is_refused():
    model, opt = _stepped()
    plain = MuonNet()
    muon_groups = groups(plain)

    def same_groups_in_adamw(fqn, p):  # the same partition into groups, all AdamW
        out = muon_groups(fqn, p)
        return {"lr": out["lr"]} if out.get("optimizer") == "muon" else out
    adamw = DistributedOptimizer(plain, config(), param_group_fn=same_groups_in_adamw)
    with pytest.raises(shardopt.StateDictError,
                       match=r"\(with 'up.weight'\) is Muon's in the state dict but AdamW's"):
        adamw.load_state_dict(opt.state_dict())
    with pytest.raises(shardopt.StateDictError,
                       match=r"\(with 'up.weight'\) is AdamW's in the state dict but Muon's"):
        opt.load_state_dict(adamw.state_dict())


def test_offload_and_onload_bring_the_momentum_back():
    model, opt = _stepped()
    before = {k: v.clone() for k, v in opt.shard_state.sources().items()}
    assert any(k.startswith("momentum_buffer.") for k in before)
    opt.offload()
    assert all(h.where != "device" for k, h in opt.shard_state.held.items()
               if k.startswith("momentum_buffer."))
    opt.onload()
    after = opt.shard_state.sources()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_non_2d_param_and_bad_settings_are_refused_by_name():
    model = MuonNet()
    with pytest.raises(ValueError, match="'up.bias'.*2-D"):
        DistributedOptimizer(model, config(), param_group_fn=lambda f, p: {"optimizer": "muon"})
    with pytest.raises(ValueError, match="'up.weight'.*ns_steps"):
        DistributedOptimizer(model, config(), param_group_fn=lambda f, p: {
            "optimizer": "muon", "ns_steps": 100} if f == "up.weight" else {})
    with pytest.raises(ValueError, match="betas.*'up.weight'"):
        DistributedOptimizer(model, config(), param_group_fn=lambda f, p: {
            "optimizer": "muon", "betas": (0.9, 0.9)} if f == "up.weight" else {})
    with pytest.raises(ValueError, match="lion.*'emb.weight'"):
        DistributedOptimizer(model, config(), param_group_fn=lambda f, p: {"optimizer": "lion"})


def test_a_bad_muon_value_written_into_a_group_is_refused_before_the_step():
    model, opt = _stepped(steps=1)
    weights = {f: p.detach().clone() for f, p in model.named_parameters()}
    group = next(g for g in opt.param_groups if muon.is_muon(g))
    group["momentum"] = -1.0
    model(*local(2, 0, 1), uses_branch(2, 0)).backward()
    with pytest.raises(UsageError, match="momentum"):
        opt.step()
    assert all(torch.equal(p, weights[f]) for f, p in model.named_parameters())


def test_owners_are_the_layout_of_a_real_optimizer():
    model, opt = _stepped(steps=0)
    assert muon_fqns(opt) == {f for f, p in model.named_parameters()
                              if p.dim() == 2 and f not in ("emb.weight", "head.weight")}
    assert {b.whole for b in opt.layout.buffers} == {False, True}
