"""``shardopt demo``: interrupt a run, resume it on a different DP size, compare with a clean run.

1. Train the ``tiny`` preset on 2 CPU ranks, saving every ``save_every`` steps, and stop at
   ``stop_at`` as if the job had been killed (the steps after the last checkpoint are lost).
2. Resume from the latest checkpoint with ``--low-memory-resume`` on 3 ranks and finish.
3. Train the same job uninterrupted on 2 ranks.
4. Compare the two loss curves and plot them.

Each phase is a real ``shardopt train`` command line, printed before it runs. Until the resume the
interrupted run is the reference run bit for bit (same ranks, same data); after it the reductions run
over 3 ranks instead of 2, so the curves agree closely but not bitwise.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class DemoPlan:
    steps: int = 150
    save_every: int = 25
    stop_at: int = 90
    batch_size: int = 12
    preset: str = "tiny"

    @property
    def resume_step(self) -> int:
        return self.stop_at // self.save_every * self.save_every


def _train(args: list[str]) -> float:
    cmd = [sys.executable, "-m", "shardopt", "train", *args]
    print(f"\n$ shardopt train {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        raise RuntimeError(f"`shardopt train {' '.join(args)}` failed with exit code {proc.returncode}")
    return time.perf_counter() - t0


def _read_log(path: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, path.read_text().splitlines())}


def main(out_dir: str = "demo_out", plan: DemoPlan | None = None) -> int:
    plan = plan or DemoPlan()
    out = Path(out_dir)
    ckpt, run_log, reference_log = out / "ckpt", out / "run.jsonl", out / "reference.jsonl"
    killed_log = out / "killed.jsonl"
    for stale in (ckpt, run_log, reference_log, killed_log):
        if stale.is_dir():
            shutil.rmtree(stale)
        elif stale.exists():
            stale.unlink()
    out.mkdir(parents=True, exist_ok=True)
    common = ["--preset", plan.preset, "--steps", str(plan.steps), "--batch-size", str(plan.batch_size)]

    t_start = time.perf_counter()
    print(f"[demo] 1/3: train on 2 ranks, save every {plan.save_every} steps, "
          f"killed after step {plan.stop_at}")
    _train([*common, "--nproc", "2", "--ckpt-dir", str(ckpt), "--save-every", str(plan.save_every),
            "--keep-last", "2", "--stop-at", str(plan.stop_at), "--log-file", str(run_log)])
    shutil.copy(run_log, killed_log)  # the resume drops the lost steps from run_log; keep them for the plot
    print(f"\n[demo] 2/3: resume on 3 ranks from the step-{plan.resume_step} checkpoint "
          "with Adam moments on the host until the first step")
    _train([*common, "--nproc", "3", "--ckpt-dir", str(ckpt), "--save-every", str(plan.save_every),
            "--keep-last", "2", "--resume", "--low-memory-resume", "--log-file", str(run_log)])
    print("\n[demo] 3/3: the same job uninterrupted on 2 ranks")
    _train([*common, "--nproc", "2", "--log-file", str(reference_log)])

    resumed, reference = _read_log(run_log), _read_log(reference_log)
    if sorted(resumed) != sorted(reference) or len(reference) != plan.steps:
        raise RuntimeError(f"logs do not cover steps 1..{plan.steps}: {run_log}, {reference_log}")
    before = [s for s in reference if s <= plan.resume_step]
    after = [s for s in reference if s > plan.resume_step]
    identical_before = all(resumed[s] == reference[s] for s in before)
    diffs = [abs(resumed[s] - reference[s]) for s in after]
    max_diff = max(diffs)
    max_rel = max(abs(resumed[s] - reference[s]) / abs(reference[s]) for s in after)
    final = plan.steps

    print("\n[demo] results")
    print(f"  steps 1-{plan.resume_step} (2 ranks in both runs): "
          + ("identical, bit for bit" if identical_before else "DIFFERENT (unexpected)"))
    print(f"  steps {plan.resume_step + 1}-{final} (resumed on 3 ranks vs 2): max |loss diff| = "
          f"{max_diff:.2e} (max relative {max_rel:.2%}), mean {sum(diffs) / len(diffs):.2e}")
    print(f"  final loss: resumed {resumed[final]:.4f}, uninterrupted {reference[final]:.4f} "
          f"(started at {reference[1]:.4f})")
    agree = identical_before and max_rel < 0.05
    print("  the loss curves agree" if agree else "  the loss curves DO NOT agree")
    png = _plot(out / "loss_curves.png", _read_log(killed_log), resumed, reference, plan)
    if png:
        print(f"  plot: {png}")
    print(f"  checkpoints: {ckpt}  (try `shardopt inspect {ckpt}` and `shardopt verify {ckpt}`)")
    print(f"[demo] total time {time.perf_counter() - t_start:.0f}s")
    return 0 if agree else 1


def _best_loss(plan: DemoPlan) -> float:
    from shardopt.recipes.data import MarkovTask
    from shardopt.recipes.model import model_config

    cfg = model_config(plan.preset)
    return MarkovTask(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, seed=0).entropy_rate()


def _plot(path: Path, killed: dict[int, float], resumed: dict[int, float], reference: dict[int, float],
          plan: DemoPlan) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib is not installed: no plot; `pip install shardopt[plot]`)")
        return None
    steps = sorted(reference)
    fig, (ax, dax) = plt.subplots(2, 1, figsize=(8, 6), dpi=120, sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1]})
    ax.plot(steps, [reference[s] for s in steps], color="black", lw=2.2, label="uninterrupted, 2 ranks")
    first = sorted(killed)
    second = [s for s in steps if s > plan.resume_step]
    ax.plot(first, [killed[s] for s in first], color="tab:orange", lw=1.2, ls="--",
            label="interrupted run, 2 ranks")
    ax.plot(second, [resumed[s] for s in second], color="tab:blue", lw=1.2, ls="--",
            label="resumed, 3 ranks (low-memory resume)")
    ax.axhline(_best_loss(plan), color="gray", lw=0.8, label="entropy of the task (best possible)")
    dax.plot(steps, [resumed[s] - reference[s] for s in steps], color="tab:blue", lw=1)
    for a in (ax, dax):
        a.axvline(plan.stop_at, color="tab:red", lw=1, ls=":")
        a.axvline(plan.resume_step, color="tab:green", lw=1, ls=":")
        a.grid(alpha=0.3)
    ax.plot([], [], color="tab:red", lw=1, ls=":", label=f"killed after step {plan.stop_at}")
    ax.plot([], [], color="tab:green", lw=1, ls=":", label=f"resumed from the step-{plan.resume_step} checkpoint")
    ax.set_ylabel("training loss")
    ax.set_title("shardopt: killed, resumed on a different DP size, vs uninterrupted")
    ax.legend(fontsize=8)
    dax.set_xlabel("step")
    dax.set_ylabel("resumed − clean")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
