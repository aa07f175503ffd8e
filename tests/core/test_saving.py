"""A model trained with shardopt saves through the ecosystem's savers, every weight at its own
size, and loads back bit for bit: ``safetensors.torch.save_model``, ``model.save_pretrained``
(transformers), Accelerate's ``save_model``, ``torch.save(submodule.state_dict())``.

The params are views of the optimizer's flat buffers; ``model.state_dict()`` hands out copies
(:mod:`shardopt.model_state`), tied weights one copy for both names, and
``state_dict(keep_vars=True)`` the live params."""

from __future__ import annotations

import io
import os

import pytest
import torch
from torch import nn

from helpers.checks import bits
from shardopt import DistributedOptimizer, OptimizerConfig


VOCAB = 2000  # the embedding dwarfs the other weights of its buffer


class Mixed(nn.Module):
    """bf16 and fp32 params, a tied head, a buffer and a frozen param."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16).to(torch.bfloat16)
        self.norm = nn.LayerNorm(16)
        self.body = nn.Linear(16, 16).to(torch.bfloat16)
        self.head = nn.Linear(16, VOCAB, bias=False).to(torch.bfloat16)
        self.head.weight = self.emb.weight
        self.frozen = nn.Linear(16, 4)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(tokens).float())
        h = self.body(h.to(torch.bfloat16)).float() * self.scale + self.frozen(h).sum(-1, True)
        return self.head(h.to(torch.bfloat16)).float()


def trained(model: nn.Module, steps: int = 2) -> DistributedOptimizer:
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-2))
    for step in range(steps):
        tokens = torch.randint(VOCAB, (3, 7), generator=torch.Generator().manual_seed(step))
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, t in want.items():
        assert got[key].dtype == t.dtype and got[key].shape == t.shape, key
        assert torch.equal(bits(got[key]), bits(t)), key


def test_state_dict_tensors_own_their_storage():
    torch.manual_seed(0)
    model = Mixed()
    opt = trained(model)
    sd = model.state_dict()
    buffers = {h.device.untyped_storage().data_ptr() for h in opt.shard_state.held.values()
               if h.kind == "params"}
    for key, t in sd.items():
        assert t.untyped_storage().data_ptr() not in buffers, key
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), key
    # tied weights: one copy for both names, as torch's entries share the param's storage
    assert sd["emb.weight"].untyped_storage().data_ptr() == \
        sd["head.weight"].untyped_storage().data_ptr()
    live = model.state_dict(keep_vars=True)
    assert live["body.weight"] is model.body.weight
    # Copies: editing the state dict leaves the model alone; load_state_dict writes it.
    sd["body.bias"].add_(1)
    assert not torch.equal(sd["body.bias"], model.body.bias)
    before = opt.shard_state.param_writes
    model.load_state_dict(sd)
    assert torch.equal(model.body.bias, sd["body.bias"]) and opt.shard_state.param_writes == before
    again = model.state_dict()
    assert again["body.bias"] is not sd["body.bias"]  # a new call: new copies


def test_torch_save_of_a_submodule_writes_its_own_weights_only(tmp_path):
    torch.manual_seed(0)
    model = Mixed()
    opt = trained(model)  # noqa: F841 - held: the params stay the optimizer's
    out = io.BytesIO()
    torch.save(model.body.state_dict(), out)
    own = sum(p.numel() * p.element_size() for p in model.body.parameters())
    assert len(out.getvalue()) < own + 4096  # the weights plus pickle framing
    out.seek(0)
    assert_same(torch.load(out, weights_only=True), weights(model.body))


def test_safetensors_save_model_round_trip(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    model = Mixed()
    opt = trained(model)  # noqa: F841 - held: the params stay the optimizer's
    want = weights(model)
    path = str(tmp_path / "model.safetensors")
    st.save_model(model, path)
    torch.manual_seed(1)
    fresh = Mixed()
    missing, unexpected = st.load_model(fresh, path)
    assert not unexpected
    assert_same(weights(fresh), want)
    loaded = st.load_file(path)
    assert {"emb.weight", "body.weight", "body.bias", "norm.weight", "scale"} <= loaded.keys()


def test_accelerate_save_model_round_trip(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    st = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    model = Mixed()
    opt = trained(model)  # noqa: F841 - held: the params stay the optimizer's
    want = weights(model)
    accelerate.Accelerator(cpu=True).save_model(model, str(tmp_path))
    files = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    loaded = {}
    for name in files:
        loaded.update(st.load_file(str(tmp_path / name)))
    # Every weight but the tied head (saved once, under one of its names), at its own size.
    expected = {k for k in want if k != "head.weight"}
    assert expected <= loaded.keys() <= set(want)
    for key in loaded:
        assert torch.equal(bits(loaded[key]), bits(want[key])), key


def test_transformers_save_pretrained_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-2))
    for step in range(2):
        ids = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    want = weights(model)
    model.save_pretrained(str(tmp_path))
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path))
    assert_same(weights(back), want)
    assert back.lm_head.weight is back.transformer.wte.weight
    size = sum(os.path.getsize(tmp_path / f) for f in os.listdir(tmp_path)
               if f.endswith(".safetensors"))
    own = sum(p.numel() * p.element_size() for p in model.parameters())  # the tie once
    assert own <= size < own + 64 * 1024


def test_state_dict_while_offloaded_is_refused_and_a_copied_model_still_saves():
    """model.state_dict() reads the params to copy them: while they are offloaded (their
    storage empty on a GPU) it raises instead. A deep copy of the model (its params share
    one copied storage) keeps the hook and hands out copies too."""
    import copy

    from shardopt.errors import OffloadError

    torch.manual_seed(0)
    model = Mixed()
    opt = trained(model)
    want = weights(model)
    opt.offload()
    with pytest.raises(OffloadError, match=r"model.state_dict\(\).*onload\(\)"):
        model.state_dict()
    opt.onload()
    assert_same({k: v for k, v in model.state_dict().items()}, want)
    twin = copy.deepcopy(model)
    sd = twin.state_dict()
    assert_same(sd, want)
    for key, t in sd.items():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), key
