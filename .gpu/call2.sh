#!/usr/bin/env bash
# session 3, call 2: what holds the training thread during a background save; int8 kernel block sweep; peak memory per state dtype
set -u
export PYTHONPATH=src NCCL_NVLS_ENABLE=0
t0=$(date +%s)
timeout 150 python3 benchmarks/writer_gil.py --snapshots host,device --saves 2 --out $OUT > $OUT/writer_gil.log 2>&1; echo "gil rc=$? $(( $(date +%s)-t0 ))s"; cat $OUT/writer_gil.log | grep -v Warning | tail -40
t0=$(date +%s)
timeout 100 python3 benchmarks/step_kernel_sweep.py --combos int8/int8/fp32,int8/int8/bf16,bf16/bf16/fp32 --configs 256x1,256x2,512x1,512x2,512x4,1024x2,1024x4 --tag _small_blocks --out $OUT > $OUT/sweep.log 2>&1; echo "sweep rc=$? $(( $(date +%s)-t0 ))s"; tail -25 $OUT/sweep.log
for s in "float32 float32 float32" "bfloat16 bfloat16 float32" "int8 int8 float32" "int8 int8 bfloat16"; do
  set -- $s
  t0=$(date +%s)
  timeout 100 python3 benchmarks/train_iter.py --nproc 1 --systems shardopt --exp-avg-dtype $1 --exp-avg-sq-dtype $2 --grad-dtype $3 --iters 5 --warmup 2 --tag _mem_$1_$3 --out $OUT > $OUT/iter_$1_$3.log 2>&1; echo "iter $s rc=$? $(( $(date +%s)-t0 ))s"; grep -i "peak\|shardopt" $OUT/iter_$1_$3.log | tail -4
done
