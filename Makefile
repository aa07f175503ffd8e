# Developer entry points. `make test` is what CI runs (.ci/run).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Pin the exact release: a looser spec lets pip pick a multi-GB CUDA build.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed
PYTEST_FLAGS ?= -q -ra --durations=10

.PHONY: venv test test-gpu demo clean

venv: $(STAMP)

# Rebuilt only when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test,plot]'
	touch $(STAMP)

test: venv
	$(PY) -m pytest $(PYTEST_FLAGS)

# The GPU suite: every test marked `gpu` by conftest (the cuda-marked ones, NCCL cases among
# them, and the Triton ones), with compiled Triton (TRITON_INTERPRET unset; conftest sets it only
# without a GPU), ending in pytest's summary of skips and failures with their reasons. Uses no
# venv, so it runs where torch is installed system-wide: `make test-gpu PY=python3`. Cases that
# need more GPUs than the host has are skipped, naming the count they need. GPU_LOG keeps a copy.
GPU_LOG ?= /dev/null
GPU_ENV := env -u TRITON_INTERPRET NCCL_NVLS_ENABLE=0 PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH}
test-gpu: SHELL := /bin/bash
test-gpu:
	$(GPU_ENV) $(PY) -c 'import sys, torch; sys.exit(None if torch.cuda.is_available() \
	  else "test-gpu: torch sees no CUDA device")'
	set -o pipefail; $(GPU_ENV) $(PY) -m pytest -m gpu -p no:cacheprovider -q -rsfE \
	  --durations=10 tests 2>&1 | tee $(GPU_LOG)

demo: venv
	$(PY) -m shardopt.cli demo

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
