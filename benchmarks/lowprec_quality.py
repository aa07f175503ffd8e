"""Training quality of low-precision optimizer state against fp32, and of Muon against AdamW,
on the reference job.

The reference job's model and task (``small`` preset: ~3.2M params, bf16 weights with fp32
norms, a synthetic Markov task) trained on one rank with shardopt for each state setting
(``exp_avg_dtype / exp_avg_sq_dtype / grad_dtype``) and 3 seeds, the job's schedule (linear
warmup, cosine to 10%) and clipping at 1.0. Per setting it reports the final loss (mean of
the last 20 steps per seed) as mean and spread (max - min) over seeds, and the largest
per-step loss difference to the fp32 run of the same seed; a JSON file and a PNG of the loss
curves (mean over seeds) and of their difference to fp32. ``muon`` trains the matrices with
Muon (``shardopt.muon_groups``, ``adjust_lr_fn="match_rms_adamw"`` so that AdamW's learning
rate and weight decay carry over; ``--muon-lr`` sets another) and the rest with fp32 AdamW.

    PYTHONPATH=src python3 benchmarks/lowprec_quality.py --device cuda --out benchmarks/results
    PYTHONPATH=src python3 benchmarks/lowprec_quality.py --device cpu --steps 20 --seeds 1  # smoke
    PYTHONPATH=src python3 benchmarks/lowprec_quality.py --device cuda --settings fp32,muon \
        --tag _muon --out benchmarks/results  # Muon beside AdamW

It imports the job's parts (model presets, Markov task, batch plan, LR schedule) from wherever
the package keeps them, so it survives the recipes moving.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from shardopt import DistributedOptimizer, OptimizerConfig  # noqa: E402

SETTINGS = {  # name -> OptimizerConfig fields
    "fp32": {},
    "bf16_moments": {"exp_avg_dtype": "bfloat16", "exp_avg_sq_dtype": "bfloat16"},
    "bf16_moments_bf16_grads": {"exp_avg_dtype": "bfloat16", "exp_avg_sq_dtype": "bfloat16",
                                "grad_dtype": "bfloat16"},
    "int8_m_bf16_v": {"exp_avg_dtype": "int8", "exp_avg_sq_dtype": "bfloat16"},
    "int8_moments": {"exp_avg_dtype": "int8", "exp_avg_sq_dtype": "int8"},
    "int8_moments_bf16_grads": {"exp_avg_dtype": "int8", "exp_avg_sq_dtype": "int8",
                               "grad_dtype": "bfloat16"},
}
# Stochastic rounding of the stored moments, for the comparison the docs ask for
# (docs/lowprec.md, "Formats"): not an optimizer option. These settings run the torch step
# (which stores moments through quant.Moment.store_, patched for them) so that the same code
# rounds on CPU and GPU.
STOCHASTIC = {
    "bf16_moments_sr": {"exp_avg_dtype": "bfloat16", "exp_avg_sq_dtype": "bfloat16",
                        "_stochastic": True},
    "int8_moments_sr": {"exp_avg_dtype": "int8", "exp_avg_sq_dtype": "int8",
                        "_stochastic": True},
}
SETTINGS.update(STOCHASTIC)
SETTINGS["muon"] = {"_muon": True}  # Muon for the matrices, fp32 AdamW for the rest
TAIL = 20  # steps averaged for the final loss


def _store_stochastic(self, x: torch.Tensor, gen: torch.Generator) -> None:
    """quant.Moment.store_ with stochastic rounding: bf16 by adding uniform noise below the
    16 dropped mantissa bits and truncating; int8 codes as floor(y / s + u), u in [0, 1)."""
    from shardopt import quant
    if self.scales is None:
        if self.values.dtype != torch.bfloat16:
            self.values.copy_(x)
            return
        bits = x.float().contiguous().view(torch.int32)
        noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device,
                              generator=gen)
        rounded = ((bits + noise) & ~0xFFFF).view(torch.float32)
        self.values.copy_(torch.where(torch.isfinite(x), rounded, x))  # exact: low bits 0
        return
    top = quant.code_max(self.sqrt)
    y = (x.sqrt() if self.sqrt else x).view(-1, quant.QBLOCK)
    torch.div(y.abs().amax(dim=1), top, out=self.scales)
    safe = torch.where(self.scales == 0, 1.0, self.scales)
    u = torch.rand(y.shape, device=y.device, generator=gen)
    self.values.view(-1, quant.QBLOCK).copy_((y / safe[:, None] + u).floor_().clamp_(-top, top))


def job_parts():
    """(model_config, build_model, no_decay, MarkovTask, BatchPlan, local_batches)."""
    for prefix in ("shardopt", "shardopt.recipes"):
        try:
            model = __import__(f"{prefix}.model", fromlist=["x"])
            data = __import__(f"{prefix}.data", fromlist=["x"])
        except ImportError:
            continue
        return (model.model_config, model.build_model, model.no_decay, data.MarkovTask,
                data.BatchPlan, data.local_batches)
    raise SystemExit("cannot find the reference job's model and data modules")


def lr_factor(step: int, steps: int, warmup: int, floor: float = 0.1) -> float:
    """The reference job's schedule: linear warmup, then cosine down to ``floor``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def train(fields: dict, seed: int, args, parts) -> tuple[list[float], dict]:
    model_config, build_model, no_decay, MarkovTask, BatchPlan, local_batches = parts
    mcfg = model_config(args.preset)
    device = torch.device(args.device)
    model = build_model(mcfg, seed=seed, device=device)
    fields = dict(fields)
    stochastic = fields.pop("_stochastic", False)
    if stochastic:
        fields["step_kernel"] = "torch"
    group_fn = no_decay
    if fields.pop("_muon", False):
        from shardopt import muon_groups
        to_muon = muon_groups(model, lr=args.muon_lr or args.lr, weight_decay=0.1,
                              adjust_lr_fn="match_rms_adamw")

        def group_fn(fqn, p):
            return to_muon(fqn, p) or no_decay(fqn, p)
    opt = DistributedOptimizer(model, OptimizerConfig(
        lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0, **fields),
        param_group_fn=group_fn)
    from shardopt import quant
    real_store = quant.Moment.store_
    if stochastic:
        gen = torch.Generator(device=device).manual_seed(10_000 + seed)
        quant.Moment.store_ = lambda self, x: _store_stochastic(self, x, gen)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda e: lr_factor(e, args.steps, max(1, args.steps // 10)))
    task = MarkovTask(vocab_size=mcfg.vocab_size, seq_len=mcfg.seq_len, seed=seed)
    plan = BatchPlan(global_batch_size=args.batch_size, dp_size=1, dp_rank=0,
                     micro_batch_size=args.batch_size)
    losses = []
    for step in range(args.steps):
        (x, y), = local_batches(task, plan, step * args.batch_size)
        loss = model(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(float(loss))
    quant.Moment.store_ = real_store
    return losses, opt.memory_bytes()


def summarise(runs: dict[str, dict[int, list[float]]]) -> dict[str, dict]:
    out = {}
    for name, by_seed in runs.items():
        finals = [sum(v[-TAIL:]) / len(v[-TAIL:]) for v in by_seed.values()]
        diffs = [max(abs(a - b) for a, b in zip(v, runs["fp32"][s])) for s, v in by_seed.items()]
        out[name] = {"final_loss_mean": sum(finals) / len(finals),
                     "final_loss_spread": max(finals) - min(finals),
                     "final_loss_per_seed": finals,
                     "max_step_loss_diff_vs_fp32": max(diffs)}
    return out


def plot(runs: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ref = [sum(c) / len(c) for c in zip(*runs["fp32"].values())]
    for name, by_seed in runs.items():
        mean = [sum(c) / len(c) for c in zip(*by_seed.values())]
        top.plot(mean, label=name, lw=1)
        bottom.plot([a - b for a, b in zip(mean, ref)], label=name, lw=1)
    top.set_ylabel("loss (mean over seeds)")
    top.set_yscale("log")
    bottom.set_ylabel("loss - fp32 loss")
    bottom.set_xlabel("step")
    top.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--muon-lr", type=float, default=None,
                    help="the muon setting's Muon learning rate (default: --lr)")
    ap.add_argument("--settings", default=",".join(n for n in SETTINGS if n not in STOCHASTIC),
                    help=f"comma-separated names, of {', '.join(SETTINGS)}")
    ap.add_argument("--tag", default="", help="suffix of the result files' names")
    args = ap.parse_args(argv)
    names = args.settings.split(",")
    if "fp32" not in names:
        names.insert(0, "fp32")
    parts = job_parts()
    runs: dict[str, dict[int, list[float]]] = {}
    memory, seconds = {}, {}
    t_all = time.perf_counter()
    for name in names:
        runs[name] = {}
        t0 = time.perf_counter()
        for seed in range(args.seeds):
            runs[name][seed], memory[name] = train(SETTINGS[name], seed, args, parts)
        seconds[name] = time.perf_counter() - t0
        tail = runs[name][0][-TAIL:]
        print(f"{name:26s} final loss {sum(tail) / len(tail):.4f} (seed 0), "
              f"{seconds[name]:.0f} s", flush=True)
    summary = summarise(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {**_common.run_header(torch.device(args.device), vars(args)),
           "args": vars(args), "settings": {n: {k: v for k, v in SETTINGS[n].items()}
                                            for n in names}, "summary": summary,
           "memory_bytes": memory, "seconds": seconds,
           "seconds_total": time.perf_counter() - t_all, "losses": runs}
    stem = f"lowprec_quality{args.tag}"
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    plotted = plot(runs, out / f"{stem}.png")
    for name, s in summary.items():
        print(f"{name:26s} {s['final_loss_mean']:.4f} +- {s['final_loss_spread'] / 2:.4f}  "
              f"max step diff vs fp32 {s['max_step_loss_diff_vs_fp32']:.4f}")
    print(f"wrote {out / stem}.json" + (" and .png" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
