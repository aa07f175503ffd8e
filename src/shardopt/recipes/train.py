"""The reference training job: a small GPT on a synthetic Markov task, on the public API only.

One call of :func:`run` is one DP rank. It builds the model, a :class:`shardopt.DistributedOptimizer`
(no weight decay on vectors), a warmup + cosine ``LambdaLR``, and trains ``steps`` optimizer steps,
saving with :func:`shardopt.checkpoint.save` every ``save_every`` steps. With ``resume`` it first loads
a checkpoint; the data position (next global sample index) and the scheduler state travel in the
checkpoint's JSON ``extra``, so an interrupted and resumed run sees the same batches and learning
rates as an uninterrupted one, also at a different DP size.

Rank 0 alone prints logs, shows the progress bar and writes the per-step JSONL metrics log.
Starting the ranks is :mod:`shardopt.recipes.launch`'s job.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

import shardopt
from shardopt import checkpoint
from shardopt.recipes.data import BatchPlan, MarkovTask, local_batches
from shardopt.recipes.paths import check_paths
from shardopt.recipes.model import PRESETS, build_model, count_params, model_config, no_decay


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one run of the reference job needs (the CLI's ``train`` flags map onto it).

    On resume these values hold, also where the checkpoint was saved with others;
    :func:`saved_hyperparameters` reads those (the CLI takes them for flags not given).
    """

    preset: str = "tiny"
    """Model size: one of :data:`shardopt.recipes.model.PRESETS`."""
    steps: int = 100
    """Optimizer steps of the whole run; also the length of the LR schedule."""
    stop_at: int | None = None
    """Stop after this step as if interrupted (no extra save); ``None`` runs to ``steps``."""
    batch_size: int = 12
    """Global batch: samples per optimizer step over all ranks (must divide evenly over them)."""
    micro_batch_size: int | None = None
    """Samples per forward/backward on one rank; fewer than the per-rank batch means accumulation."""
    lr: float = 3e-3
    """Peak learning rate."""
    warmup_steps: int | None = None
    """Linear warmup length; ``None`` means 10% of ``steps``."""
    min_lr_ratio: float = 0.1
    """The cosine decays to ``lr * min_lr_ratio`` at ``steps``."""
    weight_decay: float = 0.1
    max_grad_norm: float | None = 1.0
    seed: int = 0
    """Seeds the weights and the data."""
    device: str = "cpu"
    """``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per rank by ``LOCAL_RANK``)."""
    ckpt_dir: str | None = None
    """Checkpoint root; ``None`` saves nothing."""
    save_every: int = 0
    """Save every this many steps (and at the last step); 0 saves only at the last step."""
    keep_last: int | None = None
    """Keep this many newest checkpoints in ``ckpt_dir``; ``None`` keeps all."""
    async_save: bool = False
    """Write checkpoints in the background (training goes on); the job waits for the last."""
    async_snapshot: str = "host"
    """Where an asynchronous save copies the state: ``checkpoint.CheckpointConfig.snapshot``."""
    resume: bool | str = False
    """``True``: the latest checkpoint in ``ckpt_dir`` (fresh start if none); a string: that path."""
    low_memory_resume: bool = False
    """Keep loaded Adam moments on the host until the first step."""
    log_file: str | None = None
    """Per-step metrics as JSON lines (rank 0); on resume, entries past the checkpoint are dropped."""
    progress: bool = True
    """Show a progress bar on rank 0 (only on a terminal)."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose from {', '.join(PRESETS)}")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ValueError(f"--stop-at must be in [1, steps={self.steps}], got {self.stop_at}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.save_every < 0:
            raise ValueError(f"--save-every must be >= 0, got {self.save_every}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"--keep-last must be >= 1, got {self.keep_last}")
        if self.async_snapshot not in checkpoint.SNAPSHOTS:
            raise ValueError(f"--async-save takes one of {', '.join(checkpoint.SNAPSHOTS)}, "
                             f"got {self.async_snapshot!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if (self.save_every or self.keep_last) and self.ckpt_dir is None:
            raise ValueError("--save-every and --keep-last need --ckpt-dir")
        if self.resume is True and self.ckpt_dir is None:
            raise ValueError("--resume without a path needs --ckpt-dir")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")

    @property
    def num_warmup_steps(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 10)


def lr_lambda(cfg: TrainConfig):
    """Multiplier of the peak LR at scheduler epoch ``e`` (= steps done): linear warmup, then cosine."""
    warmup, total, floor = cfg.num_warmup_steps, cfg.steps, cfg.min_lr_ratio

    def fn(e: int) -> float:
        if e < warmup:
            return (e + 1) / warmup
        progress = min(1.0, (e - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


class Rank0:
    """Logs, progress bar and metrics file; silent on every rank but 0."""

    def __init__(self, cfg: TrainConfig, rank: int) -> None:
        self.active = rank == 0
        self.cfg = cfg
        self.bar: tqdm | None = None
        self.metrics = None

    def log(self, msg: str) -> None:
        if self.active:
            tqdm.write(f"[shardopt] {msg}", file=sys.stderr)

    def open_metrics(self, resumed_step: int) -> None:
        if not (self.active and self.cfg.log_file):
            return
        path = Path(self.cfg.log_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resumed_step and path.exists():
            # Steps after the checkpoint were lost with the interrupted run; they are redone now.
            kept = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= resumed_step]
        path.write_text("".join(ln + "\n" for ln in kept))
        self.metrics = path.open("a")

    def start_bar(self, start: int, end: int) -> None:
        if self.active and self.cfg.progress:
            self.bar = tqdm(total=end, initial=start, desc="train", unit="step", disable=None,
                            dynamic_ncols=True, file=sys.stderr)

    def status(self, text: str) -> None:
        """Show what rank 0 is doing in the bar (saving a large checkpoint takes a while)."""
        if self.bar is not None:
            self.bar.set_description_str(text)

    def record(self, row: dict[str, Any]) -> None:
        if not self.active:
            return
        if self.metrics is not None:
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"loss={row['loss']:.4f} lr={row['lr']:.2e} tok/s={row['tokens_per_s']:,.0f} "
                f"mem={_format_mem(row)}", refresh=False
            )
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.metrics is not None:
            self.metrics.close()


def _format_mem(row: dict[str, Any]) -> str:
    if "cuda_max_allocated_bytes" in row:
        return f"{row['cuda_max_allocated_bytes'] / 2**30:.2f}GiB"
    return f"{row['host_peak_rss_bytes'] / 2**20:.0f}MiB"


_RU_MAXRSS_UNIT = 1024  # getrusage reports the peak RSS in KiB (Linux)


def _memory(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        return {
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    return {"host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RU_MAXRSS_UNIT}


def setup_distributed(device_kind: str) -> tuple[int, int, torch.device]:
    """Join the job described by the torchrun environment (if any); returns rank, size, device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was given but CUDA is not available")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:
            # As torchrun does: one thread per rank. Ranks that share cores and spin in OpenMP
            # barriers slow each other down by orders of magnitude on small CPU machines.
            torch.set_num_threads(1)
    if world > 1 and not dist.is_initialized():
        if device_kind == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    return 0, 1, device


def _resume_source(cfg: TrainConfig) -> str | None:
    if cfg.resume is True:
        return cfg.ckpt_dir if checkpoint.latest(cfg.ckpt_dir) is not None else None
    return cfg.resume or None


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Collective over the job's ranks. Train (resuming if asked); returns rank 0's summary."""
    check_paths(cfg)
    rank, dp_size, device = setup_distributed(cfg.device)
    out = Rank0(cfg, rank)
    mcfg = model_config(cfg.preset)
    micro = cfg.micro_batch_size or cfg.batch_size // dp_size
    plan = BatchPlan(global_batch_size=cfg.batch_size, dp_size=dp_size, dp_rank=rank, micro_batch_size=micro)
    task = MarkovTask(vocab_size=mcfg.vocab_size, seq_len=mcfg.seq_len, seed=cfg.seed)

    model = build_model(mcfg, seed=cfg.seed, device=device)
    opt = shardopt.DistributedOptimizer(
        model,
        shardopt.OptimizerConfig(
            lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
            max_grad_norm=cfg.max_grad_norm, low_memory_resume=cfg.low_memory_resume,
        ),
        param_group_fn=no_decay,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    out.log(
        f"preset {cfg.preset}: {count_params(model) / 1e6:.2f}M params, {dp_size} rank(s) on {device.type}, "
        f"global batch {cfg.batch_size} x {mcfg.seq_len} tokens "
        f"({plan.num_micro_batches} micro-batch(es) of {micro} per rank)"
    )

    start_step, next_sample = 0, 0
    source = _resume_source(cfg)
    if cfg.resume is True and source is None:
        out.log(f"no checkpoint in {cfg.ckpt_dir}; starting fresh")
    if source is not None:
        out.log(f"loading {source} ...")
        t0 = time.perf_counter()
        info = checkpoint.load(source, model, opt, low_memory_resume=cfg.low_memory_resume)
        start_step, next_sample = _apply_extra(info, sched, opt, cfg)
        out.log(f"resumed from {info.path} (step {start_step}) in {time.perf_counter() - t0:.2f}s"
                + (", Adam moments on host until the first step" if cfg.low_memory_resume else ""))
    end = cfg.stop_at or cfg.steps
    if start_step >= end:
        out.log(f"checkpoint is at step {start_step}, nothing to do for --steps {cfg.steps}")
    out.open_metrics(start_step)
    out.start_bar(start_step, end)

    tokens_per_step = cfg.batch_size * mcfg.seq_len
    loss_value = float("nan")
    pending: tuple[int, checkpoint.SaveHandle] | None = None
    try:
        for step in range(start_step + 1, end + 1):
            t0 = time.perf_counter()
            lr = opt.param_groups[0]["lr"]
            loss = _train_step(model, opt, local_batches(task, plan, next_sample), device)
            sched.step()
            next_sample += cfg.batch_size
            if dp_size > 1:
                dist.all_reduce(loss)
                loss /= dp_size
            loss_value = float(loss)
            dt = time.perf_counter() - t0
            out.record({
                "step": step, "loss": loss_value, "lr": lr, "grad_norm": opt.last_grad_norm,
                "tokens_per_s": tokens_per_step / dt, "step_time_s": dt, "dp_size": dp_size,
                **_memory(device),
            })
            last = step == cfg.steps
            if cfg.ckpt_dir and (last or (cfg.save_every and step % cfg.save_every == 0)):
                handle = _save(cfg, model, opt, sched, step, next_sample, out)
                pending = (step, handle) if handle is not None else pending
        if pending is not None:  # the job ends only when its last checkpoint is committed
            out.status("waiting for the last checkpoint")
            out.log(f"saved step {pending[0]} to {pending[1].wait()}")
    finally:
        out.close()
    if end < cfg.steps:
        out.log(f"stopped at step {end} of {cfg.steps} (--stop-at)")
    return {"step": max(start_step, end), "loss": loss_value, "dp_size": dp_size}


def _train_step(model, opt, batches, device) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches; returns the local mean loss (detached)."""
    total = torch.zeros((), device=device)
    for i, (x, y) in enumerate(batches):
        sync = i == len(batches) - 1
        with contextlib.nullcontext() if sync else opt.no_sync():
            loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) / len(batches)
            loss.backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad()
    return total


def _save(cfg, model, opt, sched, step, next_sample, out: Rank0) -> checkpoint.SaveHandle | None:
    out.status(f"saving step {step}")
    t0 = time.perf_counter()
    extra = {
        "data": {"next_sample": next_sample, "seed": cfg.seed, "global_batch_size": cfg.batch_size},
        "scheduler": _json_safe(sched.state_dict()),
        "train": {"preset": cfg.preset, "steps": cfg.steps, "lr": cfg.lr,
                  "warmup_steps": cfg.num_warmup_steps},
    }
    saved = checkpoint.save(cfg.ckpt_dir, model, opt, step=step, extra=extra,
                            blocking=not cfg.async_save, keep_last=cfg.keep_last,
                            config=checkpoint.CheckpointConfig(snapshot=cfg.async_snapshot))
    out.status("train")
    if isinstance(saved, checkpoint.SaveHandle):
        out.log(f"saving step {step} in the background (training paused {time.perf_counter() - t0:.2f}s)")
        return saved
    out.log(f"saved step {step} to {saved} in {time.perf_counter() - t0:.2f}s")
    return None


def _apply_extra(info, sched, opt, cfg: TrainConfig) -> tuple[int, int]:
    """Restore the scheduler and data position from a checkpoint's ``extra``.

    The config's peak LR and schedule length hold from here on, also where they differ from the
    saved run's (the CLI fills flags not given from :func:`saved_hyperparameters`).
    """
    extra = info.extra or {}
    saved_hyperparameters(extra, info.path)
    sched.load_state_dict(extra["scheduler"])
    sched.base_lrs = [cfg.lr] * len(opt.param_groups)
    factor = lr_lambda(cfg)(sched.last_epoch)
    for group in opt.param_groups:
        group["initial_lr"] = cfg.lr
        # The LR the uninterrupted run uses for the next step (LambdaLR's own formula).
        group["lr"] = cfg.lr * factor
    return int(info.step), int(extra["data"]["next_sample"])


# TrainConfig field -> where ``_save`` keeps it in the checkpoint's ``extra``.
_SAVED_AT = {
    "preset": ("train", "preset"), "steps": ("train", "steps"), "lr": ("train", "lr"),
    "warmup_steps": ("train", "warmup_steps"), "seed": ("data", "seed"),
    "batch_size": ("data", "global_batch_size"),
}


def saved_hyperparameters(extra: dict[str, Any], path: str) -> dict[str, Any]:
    """The run settings a checkpoint of this job was saved with, by :class:`TrainConfig` field.

    Checkpoints from older versions of the job lack some (``warmup_steps``); those are left out.
    Raises ``ValueError`` naming ``path`` if the checkpoint was not written by this job.
    """
    if not isinstance(extra.get("data"), dict) or "scheduler" not in extra:
        raise ValueError(f"checkpoint {path} was not written by `shardopt train` "
                         "(no data position / scheduler state in its extra)")
    return {field: extra[part][key] for field, (part, key) in _SAVED_AT.items()
            if key in extra.get(part, {})}


def _json_safe(state: dict[str, Any]) -> dict[str, Any]:
    """A scheduler ``state_dict`` as JSON: ``LambdaLR`` keeps ``None`` for plain-function lambdas."""
    try:
        return json.loads(json.dumps(state))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"LR scheduler state is not JSON-serialisable: {exc}") from None
