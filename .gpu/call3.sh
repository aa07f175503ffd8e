#!/usr/bin/env bash
# session 3, call 3: GPU tests after the offload/save fix; device snapshot drained in bulk; async stall at 1 and 3 micro-batches
set -u
export PYTHONPATH=src NCCL_NVLS_ENABLE=0
L=$OUT/call3.log
t0=$(date +%s)
timeout 200 env PY=python3 bash tests/run_gpu.sh $OUT/pytest_gpu.txt > /dev/null 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -4 $OUT/pytest_gpu.txt
t0=$(date +%s)
timeout 110 python3 benchmarks/async_breakdown.py --saves 2 --gap 6 --modes write --snapshots host,device,device_staged --out $OUT >> $L 2>&1; echo "breakdown rc=$? $(( $(date +%s)-t0 ))s"; grep "^write" $L | grep -v parts
t0=$(date +%s)
timeout 90 python3 benchmarks/writer_gil.py --snapshots host,device --saves 2 --out $OUT >> $L 2>&1; echo "gil rc=$? $(( $(date +%s)-t0 ))s"; grep "save [12]\]" $L
t0=$(date +%s)
timeout 230 python3 benchmarks/async_save.py --dirs /dev/shm --accumulate 3 --systems shardopt,shardopt_device,dcp --sparse-every 6 --sparse-saves 5 --every-iters 6 --budget-s 215 --tag _acc3 --out $OUT >> $L 2>&1; echo "async rc=$? $(( $(date +%s)-t0 ))s"; grep "^\[\|skipped" $L
