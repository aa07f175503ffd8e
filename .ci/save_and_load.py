"""A save, a load, a verify and an export with only what `pip install .` installs.

Run by `make install-check` (.ci/run) from outside the source tree, in a fresh virtual
environment: an import or a dependency the package uses but does not declare fails here.
"""

import tempfile
from pathlib import Path

import torch

import shardopt
from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint

assert "site-packages" in shardopt.__file__, f"not the installed package: {shardopt.__file__}"


def trained(seed: int) -> tuple[torch.nn.Module, DistributedOptimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16)).bfloat16()
    model[1].float()  # bf16 params with an fp32 main copy, and fp32 ones
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-2))
    model[1](model[0](torch.randn(4, 8, dtype=torch.bfloat16)).float()).sum().backward()
    opt.step()
    return model, opt


with tempfile.TemporaryDirectory() as tmp:
    model, opt = trained(0)
    path = checkpoint.save(Path(tmp) / "ckpt", model, opt, step=1, extra={"pos": 7})
    other, other_opt = trained(1)
    info = checkpoint.load(Path(tmp) / "ckpt", other, other_opt)
    assert (info.step, info.extra) == (1, {"pos": 7})
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    checkpoint.verify(path)
    checkpoint.export(path, Path(tmp) / "export")
print(f"fresh install of shardopt {shardopt.__version__} with torch {torch.__version__}: save, "
      "load, verify and export work")
