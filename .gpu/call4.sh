#!/usr/bin/env bash
# session 3, call 4: GPU tests with the writer process; GIL probe process vs threads; async stall at 1 and 3 micro-batches
set -u
export PYTHONPATH=src NCCL_NVLS_ENABLE=0
L=$OUT/call4.log
t0=$(date +%s)
timeout 200 env PY=python3 bash tests/run_gpu.sh $OUT/pytest_gpu.txt > /dev/null 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -4 $OUT/pytest_gpu.txt
t0=$(date +%s)
timeout 100 python3 benchmarks/writer_gil.py --snapshots host --writers process,threads --saves 2 --out $OUT >> $L 2>&1; echo "gil rc=$? $(( $(date +%s)-t0 ))s"; grep "save [12]\]" $L
t0=$(date +%s)
timeout 100 python3 benchmarks/async_breakdown.py --saves 2 --gap 6 --modes write --snapshots host,device --out $OUT >> $L 2>&1; echo "breakdown rc=$? $(( $(date +%s)-t0 ))s"; grep "^write" $L | grep -v parts
t0=$(date +%s)
timeout 170 python3 benchmarks/async_save.py --dirs /dev/shm,/tmp --accumulate 3 --systems shardopt,shardopt_device --sparse-every 6 --sparse-saves 5 --every-iters 6 --budget-s 160 --tag _acc3 --out $OUT >> $L 2>&1; echo "async3 rc=$? $(( $(date +%s)-t0 ))s"; grep "^\[sparse\|^\[every\|skipped" $L
t0=$(date +%s)
timeout 110 python3 benchmarks/async_save.py --dirs /dev/shm --systems shardopt,shardopt_device --sparse-every 15 --sparse-saves 4 --every-iters 10 --budget-s 100 --out $OUT >> $L 2>&1; echo "async1 rc=$? $(( $(date +%s)-t0 ))s"; grep "^\[sparse\|^\[every\|skipped" $L | tail -4
