#!/usr/bin/env bash
# session 3, call 1: GPU tests of the final code, int8 step profile, async stall diagnostics
set -u
export PYTHONPATH=src NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.used --format=csv
t0=$(date +%s)
timeout 260 env PY=python3 bash tests/run_gpu.sh $OUT/pytest_gpu.txt > /dev/null 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -5 $OUT/pytest_gpu.txt
t0=$(date +%s)
timeout 100 python3 benchmarks/optimizer_step.py --repeats 20 --profile-steps 3 --out $OUT --exp-avg-dtype int8 --exp-avg-sq-dtype int8 > $OUT/step_int8.log 2>&1; echo "step rc=$? $(( $(date +%s)-t0 ))s"; tail -25 $OUT/step_int8.log
t0=$(date +%s)
timeout 120 python3 benchmarks/async_breakdown.py --saves 2 --gap 8 --modes write --out $OUT > $OUT/breakdown.log 2>&1; echo "breakdown rc=$? $(( $(date +%s)-t0 ))s"; grep -v "^baseline" $OUT/breakdown.log | tail -12
t0=$(date +%s)
timeout 150 python3 benchmarks/async_save.py --dirs /dev/shm --accumulate 3 --systems shardopt,shardopt_device --sparse-every 8 --sparse-saves 3 --every-iters 6 --budget-s 140 --tag _acc3 --out $OUT > $OUT/async_acc3.log 2>&1; echo "async rc=$? $(( $(date +%s)-t0 ))s"; grep "^\[" $OUT/async_acc3.log
