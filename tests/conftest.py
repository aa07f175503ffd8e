"""Shared test configuration: GPU markers, the backend parameter, hypothesis profiles.

* ``@pytest.mark.cuda`` / ``@pytest.mark.cuda(2)``: skip unless at least that many
  CUDA devices are visible (default 1).
* ``backend`` fixture: ``"gloo"`` everywhere, ``"nccl"`` only with CUDA. A test that
  takes it runs unchanged on both; ``require_world_size`` (in ``_dist``) skips a
  case that needs more GPUs than the machine has.
* Without CUDA, Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``).
* Hypothesis: profile ``ci`` (picked when ``CI=true``) runs fewer examples;
  ``dev`` is the default; ``HYPOTHESIS_PROFILE`` overrides both. No deadlines:
  timings on a loaded 2-core machine are noise, not failures.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile("thorough", max_examples=2000, deadline=None)

# Without a GPU, Triton kernels (shardopt.kernels) run in Triton's interpreter; the flag is
# read when a kernel is defined, so before shardopt is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if _ci else "dev"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda(min_gpus=1): needs CUDA GPUs (skipped without them)")
    config.addinivalue_line("markers", "slow: longer multi-process tests")


def _min_gpus(marker: pytest.Mark) -> int:
    if marker.args:
        return int(marker.args[0])
    return int(marker.kwargs.get("min_gpus", 1))


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("cuda")
    if marker is None:
        return
    need = _min_gpus(marker)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < need:
        pytest.skip(f"needs {need} CUDA device(s), found {have}")


@pytest.fixture(params=["gloo", pytest.param("nccl", marks=pytest.mark.cuda)])
def backend(request: pytest.FixtureRequest) -> str:
    """Process-group backend: gloo on CPU always, NCCL on GPUs when there are any."""
    return request.param
