#!/usr/bin/env bash
# The GPU-host run: tests, checkpoint I/O against fair peers and the raw baseline, the storage
# decision. For a 1-GPU H200 host with torch installed system-wide (no venv, no network, no
# megatron-core), from the repository root:
#
#     PYTHONPATH=src OUT=/path/to/out bash benchmarks/gpu_suite.sh            # every part
#     PYTHONPATH=src OUT=/path/to/out bash benchmarks/gpu_suite.sh shm disk   # some parts
#
# Parts, in order, with the time each is expected to take on that host (about 9 minutes in all):
#
#   tests    tests/run_gpu.sh (make test-gpu): cuda-marked and Triton tests, NCCL     ~1.5 min
#   shm      checkpoint_io.py on /dev/shm, the 1b preset (18.4 GB): shardopt, DCP's
#            FileSystemWriter and async_save at shardopt's thread count, 3 rounds each
#            (save, in-place load, resume); raw baseline at 18.4 GB per rank, io and 2x io
#            threads, 32 and 256 MiB writes, best of 3                                    ~4 min
#   disk     the same on local disk (/tmp), at 6 layers (5.7 GB) for time: shardopt and
#            DCP's writer, 3 rounds, cold reads; raw baseline at 4 and io threads         ~2 min
#   storage  storage_decision.py on /dev/shm, 1b: shardopt's writer against DCP's
#            HuggingFaceStorageWriter on the same chunks, same threads, 3 rounds          ~1.5 min
#
# Each part writes its result JSON into $OUT and appends its output to $OUT/suite.log; the
# checkpoint parts' --budget skips whole rounds (and says so) rather than run past the time.
# The peers left out here for time (torch.save, FSDP2 + DCP) run with
#     python3 benchmarks/checkpoint_io.py --no-megatron --systems shardopt,torch_save,dcp_fsdp2 \
#         --targets shm --out $OUT --tag _peers
# (about 6 minutes at 3 rounds).
#
# BENCH_ARGS is appended to every benchmark's arguments (later ones win): a CPU check of the
# suite is  BENCH_ARGS="--device cpu --preset tiny" OUT=/tmp/out bash benchmarks/gpu_suite.sh
set -u
OUT=${OUT:?set OUT to the directory for results}
PY=${PY:-python3}
read -r -a EXTRA <<< "${BENCH_ARGS:-}"
export PYTHONPATH=${PYTHONPATH:-src}
mkdir -p "$OUT"
LOG="$OUT/suite.log"
PARTS=${*:-tests shm disk storage}
status=0

run() {  # name, command...: run one part, log it, remember a failure, go on
  local name=$1
  shift
  echo "=== $name: $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
}

for part in $PARTS; do
  case $part in
    tests)
      run tests env PY="$PY" bash tests/run_gpu.sh "$OUT/pytest_gpu.txt" ;;
    shm)
      run shm "$PY" benchmarks/checkpoint_io.py --nproc 1 --no-megatron \
        --systems shardopt,dcp_plain,dcp_async --targets shm --repeats 3 \
        --raw-threads io,2io --raw-piece-mib 32,256 --raw-repeats 3 \
        --first-gbps 3 --budget 240 --timeout 120 --out "$OUT" --tag _suite_shm "${EXTRA[@]}" ;;
    disk)
      run disk "$PY" benchmarks/checkpoint_io.py --nproc 1 --no-megatron --num-layers 6 \
        --systems shardopt,dcp_plain --disk-systems shardopt,dcp_plain --targets disk \
        --repeats 3 --raw-threads 4,io --raw-piece-mib 32 --raw-repeats 3 \
        --first-gbps 1 --budget 100 --timeout 120 --out "$OUT" --tag _suite_disk "${EXTRA[@]}" ;;
    storage)
      run storage "$PY" benchmarks/storage_decision.py --nproc 1 --dir /dev/shm --repeats 3 \
        --timeout 240 --out "$OUT" "${EXTRA[@]}" ;;
    *)
      echo "unknown part '$part' (tests, shm, disk, storage)" | tee -a "$LOG"
      status=1 ;;
  esac
done
exit $status
