"""Training-iteration throughput and peak memory: shardopt against the systems users pick instead.

Each system (shardopt, DDP + fused AdamW, FSDP2, ZeroRedundancyOptimizer, megatron-core's distributed
optimizer) runs in fresh processes, one per GPU, on the same model, the same weights and the same
micro-batches (``--micro-batch`` sequences of the model's length per GPU, no accumulation). The
model is the ``--preset`` of ``--model``: ``gpt`` (default), the reference GPT of
``shardopt.recipes`` (``1b``: 1.3B params, bf16 with fp32 norms and MoE routers), or ``hf-llama``,
Hugging Face's ``LlamaForCausalLM`` built from a config (``_common.HF_LLAMA_PRESETS``, ``1b``:
1.35B params, bf16; each forward reads a GPU value on the host, see ``_common.HFLlama``).
megatron-core runs only the reference GPT: with ``hf-llama`` it is skipped and the result says why.
After ``--warmup`` iterations, ``--iters`` timed iterations each end in a device synchronisation;
each system reports the median, min and max iteration time, and tokens/s from the median.
Peak memory allocated/reserved is the allocator's peak over the timed iterations (steady state)
and over the whole run (including the first step, which allocates the optimizer state). A peer
that fails is recorded with its error and the rest still run.

``--grad-modes torch,buffer`` (default: both) runs each shardopt system once per
``OptimizerConfig.grad_mode``, side by side: ``shardopt`` is the default ``"torch"`` (``p.grad``
after backward, all-reduced at DP > 1), ``shardopt_buffer`` grads only in the grad buffer
(reduce-scatter); the summary gives the ratio of their median iteration times.

``--optimizer adamw,muon`` runs each shardopt system also with Muon for the matrices
(``shardopt_muon``: ``shardopt.muon_groups``, ``adjust_lr_fn="match_rms_adamw"``); the other
systems run AdamW only. A Muon run times, per timed iteration, ``optimizer.step()``, the Muon
update in it (momentum, Newton-Schulz, the update of the owned matrices) and Newton-Schulz
alone, by CUDA events (``muon_timing`` in the result: medians, and Newton-Schulz's share of
the step); the summary gives its median iteration time against AdamW's.

GPU (the GPT; result ``train_iter_1gpu.json``, the Hugging Face model ``train_iter_1gpu_hf.json``)::

    PYTHONPATH=src python3 benchmarks/train_iter.py --nproc 1 --out $OUT
    PYTHONPATH=src python3 benchmarks/train_iter.py --nproc 1 --model hf-llama --out $OUT
    PYTHONPATH=src python3 benchmarks/train_iter.py --nproc 1 --systems shardopt,ddp \
        --grad-modes torch,buffer --iters 20 --out $OUT --tag _grad_modes
    PYTHONPATH=src python3 benchmarks/train_iter.py --nproc 1 --model hf-llama \
        --systems shardopt,ddp --grad-modes torch,buffer --iters 20 --out $OUT --tag _grad_modes
    PYTHONPATH=src python3 benchmarks/train_iter.py --nproc 1 --systems shardopt \
        --grad-modes torch --optimizer adamw,muon --iters 20 --out $OUT --tag _muon

CPU smoke (gloo)::

    PYTHONPATH=src python benchmarks/train_iter.py --device cpu --preset tiny --iters 5 --warmup 1
    PYTHONPATH=src python benchmarks/train_iter.py --device cpu --preset tiny --model hf-llama \
        --iters 5 --warmup 1
    PYTHONPATH=src python benchmarks/train_iter.py --device cpu --preset tiny --systems shardopt \
        --grad-modes torch --optimizer adamw,muon --iters 5 --warmup 1
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import _peers  # noqa: E402


def _worker(rank: int, world: int, system: str, a: dict) -> dict:
    device = _peers.rank_device(rank, a["device"])
    if device.type == "cpu":
        torch.set_num_threads(max(1, a["cpu_threads"]))
    batches = _common.make_batches(a["model"], a["preset"], rank, world, a["micro_batch"],
                                   a["warmup"] + a["iters"], device)
    timeline = _common.MemoryTimeline(device)
    t0 = time.perf_counter()
    model = _common.build_model(a["model"], a["preset"], device, seed=0,
                                num_layers=a["num_layers"])
    num_params = _common.param_count(model)
    kwargs = {}
    if system.startswith("shardopt"):
        kwargs.update(a["state_dtypes"], grad_mode=a["grad_mode"], optimizer=a["optimizer"])
    if system == "megatron":
        kwargs["overlap_param_gather"] = a["megatron_overlap_param_gather"]
    sys_ = _peers.SETUP[system](model, _peers.Hyper(), device, **kwargs)
    timeline.mark("setup")
    setup_s = time.perf_counter() - t0
    spans = _muon_spans(sys_.optimizer, device) if a["optimizer"] == "muon" else {}

    losses = []
    for i in range(a["warmup"]):
        losses.append(sys_.step(*batches[i]))
        timeline.mark("warmup")
    times = []
    muon_timing: dict[str, list[float]] = {name: [] for name in spans}
    for i in range(a["warmup"], a["warmup"] + a["iters"]):
        for span in spans.values():
            span.clear()
        start = time.perf_counter()
        losses.append(sys_.step(*batches[i]))
        _peers.sync(device)
        times.append(time.perf_counter() - start)
        timeline.mark("iter")
        for name, span in spans.items():
            muon_timing[name].append(span.seconds())
    losses = [float(v) for v in losses]
    if not all(map(lambda v: v == v and abs(v) != float("inf"), losses)):
        raise RuntimeError(f"non-finite loss: {losses}")
    peaks = timeline.phase_peaks()
    steady = peaks.get("iter", {"peak_allocated": 0, "peak_reserved": 0})
    return {
        "iter_s": times,
        "losses": losses,
        "tokens_per_iter": batches[0][0].numel(),
        "parameters": num_params,
        "setup_s": setup_s,
        "peak_allocated_steady": steady["peak_allocated"],
        "peak_reserved_steady": steady["peak_reserved"],
        "peak_allocated_all": max(p["peak_allocated"] for p in peaks.values()),
        "peak_reserved_all": max(p["peak_reserved"] for p in peaks.values()),
        "allocated_end": steady.get("end_allocated", 0),
        "notes": sys_.notes,
        "muon_timing": muon_timing,
    }


class _Spans:
    """The time spent in the calls of one function during an iteration: CUDA events around
    each call on a GPU (read after the iteration's device synchronisation), wall time on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple] = []

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = self._mark()
            try:
                return fn(*args, **kwargs)
            finally:
                self.marks.append((start, self._mark()))
        return timed

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def clear(self) -> None:
        self.marks = []

    def seconds(self) -> float:
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self.marks) / 1e3
        return sum(b - a for a, b in self.marks)


def _muon_spans(opt, device: torch.device) -> dict[str, _Spans]:
    """Time ``opt.step()``, the Muon update in it and Newton-Schulz in that (this process
    only: ranks are processes of their own)."""
    from shardopt import muon, muon_update

    spans = {name: _Spans(device) for name in ("step", "muon_update", "newton_schulz")}
    opt.step = spans["step"].wrap(opt.step)
    muon_update.MuonUpdate.run = spans["muon_update"].wrap(muon_update.MuonUpdate.run)
    muon.newton_schulz = spans["newton_schulz"].wrap(muon.newton_schulz)
    return spans


def run_system(system: str, args: argparse.Namespace, grad_mode: str = "torch",
               optimizer: str = "adamw") -> dict:
    a = {k: getattr(args, k) for k in ("device", "model", "preset", "num_layers", "micro_batch",
                                       "warmup", "iters", "cpu_threads",
                                       "megatron_overlap_param_gather")}
    a["grad_mode"], a["optimizer"] = grad_mode, optimizer
    system_name = system + ("_muon" if optimizer == "muon" else "")
    if system.startswith("shardopt") and grad_mode != "torch":
        system_name = f"{system_name}_{grad_mode}"
    a["state_dtypes"] = {k: getattr(args, k) for k in ("exp_avg_dtype", "exp_avg_sq_dtype",
                                                         "grad_dtype") if getattr(args, k)}
    t0 = time.perf_counter()
    try:
        ranks = _peers.spawn(_worker, args.nproc, system, a, device=args.device,
                             timeout_s=args.timeout)
    except Exception as e:  # noqa: BLE001 - a failing peer is a result, not the end of the run
        msg = str(e) if isinstance(e, _peers.RankFailed) else traceback.format_exc()
        print(f"[{system_name}] FAILED after {time.perf_counter() - t0:.0f} s:\n{msg}",
              flush=True)
        return {"system": system_name, "ok": False, "error": msg[-6000:]}
    r0 = ranks[0]
    tokens = sum(r["tokens_per_iter"] for r in ranks)
    st = _common.stats(r0["iter_s"])
    out = {
        "system": system_name,
        "ok": True,
        "iter_s": st,
        "iter_s_all": r0["iter_s"],
        "tokens_per_iter": tokens,
        "tokens_per_s": tokens / st["median"],
        "parameters": r0["parameters"],
        "losses": r0["losses"],
        "setup_s": r0["setup_s"],
        "wall_s": time.perf_counter() - t0,
        "notes": r0["notes"],
    }
    if r0["muon_timing"]:
        timing = {f"{name}_s": _common.stats(v) for name, v in r0["muon_timing"].items()}
        shares = [ns / step for ns, step in zip(r0["muon_timing"]["newton_schulz"],
                                                r0["muon_timing"]["step"])]
        out["muon_timing"] = {**timing, "newton_schulz_share_of_step": _common.stats(shares),
                              "per_iteration": r0["muon_timing"]}
    for key in ("peak_allocated_steady", "peak_reserved_steady", "peak_allocated_all",
                "peak_reserved_all", "allocated_end"):
        out[key] = max(r[key] for r in ranks)
        out[key + "_per_rank"] = [r[key] for r in ranks]
    print(f"[{system_name}] {st['median'] * 1e3:.1f} ms/iter, {out['tokens_per_s']:.0f} tok/s, "
          f"peak alloc {out['peak_allocated_steady'] / _common.GIB:.2f} GiB, "
          f"loss {r0['losses'][0]:.4f} -> {r0['losses'][-1]:.4f}", flush=True)
    return out


def summary(results: list[dict], nproc: int, model: str, skipped: dict[str, str]) -> str:
    by = {r["system"]: r for r in results if r["ok"]}
    ddp = by.get("ddp")
    rows = []
    for r in results:
        if not r["ok"]:
            rows.append([r["system"], "FAILED", None, None, None, None, None, None])
            continue
        ms = r["iter_s"]["median"] * 1e3
        rows.append([
            r["system"], ms, r["iter_s"]["min"] * 1e3, r["iter_s"]["max"] * 1e3,
            r["tokens_per_s"],
            f"{ms / (ddp['iter_s']['median'] * 1e3):.3f}x" if ddp else None,
            r["peak_allocated_steady"] / _common.GIB, r["peak_reserved_steady"] / _common.GIB,
        ])
    lines = [f"train_iter: {model}, {nproc} rank(s)",
             _common.format_table(rows, ["system", "ms/iter med", "min", "max", "tokens/s",
                                         "time vs ddp", "peak alloc GiB", "peak resv GiB"])]
    lines += [f"{name}: not run: {why}" for name, why in skipped.items()]
    for name in ("shardopt", "shardopt_overlap"):
        ours = by.get(name)
        if ours and ddp:
            ratio = ours["iter_s"]["median"] / ddp["iter_s"]["median"]
            lines.append(f"{name}/ddp iteration time: {ratio:.3f} (target <= 1.03): "
                         f"{'MET' if ratio <= 1.03 else 'MISSED'}")
        buffer = by.get(f"{name}_buffer")
        if ours and buffer:
            ratio = ours["iter_s"]["median"] / buffer["iter_s"]["median"]
            lines.append(f"{name} grad_mode torch/buffer iteration time: {ratio:.3f} "
                         f"(min {ours['iter_s']['min'] * 1e3:.1f} / "
                         f"{buffer['iter_s']['min'] * 1e3:.1f} ms, max "
                         f"{ours['iter_s']['max'] * 1e3:.1f} / "
                         f"{buffer['iter_s']['max'] * 1e3:.1f} ms); peak allocated "
                         f"{ours['peak_allocated_steady'] / _common.GIB:.2f} / "
                         f"{buffer['peak_allocated_steady'] / _common.GIB:.2f} GiB")
        with_muon = by.get(f"{name}_muon")
        if ours and with_muon:
            ratio = with_muon["iter_s"]["median"] / ours["iter_s"]["median"]
            t = with_muon["muon_timing"]
            lines.append(f"{name} Muon/AdamW iteration time: {ratio:.3f}; Muon's step "
                         f"{t['step_s']['median'] * 1e3:.1f} ms, of it the Muon update "
                         f"{t['muon_update_s']['median'] * 1e3:.1f} ms and Newton-Schulz "
                         f"{t['newton_schulz_s']['median'] * 1e3:.1f} ms (share of the step "
                         f"{t['newton_schulz_share_of_step']['median']:.3f})")
        if ours and "megatron" in by:
            ratio = ours["iter_s"]["median"] / by["megatron"]["iter_s"]["median"]
            lines.append(f"{name}/megatron iteration time: {ratio:.3f} (target < 1): "
                         f"{'MET' if ratio < 1 else 'MISSED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=1, help="ranks (one per GPU)")
    p.add_argument("--systems", default=",".join(_peers.SYSTEMS),
                   help=f"comma-separated subset of {','.join(_peers.SYSTEMS)}")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", choices=_common.MODELS, default="gpt",
                   help="the reference GPT, or Hugging Face's LlamaForCausalLM from a config "
                        "(megatron is skipped: it runs only the GPT)")
    p.add_argument("--preset", default="1b", help="the model's preset (1b, tiny for smoke runs)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="override the preset's depth (quick checks at a smaller size)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per iteration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10,
                   help="timed iterations (at least 5): median, min and max of them")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per system")
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads per rank on CPU")
    p.add_argument("--megatron-overlap-param-gather", action="store_true",
                   help="let megatron overlap its param all-gather with the next forward")
    for name in ("exp-avg-dtype", "exp-avg-sq-dtype", "grad-dtype"):
        p.add_argument(f"--{name}", default=None,
                       help="shardopt's state setting (float32, bfloat16; int8 for moments)")
    p.add_argument("--grad-modes", default="torch,buffer",
                   help="OptimizerConfig.grad_mode values each shardopt system runs with")
    p.add_argument("--optimizer", default="adamw",
                   help="adamw and/or muon (comma-separated): the optimizers each shardopt "
                        "system runs with (muon: Muon for the matrices, AdamW for the rest)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="", help="suffix of the result file name")
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(_peers.SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; use --device cpu for a smoke run")
    if args.iters < 5:
        p.error(f"--iters must be at least 5 (a median of repetitions), got {args.iters}")

    skipped = {}
    if args.model != "gpt" and "megatron" in systems:
        skipped["megatron"] = (f"megatron-core runs only the reference GPT here (its "
                               f"TransformerConfig comes from the GPT's config), not --model "
                               f"{args.model}")
        systems.remove("megatron")
    grad_modes = [m for m in args.grad_modes.split(",") if m]
    if set(grad_modes) - {"torch", "buffer"} or not grad_modes:
        p.error(f"--grad-modes takes torch and/or buffer, got {args.grad_modes!r}")
    optimizers = [o for o in args.optimizer.split(",") if o]
    if set(optimizers) - {"adamw", "muon"} or not optimizers:
        p.error(f"--optimizer takes adamw and/or muon, got {args.optimizer!r}")
    results = [run_system(s, args, mode, o) for s in systems
               for o in (optimizers if s.startswith("shardopt") else ["adamw"])
               for mode in (grad_modes if s.startswith("shardopt") else ["torch"])]
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    config = {k: v for k, v in vars(args).items() if k not in ("out", "tag")}
    doc = {**_common.run_header(device, config), "benchmark": "train_iter", "model": args.model,
           "results": results, "skipped": skipped}
    model = "" if args.model == "gpt" else "_hf"
    name = f"train_iter_{args.nproc}gpu{model}{args.tag}.json" if args.device == "cuda" else \
        f"train_iter_cpu_{args.nproc}rank{model}{args.tag}.json"
    _common.write_json(Path(args.out) / name, doc)
    print(summary(results, args.nproc, args.model, skipped))
    failed = [r["system"] for r in results if not r["ok"]]
    if failed:
        print(f"FAILED systems: {', '.join(failed)} (errors in {name})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
