"""OptimizerConfig: invalid values refused, defaults and the JSON round trip the manifest uses."""

import pytest

from shardopt import OptimizerConfig


@pytest.mark.parametrize(
    "kwargs",
    [dict(lr=-1.0), dict(lr=float("nan")), dict(lr=float("inf")), dict(betas=(0.9,)),
     dict(betas=(1.0, 0.9)), dict(betas=(0.9, -0.1)), dict(eps=0.0), dict(eps=-1e-8),
     dict(weight_decay=-0.1), dict(max_grad_norm=-1.0), dict(bucket_numel=0),
     dict(bucket_numel=2.5), dict(align_numel=0), dict(align_numel=-8),
     dict(grad_mode="param"), dict(grad_mode=None)],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_config_rejects_invalid_values(kwargs):
    with pytest.raises(ValueError):
        OptimizerConfig(**kwargs)


def test_config_accepts_defaults_and_round_trips():
    cfg = OptimizerConfig(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0)
    assert OptimizerConfig.from_dict(cfg.to_dict()) == cfg
    assert OptimizerConfig(max_grad_norm=None).max_grad_norm is None
    assert OptimizerConfig().grad_mode == "torch" and OptimizerConfig().param_grads
    buffer = OptimizerConfig(grad_mode="buffer")
    assert OptimizerConfig.from_dict(buffer.to_dict()) == buffer and not buffer.param_grads
