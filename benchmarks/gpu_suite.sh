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
#   storage  probes/storage_decision.py on /dev/shm, 1b: shardopt's writer against DCP's
#            HuggingFaceStorageWriter on the same chunks, same threads, 3 rounds          ~1.5 min
#
# Parts run only when named (1 GPU):
#
#   lowprec  optimizer_step.py for int8 moments with fp32 and bf16 grads (torchao's
#            AdamW8bit beside it when its wheel is carried), and probes/step_kernel_sweep.py
#            timing the kernel as each kind of step runs it (--modes)                    ~1 min
#   offload  offload.py, default allocator (torch_memory_saver beside it when carried),
#            20 cycles; the rollout's memory given back by unmapping, 9 cycles; with
#            expandable segments, 8 cycles                                                ~3.5 min
#   async    async_save.py, 3 micro-batches, 8 saves per snapshot mode, /dev/shm then
#            /tmp, and 50 iterations of a save each (the budget skips what will not fit)   ~8 min
#   gradmodes  grad_mode "torch" (p.grad after backward, the default) against "buffer" side by
#            side: optimizer_step.py (fp32 and bf16 grads, 50 reps) and train_iter.py
#            (shardopt in both modes and DDP, 10 timed iterations each)                   ~4 min
#   muon     train_iter.py, the 1b preset: shardopt with AdamW and with Muon for the
#            matrices (its step, Muon update and Newton-Schulz timed by CUDA events), 20
#            timed iterations each; lowprec_quality.py's fp32 and muon settings, the small
#            preset, 600 steps, 3 seeds, plotted                                          ~6 min
#   async_megatron  async_save.py against megatron-core's asynchronous dist_checkpointing
#            save (its own model, optimizer and loop), /dev/shm, 6 saves each; needs the
#            megatron-core and psutil wheels in .whl/                                     ~6 min
#   realmodel  probes/d2h_stall.py (its budget 200 s); async_save.py on the Hugging Face
#            Llama and on the GPT, 2 micro-batches of 8 x 1024 tokens, default settings,
#            /dev/shm, 5 saves after the first (~70 and ~60 s); offload.py on the Hugging
#            Face Llama, the same steps, 6 cycles after the first (~75 s)                 ~7 min
#   beforeafter  the 1-GPU suites that both trees have, on the GPT, for this tree and then for
#            an older one (BEFORE=DIR: `git archive COMMIT src benchmarks | tar -x -C DIR`, carried
#            to the host), results in $OUT/after and $OUT/before: optimizer_step.py (fp32, 30
#            steps) ~0.5 min, train_iter.py (shardopt and DDP, 10 timed) ~1 min, checkpoint_io.py
#            (shardopt, /dev/shm, 5 rounds) ~1.2 min, offload.py (7 cycles) ~1 min, async_save.py
#            (3 micro-batches, 5 saves after the first) ~1.7 min, per tree; BA_SUITES="step
#            iter ckio offload async" (the default) picks some                            ~11 min
#
# Wheels in .whl/ (carried: torchao, torch_memory_saver, megatron-core) are installed into
# /tmp/site first and put on PYTHONPATH.
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
# (with PROBE_ARGS="--device cpu --tiny --reps 2" for the probe of the realmodel part)
set -u
LOG=suite.log
. "$(dirname "$0")/_suite.sh"
read -r -a EXTRA <<< "${BENCH_ARGS:-}"
read -r -a PROBE <<< "${PROBE_ARGS:-}"
PARTS=${*:-tests shm disk storage}

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
      run storage "$PY" benchmarks/probes/storage_decision.py --nproc 1 --dir /dev/shm --repeats 3 \
        --timeout 240 --out "$OUT" "${EXTRA[@]}" ;;
    lowprec)
      for g in float32 bfloat16; do
        run "lowprec-$g" "$PY" benchmarks/optimizer_step.py --repeats 20 --out "$OUT" \
          --exp-avg-dtype int8 --exp-avg-sq-dtype int8 --grad-dtype $g "${EXTRA[@]}"
      done
      run sweep "$PY" benchmarks/probes/step_kernel_sweep.py --configs 1024x4 --modes plain,clip,norm \
        --combos fp32/fp32/fp32,bf16/bf16/fp32,int8/int8/fp32,int8/int8/bf16 --tag _modes \
        --out "$OUT" ;;
    offload)
      run offload "$PY" benchmarks/offload.py --cycles 20 --rss-cycles 20 \
        --out "$OUT/offload_1gpu.json" --plot "$OUT/offload_1gpu.png" "${EXTRA[@]}"
      run offload-vmm "$PY" benchmarks/offload.py --no-peers --rollout-alloc expandable \
        --cycles 9 --rss-cycles 15 --out "$OUT/offload_1gpu_vmm_rollout.json" "${EXTRA[@]}"
      run offload-expandable env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        "$PY" benchmarks/offload.py --cycles 8 --rss-cycles 8 --h2d copy_engine,kernel \
        --out "$OUT/offload_1gpu_expandable.json" "${EXTRA[@]}" ;;
    async)
      run async "$PY" benchmarks/async_save.py --dirs /dev/shm,/tmp --accumulate 3 \
        --systems shardopt --sparse-every 9 --sparse-saves 8 \
        --phase-cap-s 90 --every-iters 50 --budget-s 470 --tag _acc3 --out "$OUT" "${EXTRA[@]}" ;;
    gradmodes)
      for g in float32 bfloat16; do
        run "gradmodes-step-$g" "$PY" benchmarks/optimizer_step.py --repeats 50 --out "$OUT" \
          --grad-dtype $g --grad-modes torch,buffer "${EXTRA[@]}"
      done
      run gradmodes-iter "$PY" benchmarks/train_iter.py --nproc 1 --systems shardopt,ddp \
        --grad-modes torch,buffer --warmup 3 --iters 10 --tag _grad_modes --out "$OUT" \
        "${EXTRA[@]}" ;;
    muon)
      run muon-iter "$PY" benchmarks/train_iter.py --nproc 1 --systems shardopt \
        --grad-modes torch --optimizer adamw,muon --warmup 3 --iters 20 --tag _muon \
        --out "$OUT" "${EXTRA[@]}"
      run muon-quality "$PY" benchmarks/lowprec_quality.py --settings fp32,muon --tag _muon \
        --out "$OUT" "${EXTRA[@]}" ;;
    async_megatron)
      run async-megatron "$PY" benchmarks/async_save.py --dirs /dev/shm --accumulate 3 \
        --systems shardopt,megatron --sparse-every 9 --sparse-saves 6 --phase-cap-s 60 \
        --every-iters 10 --budget-s 330 --tag _acc3_megatron --out "$OUT" "${EXTRA[@]}" ;;
    realmodel)  # the probe takes PROBE_ARGS, not BENCH_ARGS (it has no --preset)
      run d2h_stall timeout 235 "$PY" benchmarks/probes/d2h_stall.py --budget-s 200 --out "$OUT" \
        "${PROBE[@]}"
      run async-hf timeout 100 "$PY" benchmarks/async_save.py --model hf-llama --accumulate 2 \
        --systems shardopt --dirs /dev/shm --sparse-every 12 --sparse-saves 6 --every-iters 0 \
        --phase-cap-s 60 --budget-s 90 --tag _acc2 --out "$OUT" "${EXTRA[@]}"
      run async-gpt timeout 90 "$PY" benchmarks/async_save.py --model gpt --accumulate 2 \
        --systems shardopt --dirs /dev/shm --sparse-every 14 --sparse-saves 6 --every-iters 0 \
        --phase-cap-s 60 --budget-s 80 --tag _acc2 --out "$OUT" "${EXTRA[@]}"
      run offload-hf timeout 100 "$PY" benchmarks/offload.py --model hf-llama --micro-batch 8 \
        --accumulate 2 --cycles 7 --rss-cycles 13 --h2d kernel --no-peers \
        --out "$OUT/offload_1gpu_hf.json" "${EXTRA[@]}" ;;
    beforeafter)  # the same command lines in both trees: the older one's options only
      before=$(cd "${BEFORE:?set BEFORE to the older tree}" && pwd)
      for side in after before; do
        mkdir -p "$OUT/$side"
        [ "$side" = before ] && pushd "$before" > /dev/null
        for s in ${BA_SUITES:-step iter ckio offload async}; do
          case $s in
            step) args=(benchmarks/optimizer_step.py --repeats 30 --out "$OUT/$side") ;;
            iter) args=(benchmarks/train_iter.py --nproc 1 --systems shardopt,ddp --warmup 3
                        --iters 10 --out "$OUT/$side") ;;
            ckio) args=(benchmarks/checkpoint_io.py --nproc 1 --no-megatron --systems shardopt
                        --targets shm --repeats 5 --raw-repeats 2 --raw-threads io
                        --raw-piece-mib 256 --first-gbps 4 --budget 120 --out "$OUT/$side") ;;
            offload) args=(benchmarks/offload.py --no-peers --micro-batch 8 --cycles 7
                           --rss-cycles 9 --out "$OUT/$side/offload_1gpu.json") ;;
            async) args=(benchmarks/async_save.py --accumulate 3 --systems shardopt --dirs /dev/shm
                         --sparse-every 12 --sparse-saves 6 --every-iters 0 --phase-cap-s 60
                         --budget-s 100 --out "$OUT/$side") ;;
            *) echo "unknown suite '$s' (step, iter, ckio, offload, async)" | tee -a "$LOG"
               status=1; continue ;;
          esac
          run "beforeafter-$side-$s" "$PY" "${args[@]}" "${EXTRA[@]}"
        done
        [ "$side" = before ] && popd > /dev/null
      done ;;
    *)
      echo "unknown part '$part' (tests, shm, disk, storage, lowprec, offload, async, gradmodes, muon, async_megatron, realmodel, beforeafter)" | tee -a "$LOG"
      status=1 ;;
  esac
done
exit $status
