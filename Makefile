# Developer entry points. `make test` is what CI runs (.ci/run).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Pin the exact release: a looser spec lets pip pick a multi-GB CUDA build.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed
PYTEST_FLAGS ?= -q -ra --durations=10

.PHONY: venv test test-gpu install-check demo clean

venv: $(STAMP)

# Rebuilt only when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test,plot]'
	touch $(STAMP)

test: venv
	$(PY) -m pytest $(PYTEST_FLAGS)

# The README's install alone (`pip install .`, no extras) into a fresh virtual environment, then
# a save and a load from outside the source tree: a dependency the package needs but does not
# declare fails here (the test venv's extras would bring it in and hide it).
install-check:
	set -e; venv=$$(mktemp -d /tmp/shardopt-install-check.XXXXXX); trap 'rm -rf "$$venv"' EXIT; \
	$(PYTHON) -m venv "$$venv"; \
	"$$venv/bin/python" -m pip install --quiet $(TORCH); \
	"$$venv/bin/python" -m pip install --quiet .; \
	cd "$$venv" && "$$venv/bin/python" "$(CURDIR)/.ci/save_and_load.py"

# The GPU tests (cuda-marked and Triton, compiled, NCCL where it applies; see tests/run_gpu.sh).
# No venv: `make test-gpu PY=python3` where torch is installed system-wide; GPU_LOG keeps a copy.
GPU_LOG ?= /dev/null
test-gpu:
	PY=$(PY) bash tests/run_gpu.sh $(GPU_LOG)

demo: venv
	$(PY) -m shardopt.cli demo

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
