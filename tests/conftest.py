"""Shared test configuration: GPU markers, the backend parameter, hypothesis profiles.

* ``@pytest.mark.cuda`` / ``@pytest.mark.cuda(2)``: skip unless at least that many
  CUDA devices are visible (default 1). A case parametrized with ``"nccl"`` (the
  ``backend`` fixture, or a fixture of the same values) and a world size (a parameter
  named in :data:`WORLD_SIZE_PARAMS`) needs one GPU per rank, and its skip says so.
* ``backend`` fixture: ``"gloo"`` everywhere, ``"nccl"`` only with CUDA. A test that
  takes it runs unchanged on both; ``require_world_size`` (in ``helpers.dist``) skips a
  case that needs more GPUs than the machine has.
* Without CUDA, Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``).
* ``gpu``: added here to every case ``make test-gpu`` runs (cuda-marked or Triton).
* Fixtures several folders use: ``saved3`` (one checkpoint saved at 3 ranks, per module)
  and ``trained_model`` (``helpers.models.build`` trained 2 steps on one process).
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

from helpers.dist import run_distributed  # noqa: E402 - imports shardopt, so after the flag
from helpers.models import Saved, build, save_three_rank, train  # noqa: E402

_ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if _ci else "dev"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda(min_gpus=1): needs CUDA GPUs (skipped without them)")
    config.addinivalue_line("markers", "slow: longer multi-process tests")
    config.addinivalue_line("markers", "gpu: set by conftest on the cases `make test-gpu` runs")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark what the GPU suite runs: cuda-marked cases, and the Triton step's cases, which
    run compiled on a GPU host and in Triton's interpreter elsewhere."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        module = getattr(item.module, "__name__", "")
        triton = "triton" in params.values() or module == "test_kernels"
        if triton or item.get_closest_marker("cuda") is not None:
            item.add_marker(pytest.mark.gpu)


# Test parameters that are a number of ranks: under NCCL each rank needs its own GPU.
WORLD_SIZE_PARAMS = ("world_size", "load_size", "save_size")


def _min_gpus(item: pytest.Item, marker: pytest.Mark) -> int:
    """GPUs the case needs: the marker's count, or one per rank for an NCCL case, which
    carries the ``cuda`` mark through its ``nccl`` parameter (min 1) whatever its size."""
    need = int(marker.args[0]) if marker.args else int(marker.kwargs.get("min_gpus", 1))
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "nccl" in params.values():
        need = max([need] + [int(params[k]) for k in WORLD_SIZE_PARAMS if k in params])
    return need


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("cuda")
    if marker is None:
        return
    need = _min_gpus(item, marker)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < need:
        pytest.skip(f"needs {need} CUDA device(s), found {have}")


@pytest.fixture(params=["gloo", pytest.param("nccl", marks=pytest.mark.cuda)])
def backend(request: pytest.FixtureRequest) -> str:
    """Process-group backend: gloo on CPU always, NCCL on GPUs when there are any."""
    return request.param


@pytest.fixture(scope="module")
def saved3(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """One checkpoint saved at 3 ranks, with the params and the whole state the ranks held."""
    base = tmp_path_factory.mktemp("saved3")
    root = base / "ckpt"
    results = run_distributed(save_three_rank, 3, str(root), tmp_path=base / "runs")
    shapes = results[0]["shapes"]
    state: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    for r in results:
        for fqn, start, end, tensors in r["state"]:
            numel = shapes[fqn].numel()
            for name, t in tensors.items():
                full = state.setdefault(f"{fqn}.{name}", torch.full((numel,), float("nan")))
                full[start:end] = t
            covered[fqn] = covered.get(fqn, 0) + end - start
    assert covered == {fqn: s.numel() for fqn, s in shapes.items() if fqn != "pos"}
    state = {k: v.view(shapes[k.rsplit(".", 1)[0]]) for k, v in state.items()}
    return Saved(root, root / "step_00000002", results[0]["params"], state, shapes)


@pytest.fixture
def trained_model():
    """``helpers.models.build(0)`` trained 2 steps on one process (no process group)."""
    model, opt = build(0)
    train(model, opt, range(2), 0, 1)
    return model, opt

