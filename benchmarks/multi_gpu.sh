#!/usr/bin/env bash
# The runs that need several GPUs of one host: data-parallel scaling, resume memory, resharding,
# background-save stalls, checkpoint bandwidth, offload per rank and tensor parallelism, at 2, 4
# and 8 GPUs (those the host has). From the repository root, torch installed system-wide:
#
#     OUT=/path/to/out bash benchmarks/multi_gpu.sh                # every part, every DP size
#     OUT=/path/to/out SIZES="2" bash benchmarks/multi_gpu.sh iter # one part, one size
#     DRY=1 OUT=/tmp/x bash benchmarks/multi_gpu.sh                # print the commands only
#
# Parts (each at every size in SIZES, default: 2 4 8 up to the GPUs present):
#   iter      train_iter.py: the 1b GPT with shardopt, DDP, FSDP2, ZeRO and megatron-core (its
#             wheel in .whl/), fp32, bf16 and int8 moments; the HF Llama 1.35B with shardopt,
#             DDP, FSDP2                                                       ~6 min per size
#   resume    resume_memory.py, GPT and HF Llama: resumed/fresh peak per iteration, every rank
#   reshard   reshard.py: save at the largest size, load at 2, save, load at the largest;
#             exports identical (GPT and HF Llama)
#   async     async_save.py on the HF Llama and the GPT, 2 micro-batches, default settings,
#             /dev/shm, 6 saves every 12 iterations, every async checkpoint checked
#   ckpt      checkpoint_io.py on /dev/shm and local disk against the raw bandwidth of the same
#             number of processes, 3 repetitions, DCP beside it
#   offload   offload.py on the HF Llama: every rank offloads and onloads at once, under the
#             default allocator and under expandable segments
#   tp        tp_iter.py: the HF Llama 1.35B tensor parallel at tp 2 and 4 (those that divide
#             the size), DP the rest; iteration, step, save, and a load without TP whose
#             export must be identical
#   muon      train_iter.py, the 1b GPT: shardopt with AdamW and with Muon for the matrices
#             (each matrix on one owner rank; step, Muon update and Newton-Schulz timed), DDP
#             beside them
# Each result is one JSON under $OUT with "world_size"; copy them to benchmarks/results/ and
# put the tables in benchmarks/README.md.
set -u
LOG=multi_gpu.log
. "$(dirname "$0")/_suite.sh"
GPUS=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU')
if [ -z "${SIZES:-}" ]; then
  SIZES=""
  for n in 2 4 8; do [ "$n" -le "$GPUS" ] && SIZES="$SIZES $n"; done
fi
LARGEST=$(for n in $SIZES; do echo "$n"; done | sort -n | tail -n 1)
PARTS=${*:-iter resume reshard async ckpt offload tp muon}

[ -n "$SIZES" ] || { echo "no DP size to run: $GPUS GPU(s) found" | tee -a "$LOG"; exit 1; }
for part in $PARTS; do
  for n in $SIZES; do
    case $part in
      muon)
        run "muon-gpt-$n" "$PY" benchmarks/train_iter.py --nproc "$n" --systems shardopt,ddp \
          --grad-modes torch --optimizer adamw,muon --iters 20 --tag "_dp${n}_muon" --out "$OUT" ;;
      iter)
        run "iter-gpt-fp32-$n" "$PY" benchmarks/train_iter.py --nproc "$n" \
          --systems shardopt,ddp,fsdp2,zero,megatron --iters 20 --tag "_dp$n" --out "$OUT"
        run "iter-gpt-bf16-$n" "$PY" benchmarks/train_iter.py --nproc "$n" --systems shardopt,ddp \
          --exp-avg-dtype bfloat16 --exp-avg-sq-dtype bfloat16 --iters 20 --tag "_dp${n}_bf16" \
          --out "$OUT"
        run "iter-gpt-int8-$n" "$PY" benchmarks/train_iter.py --nproc "$n" --systems shardopt,ddp \
          --exp-avg-dtype int8 --exp-avg-sq-dtype int8 --iters 20 --tag "_dp${n}_int8" --out "$OUT"
        run "iter-hf-$n" "$PY" benchmarks/train_iter.py --nproc "$n" --model hf-llama \
          --systems shardopt,ddp,fsdp2 --iters 20 --tag "_dp$n" --out "$OUT" ;;
      resume)
        run "resume-gpt-$n" "$PY" benchmarks/resume_memory.py --nproc "$n" --out "$OUT"
        run "resume-hf-$n" "$PY" benchmarks/resume_memory.py --nproc "$n" --model hf-llama \
          --out "$OUT" ;;
      reshard)
        if [ "$n" = "$LARGEST" ] && [ "$n" -gt 2 ]; then
          run "reshard-gpt" "$PY" benchmarks/reshard.py --sizes "$n,2,$n" --out "$OUT"
          run "reshard-hf" "$PY" benchmarks/reshard.py --model hf-llama --sizes "$n,2,$n" \
            --out "$OUT"
        fi ;;
      async)
        for m in hf-llama gpt; do
          run "async-$m-$n" "$PY" benchmarks/async_save.py --nproc "$n" --model "$m" \
            --accumulate 2 --systems shardopt --dirs /dev/shm --sparse-every 12 --sparse-saves 6 \
            --every-iters 0 --budget-s 550 --tag "_dp${n}_acc2" --out "$OUT"
        done ;;
      ckpt)
        run "ckpt-$n" "$PY" benchmarks/checkpoint_io.py --nproc "$n" --no-megatron \
          --systems shardopt,dcp_plain --targets shm,disk --repeats 3 --raw-repeats 3 \
          --budget 500 --tag "_dp$n" --out "$OUT" ;;
      offload)
        run "offload-hf-$n" "$PY" benchmarks/offload.py --nproc "$n" --model hf-llama \
          --micro-batch 8 --accumulate 2 --cycles 7 --rss-cycles 13 --no-peers \
          --out "$OUT/offload_dp${n}_hf.json"
        run "offload-hf-$n-expandable" env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
          "$PY" benchmarks/offload.py --nproc "$n" --model hf-llama --micro-batch 8 \
          --accumulate 2 --cycles 7 --rss-cycles 13 --no-peers \
          --out "$OUT/offload_dp${n}_hf_expandable.json" ;;
      tp)
        for tp in 2 4; do
          if [ "$tp" -le "$n" ] && [ $((n % tp)) -eq 0 ]; then
            run "tp-hf-$n-tp$tp" "$PY" benchmarks/tp_iter.py --dp $((n / tp)) --tp "$tp" \
              --out "$OUT"
          fi
        done ;;
      *) echo "unknown part $part" | tee -a "$LOG"; status=1 ;;
    esac
  done
done
exit $status
