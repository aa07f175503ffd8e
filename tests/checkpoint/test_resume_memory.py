"""GPU memory of a resumed run against a fresh one, measured by CUDA's caching allocator.

Each run is its own process (a clean allocator): a fresh run builds the model and optimizer
and trains ``ITERS`` iterations; a resumed run builds them, loads the fresh run's checkpoint
and trains as many. ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` are read
around the load and each iteration (``reset_peak_memory_stats`` before each), so a scaffold
of state built during the load, a second copy kept after it, or moments held on the device
through a forward pass that a fresh run does not hold show up as a higher peak. The model
is mostly optimizer state (its activations are small), so such a copy would be far above
the tolerance below.

The CPU counterparts (``test_checkpoint.test_bitwise_resume``, ``test_resume_state``) check
where the state lives and the optimizer's own byte count; only these tests measure memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers.dist import run_distributed
from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint

ITERS = 3
WIDTH = 2048  # 25M params: 450 MB of weights, grads and state, 200 MB of it moments
# Allocator noise allowed on a peak: 1%, and for reserved memory one more segment of the
# caching allocator's large pool (it rounds requests of 1-10 MiB up to 20 MiB segments).
# One copy of the moments is about 40% of this model's peak, far above either.
SLACK = 0.01
SEGMENT = 20 << 20


class _ToFloat(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


def _build(device: torch.device) -> tuple[nn.Module, DistributedOptimizer]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(WIDTH, WIDTH).to(torch.bfloat16), nn.GELU()]
    # A bf16 body and an fp32 norm, as in LLMs: the mixed-dtype layout is what gets resumed.
    model = nn.Sequential(*layers, _ToFloat(), nn.LayerNorm(WIDTH)).to(device)
    return model, DistributedOptimizer(model, OptimizerConfig(lr=1e-3))


def _iteration(model: nn.Module, opt: DistributedOptimizer, step: int,
               device: torch.device) -> None:
    g = torch.Generator(device=device).manual_seed(step)
    x = torch.randn(8, WIDTH, device=device, dtype=torch.bfloat16, generator=g)
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def _peaks(device: torch.device) -> dict[str, int]:
    torch.cuda.synchronize(device)
    return {"allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.max_memory_reserved(device)}


def _reset(device: torch.device) -> None:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)


def run_rank(rank: int, world_size: int, root: str, mode: str) -> dict[str, Any]:
    """``mode``: ``fresh`` (trains, then saves) or ``default`` / ``low_memory`` (loads that
    save, then trains). Peaks per phase: ``load`` (resumed only) and ``iter1`` ... ."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model, opt = _build(device)
    out: dict[str, Any] = {}
    first = 0
    if mode != "fresh":
        _reset(device)
        info = checkpoint.load(root, model, opt, low_memory_resume=mode == "low_memory")
        out["load"] = _peaks(device)
        out["held_after_load"] = torch.cuda.memory_allocated(device)
        first = info.step
    for i in range(ITERS):
        _reset(device)
        _iteration(model, opt, first + i, device)
        out[f"iter{i + 1}"] = _peaks(device)
    if mode == "fresh":
        checkpoint.save(root, model, opt, step=ITERS)
    out["params"] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("resume-memory")
    root = str(tmp / "ckpt")
    out = {}
    for mode in ("fresh", "default", "low_memory"):
        out[mode] = run_distributed(run_rank, 1, root, mode, backend=None,
                                    tmp_path=Path(tmp) / mode)[0]
    return out


def _within(got: int, limit: int, kind: str) -> bool:
    return got <= limit * (1 + SLACK) + (SEGMENT if kind == "reserved" else 0)


def _report(runs: dict, mode: str, kind: str) -> str:
    phases = [p for p in ("load", *(f"iter{i + 1}" for i in range(ITERS))) if p in runs[mode]]
    return f"{mode} {kind} MiB: " + ", ".join(
        f"{p}={runs[mode][p][kind] / 2**20:.1f}" for p in phases) + "; fresh: " + ", ".join(
        f"iter{i + 1}={runs['fresh'][f'iter{i + 1}'][kind] / 2**20:.1f}" for i in range(ITERS))


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["allocated", "reserved"])
def test_default_resume_peaks_no_higher_than_a_fresh_run(runs, kind):
    """Load + the first iterations stay within the fresh run's peak over its iterations
    (after its first step a fresh run holds its moments through every forward pass too)."""
    fresh_peak = max(runs["fresh"][f"iter{i + 1}"][kind] for i in range(ITERS))
    resumed = runs["default"]
    for phase in ("load", *(f"iter{i + 1}" for i in range(ITERS))):
        assert _within(resumed[phase][kind], fresh_peak, kind), _report(runs, "default", kind)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["allocated", "reserved"])
def test_low_memory_resume_peaks_as_a_fresh_run_each_iteration(runs, kind):
    """Iteration k of the resumed run peaks no higher than iteration k of the fresh run: the
    moments reach the device inside the first step, where a fresh run allocates them; the
    load itself stays below the fresh run's first iteration."""
    fresh, resumed = runs["fresh"], runs["low_memory"]
    assert _within(resumed["load"][kind], fresh["iter1"][kind], kind), \
        _report(runs, "low_memory", kind)
    for i in range(ITERS):
        phase = f"iter{i + 1}"
        assert _within(resumed[phase][kind], fresh[phase][kind], kind), \
            _report(runs, "low_memory", kind)


@pytest.mark.cuda
def test_low_memory_resume_holds_less_than_a_default_one_before_the_first_step(runs):
    """The measurement tells the two apart: after a default load the device holds the
    moments (8 bytes per param), after a low-memory load it does not."""
    moments = 8 * sum(v.numel() for v in runs["fresh"]["params"].values())
    gap = runs["default"]["held_after_load"] - runs["low_memory"]["held_after_load"]
    assert moments <= gap <= moments * (1 + SLACK), f"{gap} bytes apart, moments are {moments}"
