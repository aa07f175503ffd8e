"""Asynchronous checkpoint saves: how long training stalls and how much it slows, shardopt
``checkpoint.save(..., blocking=False)`` against ``torch.distributed.checkpoint.async_save``.

One process, one GPU (``--nproc N``: N ranks, one a GPU, data parallel), the ``1b`` preset
of ``--model``: ``gpt`` (default), the reference GPT (1.3B params, bf16 with fp32 norms and
routers), or ``hf-llama``, Hugging Face's ``LlamaForCausalLM`` of 1.35B params built from a
config (``_common.HF_LLAMA_PRESETS``: bf16, SDPA attention; each forward gets an all-ones
attention mask and so reads a GPU value on the host early on, as Hugging Face models do with
real batches); shardopt's optimizer for every system; DCP saves ``{"model":
model.state_dict(), "optim": opt.state_dict()}``, the same bytes. An iteration is
``--accumulate`` micro-batches of ``--micro-batch`` sequences (forward, backward), then the
step; it starts and ends by waiting for the training stream (as a loop that reads its loss
does; a save's copies on side streams are waited for only where training itself waits for
them) and is timed. Phases, each into ``/dev/shm`` and ``/tmp``:

* ``none``: no checkpoint; its median iteration is the baseline.
* ``sparse``: a save every ``--sparse-every`` iterations (long enough for the write to
  finish). ``stall_s`` = the iteration containing the save minus the baseline (target
  <= 2% of an iteration), the first save (which allocates the snapshot) apart, and so are
  saves called while the previous one was still being written (they wait for it; counted
  in ``saves_that_waited_for_the_previous``: make ``--sparse-every`` longer);
  ``stall_local_s`` = the same against the median of the (up to 4) quiet iterations just
  before each save, which drift less than the whole run; ``stall_vs_quiet_s`` against the
  median of all the phase's quiet iterations (no save called, no write running:
  ``quiet_iter_s``, and ``quiet_vs_baseline`` how far they drifted from ``none``'s: the GPU
  runs the same iterations ~1-2% slower minutes later);
  ``during_write`` = median iteration while a background write runs, against the
  baseline (target <= 3% slower).
* ``every``: a save every iteration for ``--every-iters`` iterations (each save waits for
  the one before): throughput against ``none`` (``--every-iters 0``: no such phase).

Every figure is a median with min and max over the phase's iterations or saves (the first
save, which allocates the snapshot unless it was prepared, is reported alone);
``--sparse-saves 6`` gives 5 saves after the first.

After the shardopt trainer's warm-up steps, outside every timed region, each rank calls
``checkpoint.prepare`` (the host snapshot allocated and page-locked ahead of the first
save, its copies planned); its seconds are in the result (``prepare_s``, by snapshot
kind). ``--no-prepare`` leaves the first save to allocate, lock and plan it.

``--systems megatron`` adds megatron-core's asynchronous ``dist_checkpointing.save`` of its own
DDP model and distributed optimizer (same preset, same batches, its own training loop and its
own baseline, the phase ``none:megatron``): it needs megatron-core (and psutil, which its save
worker imports) importable, e.g. wheels carried in ``.whl/`` and installed into ``/tmp/site``.

DCP is used as torchtitan does: ``DefaultStager(StagingOptions(pinned memory, async
staging, non-blocking copies))`` where torch has it, a new one per save (see
``DcpSaver._new_stager``); the step after a save waits for its
staging, a save waits for the previous upload. Host RSS is sampled during each phase.
No iteration of a phase starts after ``--phase-cap-s`` seconds (the number run is
recorded), and a time budget (``--budget-s``) skips phases that would not fit, from the
last of: every phase into the first directory, then into the others; skipped phases are
listed in the result.

``--nproc N`` (N > 1) runs N ranks (``_peers.spawn``: NCCL on GPUs, gloo on CPU), each with
the same model and its own micro-batches, the optimizer over all of them; only shardopt's
systems (DCP and megatron here run at ``--nproc 1``). Saves are collective, so every rank
must save and iterate alike: rank 0 decides (the budget's skips, each phase's directory and
its number of iterations) and tells the others before the phase, and ``--phase-cap-s``
becomes a number of iterations agreed up front (from rank 0's baseline and how long its
writes ran in the phase before) instead of a clock read inside the loop. Every rank
measures its own phases (``phases_by_rank``, ``prepare_s_by_rank`` and
``host_rss_peak_bytes_by_rank`` in the result; ``phases`` are rank 0's).

Each sparse phase of a shardopt system also checks every asynchronous checkpoint: before
each save (outside the timed iteration) a blocking save of the same state is written beside
it, and once the asynchronous one is committed the two must hold the same files byte for byte
(and the same manifest but its creation time and checksum) and the asynchronous one must pass
``checkpoint.verify`` (``notes.verified`` and ``notes.all_equal`` in the result;
``--no-verify`` skips it). ``shardopt@PIECE:FLIGHT`` runs shardopt's default snapshot with its
drain's piece size and pieces in flight set (``notes.drain``), for a sweep.

The Hugging Face model and the reference GPT at 1 and 3 micro-batches, default settings,
``/dev/shm``, 5 saves after the first (one H200)::

    for m in hf-llama gpt; do for acc in 1 3; do
      PYTHONPATH=src python3 benchmarks/async_save.py --model $m --accumulate $acc \
          --systems shardopt --dirs /dev/shm --sparse-every 12 --sparse-saves 6 \
          --every-iters 0 --tag _acc$acc --out $OUT
    done; done

The drain's sweep on the Hugging Face model (piece size and pieces in flight)::

    PYTHONPATH=src python3 benchmarks/async_save.py --model hf-llama --accumulate 1 \
        --systems shardopt@2m:1,shardopt@4m:1,shardopt@8m:1,shardopt@4m:2 --dirs /dev/shm \
        --sparse-every 12 --sparse-saves 6 --every-iters 0 --budget-s 550 --tag _sweep \
        --out $OUT

DP 2 (two H200)::

    PYTHONPATH=src python3 benchmarks/async_save.py --nproc 2 \
        --systems shardopt --out $OUT

CPU smoke (``--nproc 2`` for two ranks over gloo)::

    PYTHONPATH=src python benchmarks/async_save.py --device cpu --preset tiny \
        --every-iters 3 --sparse-every 2 --sparse-saves 3 --warmup 1 --dirs /tmp \
        --systems shardopt,shardopt@64k:2,dcp
    PYTHONPATH=src python benchmarks/async_save.py --device cpu --preset tiny \
        --model hf-llama --accumulate 3 --every-iters 0 --sparse-every 2 --sparse-saves 3 \
        --warmup 1 --dirs /tmp --systems shardopt,dcp
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import _peers  # noqa: E402


from _async_systems import (DP1_ONLY, SAVERS, MegatronAsyncSaver, ShardoptSaver,  # noqa: E402
                            _saver)


def _loop(step_fn: Callable[[Callable[[], None]], None], device: torch.device, iters: int,
          saver: Any, save_at: Callable[[int], bool], first_step: int,
          cap_s: float = float("inf")) -> list[dict]:
    """Up to ``iters`` timed iterations; none starts after ``cap_s`` seconds."""
    rows, started = [], time.perf_counter()
    for i in range(iters):
        if time.perf_counter() - started > cap_s:
            break
        if device.type == "cuda":  # starts on an idle training stream
            torch.cuda.current_stream(device).synchronize()
        busy_before = saver is not None and saver.busy()
        saved = saver is not None and save_at(i)
        if saved:  # outside the timed iteration: the reference a save is checked against
            getattr(saver, "before_save", lambda step: None)(first_step + i)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        t0 = time.perf_counter()
        if saved:
            saver.save(first_step + i)
        call_s = time.perf_counter() - t0
        step_fn(saver.before_step if saver is not None else (lambda: None))
        if device.type == "cuda":  # what a loop that reads its loss waits for
            torch.cuda.current_stream(device).synchronize()
        rows.append({"iter_s": time.perf_counter() - t0, "save_call_s": call_s if saved else 0.0,
                     "saved": saved, "writing": busy_before})
    return rows


def _phase(name: str, rows: list[dict], baseline: float | None, rss) -> dict:
    it = [r["iter_s"] for r in rows]
    out = {"phase": name, "iters": len(rows), "iter_s": _common.stats(it), "rows": rows,
           "host_rss": rss.as_dict(), "wall_s": sum(it)}
    if baseline:
        saves = [r for r in rows if r["saved"]]
        writing = [r["iter_s"] for r in rows if r["writing"] and not r["saved"]]
        out["baseline_iter_s"] = baseline
        if saves:
            # The first save of a system allocates (and page-locks) its snapshot unless it was
            # prepared: apart.
            out["first_save_stall_s"] = saves[0]["iter_s"] - baseline
            saves = saves[1:] or saves
            # A save called while the previous one still writes waits for it first (the
            # default if_busy="wait"): that is the write's length, not the stall, and is
            # reported apart; the "every" phase measures it as throughput.
            waited = [r for r in saves if r["writing"]]
            clean = [r for r in saves if not r["writing"]] or saves
            stalls = [r["iter_s"] - baseline for r in clean]
            out["stall_s"] = _common.stats(stalls)
            out["stall_fraction_of_iter"] = statistics.median(stalls) / baseline
            out["save_call_s"] = _common.stats([r["save_call_s"] for r in clean])
            out["saves_that_waited_for_the_previous"] = len(waited)
            # The same against the median of the up to 4 iterations just before each save
            # that neither saved nor wrote: iterations drift and alternate by ~10 ms over a
            # run, more than the stall being measured.
            local = []
            for r in clean:
                i = next(k for k, x in enumerate(rows) if x is r)
                quiet = [x["iter_s"] for x in rows[:i] if not x["saved"] and not x["writing"]]
                if quiet:
                    local.append(r["iter_s"] - statistics.median(quiet[-4:]))
            if local:
                out["stall_local_s"] = _common.stats(local)
                out["stall_local_fraction_of_iter"] = statistics.median(local) / baseline
            # And against the median of all the phase's quiet iterations (no save called, no
            # write running): the iterations without a save of the same run phase.
            quiet = [r["iter_s"] for r in rows if not r["saved"] and not r["writing"]]
            if quiet:
                q = statistics.median(quiet)
                out["quiet_iter_s"] = _common.stats(quiet)
                out["quiet_vs_baseline"] = q / baseline - 1
                out["stall_vs_quiet_s"] = _common.stats([r["iter_s"] - q for r in clean])
                out["stall_vs_quiet_fraction_of_iter"] = statistics.median(
                    [r["iter_s"] - q for r in clean]) / q
                if writing:
                    out["during_write_vs_quiet"] = statistics.median(writing) / q - 1
        if writing:
            out["during_write_iter_s"] = _common.stats(writing)
            out["during_write_slowdown"] = statistics.median(writing) / baseline - 1
        out["throughput_vs_none"] = baseline * len(rows) / sum(it)
    return out


def _write_s(rows: list[dict]) -> float:
    """Seconds a save's write runs, at most, as a phase's rows tell: from the iteration that
    called it to the first that started with no write running (the median over the saves
    whose write ended within the phase, before the next save; 0 without any)."""
    spans = []
    for i, r in enumerate(rows):
        if r["saved"]:
            k = i + 1
            while k < len(rows) and rows[k]["writing"] and not rows[k]["saved"]:
                k += 1
            if k < len(rows) and not rows[k]["writing"]:
                spans.append(sum(x["iter_s"] for x in rows[i:k]))
    return statistics.median(spans) if spans else 0.0


def _agreed(value: Any) -> Any:
    """Collective at DP > 1: rank 0's ``value`` on every rank (``value`` itself at DP 1).
    Saves are collective, so what decides whether a rank saves or iterates is rank 0's."""
    if dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gathered(value: Any) -> list | None:
    """Collective at DP > 1: every rank's ``value``, in rank order, on rank 0 (None on the
    others); ``[value]`` at DP 1."""
    if dist.get_world_size() == 1:
        return [value]
    values = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, values, dst=0)
    return values


def _trainer_of(system: str) -> str:
    """Whose model and loop a system saves: megatron's own, or shardopt's (DCP saves that)."""
    return "megatron" if system == "megatron" else "shardopt"


class _Trainer:
    """One model, optimizer and training loop (``step_fn``): shardopt's, whose state the
    shardopt and DCP savers save, or megatron-core's DDP and distributed optimizer."""

    def __init__(self, kind: str, args: argparse.Namespace, batches: list, device: torch.device
                 ) -> None:
        self.baseline = 0.0
        self.model = _common.build_model(args.model, args.preset, device, seed=0)
        setup = _peers.setup_megatron if kind == "megatron" else _peers.setup_shardopt
        self.system = setup(self.model, _peers.Hyper(), device)
        self.opt = self.system.optimizer
        self.kind = kind
        self.prepare_s: dict[str, float] = {}
        counter, acc = [0], args.accumulate
        ddp = self.system.wrapped

        def step_fn(before_step: Callable[[], None]) -> None:
            if ddp is not None:
                ddp.zero_grad_buffer()
                self.opt.zero_grad()
            for a in range(acc):
                x, y = batches[counter[0] % len(batches)]
                counter[0] += 1
                last = a == acc - 1
                sync = (ddp or self.opt).no_sync  # reduce once, at the last micro-batch
                with contextlib.nullcontext() if last else sync():
                    ((ddp or self.model)(x, y) / acc).backward()
            if ddp is not None:
                ddp.finish_grad_sync()
            before_step()
            self.opt.step()
            if ddp is None:
                self.opt.zero_grad()

        self.step_fn = step_fn

    def prepare(self, args: argparse.Namespace) -> None:
        """``checkpoint.prepare`` after the warm-up steps (the moments exist, so it also plans
        the copies); its seconds by snapshot kind."""
        if self.kind == "shardopt" and args.prepare:
            for system in args.systems.split(","):
                saver = SAVERS[system.partition("@")[0]]
                if issubclass(saver, ShardoptSaver) and saver.snapshot not in self.prepare_s:
                    self.prepare_s[saver.snapshot] = saver.prepare(self.model, self.opt)


def _run(rank: int, world: int, args: argparse.Namespace, device: torch.device,
         started: float) -> dict:
    """Every phase on rank ``rank`` of ``world`` (the whole run at DP 1): its phases, the
    phases skipped (rank 0's decisions; the budget counts from ``started``) and its trainers'
    baselines."""
    n_batches = 8
    batches = _common.make_batches(args.model, args.preset, rank, world, args.micro_batch,
                                   n_batches, device)
    phases, skipped = [], []
    trainers: dict[str, _Trainer] = {}

    def trainer(kind: str) -> _Trainer:
        """The model, optimizer and loop of ``kind`` (shardopt, or megatron's own), built at
        first use, with its baseline from its own phase without checkpoints."""
        if kind not in trainers:
            t = _Trainer(kind, args, batches, device)
            _loop(t.step_fn, device, args.warmup, None, lambda i: False, 0)
            t.prepare(args)
            with _common.HostRssSampler(0.005) as rss:
                none = _loop(t.step_fn, device, args.none_iters, None, lambda i: False, 0)
            t.baseline = statistics.median(r["iter_s"] for r in none)
            phases.append(_phase("none" if kind == "shardopt" else f"none:{kind}", none, None,
                                 rss))
            trainers[kind] = t
        return trainers[kind]

    baseline = trainer("shardopt").baseline
    # Seconds one save of a system into a directory takes, learnt from the wait for its last
    # save at the end of an earlier phase.
    est_save_s: dict[tuple[str, str], float] = {}
    dirs = args.dirs.split(",")
    # Most wanted first: the budget skips from the end.
    kinds = ("sparse", "every") if args.every_iters > 0 else ("sparse",)
    plan = [(kind, d, system) for d in dirs[:1] for kind in kinds
            for system in args.systems.split(",")]
    plan += [(kind, d, system) for d in dirs[1:] for kind in kinds
             for system in args.systems.split(",")]
    first_step = 1
    for kind, d, system in plan:
        iters = args.sparse_every * args.sparse_saves if kind == "sparse" else args.every_iters
        baseline = trainers.get(_trainer_of(system), trainers["shardopt"]).baseline
        save_s = est_save_s.get((d, system), 10.0)
        iter_s = baseline if kind == "sparse" else max(baseline, save_s)
        guess = min(args.phase_cap_s, iters * iter_s) + 2 * save_s
        left = args.budget_s - (time.perf_counter() - started)
        if world > 1:
            # No clock may stop one rank's loop before another's: the iterations that would
            # start within the cap, counted up front.
            iters = min(iters, int(args.phase_cap_s // iter_s) + 1)
        fits = guess <= left
        root = (Path(tempfile.mkdtemp(prefix=f"async-save-bench-{system}-", dir=d))
                if fits and rank == 0 else None)
        fits, guess, left, iters, root = _agreed((fits, guess, left, iters, root))
        if not fits:
            skipped.append({"phase": f"{kind}:{system}:{d}", "estimated_s": guess,
                            "left_s": left})
            continue
        saver = None
        try:
            t = trainer(_trainer_of(system))
            baseline = t.baseline
            saver = (MegatronAsyncSaver(t.system, root, device) if system == "megatron"
                     else _saver(system, t, root, args.verify and kind == "sparse"))
            every = args.sparse_every if kind == "sparse" else 1
            with _common.HostRssSampler(0.005) as rss:
                t0 = time.perf_counter()
                rows = _loop(t.step_fn, device, iters, saver, lambda i: i % every == 0,
                             first_step, args.phase_cap_s if world == 1 else float("inf"))
                t1 = time.perf_counter()
                saver.finish()
                total = time.perf_counter() - t0
            # At DP > 1 this also sets the next phase's number of iterations: the wait for a
            # sparse phase's last save is mostly nil (its write ended within the phase), so
            # the rows tell how long a write runs.
            est_save_s[(d, system)] = max(time.perf_counter() - t1, baseline,
                                          _write_s(rows) if world > 1 else 0.0)
            first_step += len(rows)
            ph = _phase(f"{kind}:{system}:{d}", rows, baseline, rss)
            ph["wall_with_last_save_s"] = total
            ph["notes"] = getattr(saver, "notes", {})
            phases.append(ph)
            stalls = _gathered(ph.get("stall_s", {}).get("median", 0))
            if rank == 0:
                print(f"[{ph['phase']}] stall median {stalls[0]:.4f} s "
                      f"(local {ph.get('stall_local_s', {}).get('median', 0):.4f} s, against the "
                      f"phase's quiet iterations "
                      f"{ph.get('stall_vs_quiet_s', {}).get('median', 0):.4f} s, "
                      f"{100 * ph.get('stall_vs_quiet_fraction_of_iter', 0):.2f}%; quiet "
                      f"{100 * ph.get('quiet_vs_baseline', 0):+.2f}% vs none) "
                      f"({100 * ph.get('stall_fraction_of_iter', 0):.2f}% of {baseline:.3f} s), "
                      f"during write {100 * ph.get('during_write_slowdown', 0):+.2f}%, "
                      f"throughput {100 * ph['throughput_vs_none']:.1f}% of none, "
                      f"RSS peak {rss.peak_bytes / _common.GIB:.1f} GiB, first save stall "
                      f"{ph.get('first_save_stall_s', 0):.4f} s"
                      + (f", checkpoints equal to blocking saves: {ph['notes']['all_equal']}"
                         if "all_equal" in ph["notes"] else "")
                      + "".join(f"; rank {r} stall median {s:.4f} s"
                                for r, s in enumerate(stalls) if r), flush=True)
        except Exception as e:  # noqa: BLE001 - a failing system is a result at DP 1
            if world > 1:  # its peers would wait for it in a collective save: end the run
                raise
            phases.append({"phase": f"{kind}:{system}:{d}", "error": repr(e)})
            print(f"[{kind}:{system}:{d}] FAILED: {e!r}", flush=True)
        finally:
            getattr(saver, "close", lambda: None)()
            if rank == 0:
                shutil.rmtree(root, ignore_errors=True)
    return {"phases": phases, "skipped": skipped,
            "baseline_iter_s_by_trainer": {k: t.baseline for k, t in trainers.items()},
            "prepare_s": trainers["shardopt"].prepare_s,
            "parameters": _common.param_count(trainers["shardopt"].model)}


def _rank(rank: int, world: int, a: dict) -> dict:
    """Rank ``rank`` of ``world`` at ``--nproc`` > 1, in a fresh process (``_peers.spawn``)."""
    return _run(rank, world, argparse.Namespace(**a), _peers.rank_device(rank, a["device"]),
                time.perf_counter())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=1,
                   help="ranks, one per GPU (data parallel); shardopt's systems only above 1")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", choices=_common.MODELS, default="gpt",
                   help="the reference GPT, or Hugging Face's LlamaForCausalLM from a config")
    p.add_argument("--preset", default="1b")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=1,
                   help="micro-batches (forward+backward) per iteration, before its step")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--none-iters", type=int, default=20)
    p.add_argument("--sparse-every", type=int, default=15)
    p.add_argument("--sparse-saves", type=int, default=6,
                   help="saves of a sparse phase, the first (which allocates) included")
    p.add_argument("--every-iters", type=int, default=50,
                   help="iterations of the save-every-iteration phase (0: none)")
    p.add_argument("--dirs", default="/dev/shm,/tmp")
    p.add_argument("--systems", default="shardopt,dcp",
                   help="comma-separated: shardopt, dcp, megatron; a "
                   "shardopt one may name its drain's piece size and pieces in flight, "
                   "shardopt@2m:1 (a sweep: shardopt@2m:1,shardopt@4m:1,shardopt@4m:2)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="do not check each sparse phase's asynchronous checkpoints against a "
                   "blocking save of the same state (byte for byte) and with verify")
    p.add_argument("--no-prepare", dest="prepare", action="store_false",
                   help="do not call checkpoint.prepare before training: the first save "
                   "allocates and page-locks its snapshot")
    p.add_argument("--phase-cap-s", type=float, default=25.0,
                   help="no iteration of a phase starts after this many seconds")
    p.add_argument("--budget-s", type=float, default=250.0,
                   help="seconds for everything; phases that would not fit are skipped")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds the ranks may run at --nproc > 1 before they are killed")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; use --device cpu for a smoke run")
    if args.nproc < 1:
        p.error("--nproc must be at least 1")
    unknown = [s for s in args.systems.split(",") if s.partition("@")[0] not in SAVERS
               or (s.partition("@")[2] and not s.startswith("shardopt"))]
    if unknown:
        p.error(f"unknown system {unknown[0]!r}; have {', '.join(SAVERS)} (shardopt ones with "
                "@PIECE:FLIGHT, e.g. shardopt@2m:1)")
    dp1_only = [s for s in args.systems.split(",") if s in DP1_ONLY]
    if args.model != "gpt" and "megatron" in args.systems.split(","):
        p.error("megatron trains its own GPT: --systems megatron needs --model gpt")
    if args.nproc > 1 and dp1_only:
        p.error(f"system {dp1_only[0]} runs at --nproc 1 only; --nproc {args.nproc} takes "
                f"shardopt's systems ({', '.join(s for s in SAVERS if s not in DP1_ONLY)})")
    started = time.perf_counter()
    if args.nproc == 1:
        device = _peers.single_rank_group(args.device)
        ranks = [_run(0, 1, args, device, started)]
        dist.destroy_process_group()
    else:
        device = _peers.rank_device(0, args.device)
        try:
            ranks = _peers.spawn(_rank, args.nproc, vars(args), device=args.device,
                                 timeout_s=args.timeout)
        except _peers.RankFailed as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
    r0 = ranks[0]
    by_rank = {} if args.nproc == 1 else {  # no failed phase at DP > 1: each has its RSS
        "phases_by_rank": [r["phases"] for r in ranks],
        "prepare_s_by_rank": [r["prepare_s"] for r in ranks],
        "host_rss_peak_bytes_by_rank": [max(ph["host_rss"]["peak_bytes"] for ph in r["phases"])
                                        for r in ranks]}
    doc = {**_common.run_header(device, vars(args)), "benchmark": "async_save",
           "dp_size": args.nproc, "model": args.model, "parameters": r0["parameters"],
           "baseline_iter_s": r0["baseline_iter_s_by_trainer"]["shardopt"],
           "baseline_iter_s_by_trainer": r0["baseline_iter_s_by_trainer"],
           "phases": r0["phases"], "skipped": r0["skipped"],
           "prepare_s": r0["prepare_s"], **by_rank,
           "wall_s": time.perf_counter() - started, "pid": os.getpid()}
    ranks_name = f"{args.nproc}gpu" if device.type == "cuda" else (
        "cpu" if args.nproc == 1 else f"cpu_dp{args.nproc}")
    model = "" if args.model == "gpt" else "_hf"
    name = f"async_save_{ranks_name}{model}{args.tag}.json"
    _common.write_json(Path(args.out) / name, doc)
    print(f"wrote {Path(args.out) / name}; skipped {[s['phase'] for s in r0['skipped']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
