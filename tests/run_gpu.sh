#!/usr/bin/env bash
# The GPU suite of tests (`make test-gpu` runs this): every case conftest marks `gpu` (the
# cuda-marked ones, NCCL cases among them, and the Triton step's), with compiled Triton
# (TRITON_INTERPRET unset: conftest sets it only where there is no GPU), ending in pytest's
# summary of skips and failures with their reasons. No venv needed: PY (default python3) is
# whatever has torch. Cases needing more GPUs than the host has are skipped, naming how many.
#
#     PY=python3 bash tests/run_gpu.sh [LOG]     # from the repository root; LOG keeps a copy
set -uo pipefail
PY=${PY:-python3}
LOG=${1:-/dev/null}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast stays off on shared hosts
unset TRITON_INTERPRET
"$PY" -c 'import sys, torch; sys.exit(None if torch.cuda.is_available() else
          "test-gpu: torch sees no CUDA device")' || exit 2
"$PY" -m pytest -m gpu -p no:cacheprovider -q -rsfE --durations=10 tests 2>&1 | tee "$LOG"
