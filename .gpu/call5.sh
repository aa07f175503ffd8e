#!/usr/bin/env bash
# session 3, call 5: async saves with the writer process fixed: stall at 3 and 1 micro-batches
set -u
export PYTHONPATH=src NCCL_NVLS_ENABLE=0
L=$OUT/call5.log
t0=$(date +%s)
timeout 60 python3 -m pytest -m gpu -p no:cacheprovider -q -rsfE tests/test_async_save.py > $OUT/pytest_gpu_async.txt 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -2 $OUT/pytest_gpu_async.txt
t0=$(date +%s)
timeout 125 python3 benchmarks/async_save.py --dirs /dev/shm --accumulate 3 --systems shardopt,shardopt_device --sparse-every 6 --sparse-saves 5 --every-iters 5 --budget-s 115 --tag _acc3 --out $OUT >> $L 2>&1; echo "async3 rc=$? $(( $(date +%s)-t0 ))s"; grep "^\[sparse\|^\[every\|skipped" $L
t0=$(date +%s)
timeout 95 python3 benchmarks/async_save.py --dirs /dev/shm --systems shardopt,shardopt_device --sparse-every 15 --sparse-saves 4 --every-iters 8 --budget-s 85 --out $OUT >> $L 2>&1; echo "async1 rc=$? $(( $(date +%s)-t0 ))s"; grep "^\[sparse\|^\[every\|skipped" $L | tail -5
