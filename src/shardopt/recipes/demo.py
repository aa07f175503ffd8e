"""``shardopt demo``: kill a run, resume it on a different DP size, compare with a clean run.

1. Train the ``tiny`` preset on 2 CPU ranks, saving every ``save_every`` steps. When the step
   ``kill_at`` is logged (a save step: its checkpoint is being written), SIGKILL the job's process
   group, launcher and ranks. Checkpoints committed before survive; the one in flight is not
   committed, so ``latest`` still names the previous one (or, if that save won the race, this one).
2. Resume from ``latest`` with ``--low-memory-resume`` on 3 ranks and finish. The command gives no
   hyperparameters: it takes them from the checkpoint.
3. Train the same job uninterrupted on 2 ranks.
4. Compare the loss curves and plot them.

Each phase is a real ``shardopt train`` command line, printed before it runs. Until the kill the
killed run is the reference run bit for bit (same ranks, same data); after the resume the reductions
run over 3 ranks instead of 2, so the curves agree closely but not bitwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shardopt import checkpoint

# How often the demo looks at the log and the checkpoint root while waiting to kill.
_POLL_S = 0.001
# How long the step-``kill_at`` save may take to show up before the kill goes ahead regardless.
_SAVE_START_TIMEOUT_S = 5.0
# After the resume the reductions run over 3 ranks: the losses differ by rounding, far below this.
_AGREE_REL = 0.05


@dataclass(frozen=True, kw_only=True)
class DemoPlan:
    steps: int = 150
    save_every: int = 25
    kill_at: int = 75
    """A save step after the first: the job dies while this step's checkpoint is written."""
    batch_size: int = 12
    preset: str = "tiny"

    def __post_init__(self) -> None:
        if self.kill_at % self.save_every or not self.save_every < self.kill_at < self.steps:
            raise ValueError(f"kill_at={self.kill_at} must be a multiple of save_every="
                             f"{self.save_every} after the first save and before steps={self.steps}")


def _command(args: list[str]) -> list[str]:
    print(f"\n$ shardopt train {' '.join(args)}", flush=True)
    return [sys.executable, "-m", "shardopt", "train", *args]


def _train(args: list[str]) -> None:
    proc = subprocess.run(_command(args))
    if proc.returncode != 0:
        raise RuntimeError(f"`shardopt train {' '.join(args)}` failed with exit code {proc.returncode}")


def _read_log(path: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, path.read_text().splitlines())}


def _last_step(log: Path) -> int:
    """The step of the last complete line of the run's log (the job may be writing the next)."""
    try:
        text = log.read_text()
    except FileNotFoundError:
        return 0
    lines = text[:text.rfind("\n") + 1].splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


def _save_started(ckpt: Path, step: int) -> bool:
    """True once the save of ``step`` has left a trace in the root: its directory, committed or
    still being written (whatever the library names the unfinished one, it carries the step)."""
    tag = f"{step:08d}"
    return ckpt.is_dir() and any(tag in p.name for p in ckpt.iterdir())


def _train_and_kill(args: list[str], log: Path, ckpt: Path, kill_at: int) -> None:
    """Run ``shardopt train`` and SIGKILL its process group once step ``kill_at`` is logged and
    that step's save has begun."""
    proc = subprocess.Popen(_command(args), start_new_session=True)
    try:
        while _last_step(log) < kill_at:
            if proc.poll() is not None:
                raise RuntimeError(f"`shardopt train` ended (exit code {proc.returncode}) before "
                                   f"step {kill_at}, where the demo meant to kill it")
            time.sleep(_POLL_S)
        deadline = time.monotonic() + _SAVE_START_TIMEOUT_S
        while not _save_started(ckpt, kill_at) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if proc.returncode != -signal.SIGKILL:
        raise RuntimeError(f"`shardopt train` ended with exit code {proc.returncode}, not by the kill")


def _describe_root(ckpt: Path) -> tuple[Path, int]:
    """Print what the kill left under the checkpoint root; returns ``latest`` and its step."""
    latest = checkpoint.latest(ckpt)
    if latest is None:
        raise RuntimeError(f"no committed checkpoint in {ckpt} after the kill")
    latest = Path(latest)
    step = checkpoint.inspect(latest)["step"]
    entries = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".lock"))
    committed = [n for n in entries if (ckpt / n).is_dir() and (ckpt / n / "manifest.json").exists()]
    others = [n for n in entries if n not in committed and n != "latest"]
    print(f"  committed checkpoints: {', '.join(committed)}; latest -> {latest.name}")
    if others:
        print(f"  also there, not committed (never loaded): {', '.join(others)}")
    return latest, step


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
    keep = ["--ckpt-dir", str(ckpt), "--save-every", str(plan.save_every), "--keep-last", "2",
            "--log-file", str(run_log)]
    job = ["--preset", plan.preset, "--steps", str(plan.steps), "--batch-size", str(plan.batch_size)]

    t_start = time.perf_counter()
    print(f"[demo] 1/3: train on 2 ranks, save every {plan.save_every} steps, SIGKILL the job "
          f"while it saves step {plan.kill_at}")
    _train_and_kill([*job, "--nproc", "2", *keep], run_log, ckpt, plan.kill_at)
    shutil.copy(run_log, killed_log)  # the resume drops the lost steps from run_log; keep them for the plot
    killed = _read_log(killed_log)
    print(f"\n[demo] killed after step {max(killed)}")
    latest, resume_step = _describe_root(ckpt)
    print(f"\n[demo] 2/3: resume on 3 ranks from {latest.name} (step {resume_step}), "
          "with Adam moments on the host until the first step")
    _train(["--nproc", "3", *keep, "--resume", "--low-memory-resume"])
    print("\n[demo] 3/3: the same job uninterrupted on 2 ranks")
    _train([*job, "--nproc", "2", "--log-file", str(reference_log)])

    resumed, reference = _read_log(run_log), _read_log(reference_log)
    if sorted(resumed) != sorted(reference) or len(reference) != plan.steps:
        raise RuntimeError(f"logs do not cover steps 1..{plan.steps}: {run_log}, {reference_log}")
    identical_killed = all(killed[s] == reference[s] for s in killed)
    identical_before = all(resumed[s] == reference[s] for s in reference if s <= resume_step)
    after = [s for s in reference if s > resume_step]
    diffs = [abs(resumed[s] - reference[s]) for s in after]
    max_rel = max(abs(resumed[s] - reference[s]) / abs(reference[s]) for s in after)
    final = plan.steps

    print("\n[demo] results")
    print(f"  steps 1-{max(killed)}, the killed run (2 ranks in both runs): "
          + ("identical, bit for bit" if identical_killed else "DIFFERENT (unexpected)"))
    print(f"  steps 1-{resume_step}, the resumed run's log up to its checkpoint: "
          + ("identical, bit for bit" if identical_before else "DIFFERENT (unexpected)"))
    print(f"  steps {resume_step + 1}-{final} (resumed on 3 ranks vs 2): max |loss diff| = "
          f"{max(diffs):.2e} (max relative {max_rel:.2%}), mean {sum(diffs) / len(diffs):.2e}")
    print(f"  final loss: resumed {resumed[final]:.4f}, uninterrupted {reference[final]:.4f} "
          f"(started at {reference[1]:.4f})")
    agree = identical_killed and identical_before and max_rel < _AGREE_REL
    print("  the loss curves agree" if agree else "  the loss curves DO NOT agree")
    png = _plot(out / "loss_curves.png", killed, resumed, reference, plan, resume_step)
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
          plan: DemoPlan, resume_step: int) -> Path | None:
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
    second = [s for s in steps if s > resume_step]
    ax.plot(first, [killed[s] for s in first], color="tab:orange", lw=1.2, ls="--",
            label="killed run, 2 ranks")
    ax.plot(second, [resumed[s] for s in second], color="tab:blue", lw=1.2, ls="--",
            label="resumed, 3 ranks (low-memory resume)")
    ax.axhline(_best_loss(plan), color="gray", lw=0.8, label="entropy of the task (best possible)")
    dax.plot(steps, [resumed[s] - reference[s] for s in steps], color="tab:blue", lw=1)
    for a in (ax, dax):
        a.axvline(max(killed), color="tab:red", lw=1, ls=":")
        a.axvline(resume_step, color="tab:green", lw=1, ls=":")
        a.grid(alpha=0.3)
    ax.plot([], [], color="tab:red", lw=1, ls=":", label=f"killed (SIGKILL) after step {max(killed)}")
    ax.plot([], [], color="tab:green", lw=1, ls=":", label=f"resumed from the step-{resume_step} checkpoint")
    ax.set_ylabel("training loss")
    ax.set_title("shardopt: killed, resumed on a different DP size, vs uninterrupted")
    ax.legend(fontsize=8)
    dax.set_xlabel("step")
    dax.set_ylabel("resumed − clean")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
