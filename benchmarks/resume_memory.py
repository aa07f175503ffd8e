"""Resume memory: is a resumed run's GPU memory ever above the fresh run's? shardopt vs FSDP2 vs megatron-core.

Every run is its own process (so allocator state starts clean) with ``--nproc`` ranks, one GPU each:

* fresh    : build model + optimizer, ``--iters`` iterations, save a checkpoint.
* resumed  : build model + optimizer, load that checkpoint, ``--iters`` iterations.

for shardopt (resumed with the default load and with ``low_memory_resume=True``), PyTorch FSDP2 +
torch.distributed.checkpoint, and megatron-core's DistributedOptimizer (see ``_resume_systems.py``),
on the ``--preset`` of ``--model``: ``gpt`` (default), the reference GPT of ``shardopt.recipes``,
or ``hf-llama``, Hugging Face's ``LlamaForCausalLM`` built from a config
(``_common.HF_LLAMA_PRESETS``; megatron-core runs only the GPT and is skipped, with the reason in
the result).
GPU peaks (allocated and reserved) are taken per phase: the load, and each iteration (the
allocator's peak counters are reset at every event, see ``_common.MemoryTimeline``). Host RSS is
sampled during the load and the save.

Targets (allocated and reserved, each rank, 1% allowed for noise):

* low_memory_resume: resumed iteration k peak <= fresh iteration k peak (k = 1..iters), and the
  load's peak <= every fresh iteration's peak;
* default load: peak over load + iterations <= the fresh run's peak over its iterations;
* host RSS growth during a default load <= 512 MiB.

Outputs ``resume_memory.json`` and ``resume_memory.png`` under ``--out`` (``resume_memory_hf.*``
for the Hugging Face model, ``_dp2`` before it at DP 2)::

    PYTHONPATH=src python3 benchmarks/resume_memory.py --out benchmarks/results            # 1 GPU
    PYTHONPATH=src python3 benchmarks/resume_memory.py --model hf-llama --out benchmarks/results
    PYTHONPATH=src python3 benchmarks/resume_memory.py --nproc 2 --out benchmarks/results  # DP 2
    PYTHONPATH=src python3 benchmarks/resume_memory.py --device cpu --preset tiny          # smoke
    PYTHONPATH=src python3 benchmarks/resume_memory.py --device cpu --preset tiny --model hf-llama
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import GIB, MIB  # noqa: E402

SYSTEMS = ("shardopt", "fsdp2", "megatron")
MODES = {"shardopt": ("fresh", "default", "low_memory"), "fsdp2": ("fresh", "default"),
         "megatron": ("fresh", "default")}
RSS_LIMIT = 512 * MIB
NOISE = 0.01


# ============================================================================= one run (a process)
def build_gpt(preset: str, seq_len: int | None, device: torch.device, seed: int):
    """The preset's GPT on ``device``, initialised on the device (fast; values are irrelevant here)."""
    from shardopt.recipes.model import GPT, model_config

    cfg = model_config(preset, **({"seq_len": seq_len} if seq_len else {}))
    with torch.device("meta"):
        model = GPT(cfg)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            if p.ndim == 1 and fqn.endswith(".weight"):
                p.fill_(1.0)
            elif fqn.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def build_model(a: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """The run's ``--model`` of ``--preset`` on ``device``."""
    if a["model"] == "gpt":
        return build_gpt(a["preset"], a["seq_len"], device, seed=0)
    return _common.build_model(a["model"], a["preset"], device, seed=0)


def batch(model: torch.nn.Module, a: dict[str, Any], rank: int, index: int,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` of ``rank``: random tokens over the model's vocabulary, as
    ``(inputs, labels)`` (for ``hf-llama`` the labels are the inputs: the model shifts them)."""
    if a["model"] == "gpt":
        vocab_size, seq_len = model.config.vocab_size, model.config.seq_len
    else:
        config = model.lm.config
        vocab_size, seq_len = config.vocab_size, a["seq_len"] or config.max_position_embeddings
    gen = torch.Generator().manual_seed(1_000_003 * index + rank)
    tokens = torch.randint(vocab_size, (a["micro_batch"], seq_len + 1), generator=gen)
    tokens = tokens.to(device)
    labels = tokens[:, 1:] if a["model"] == "gpt" else tokens[:, :-1]
    return tokens[:, :-1], labels


def make_system(name: str, mode: str, model, device: torch.device, a: dict[str, Any]):
    import _resume_systems as rs

    if name == "shardopt":
        return rs.Shardopt(model, low_memory_resume=(mode == "low_memory"))
    if name == "fsdp2":
        return rs.FSDP2(model, device)
    if name == "megatron":
        return rs.Megatron(model, device, mixed_dtype_groups=a.get("megatron_mixed_groups", False))
    raise ValueError(f"unknown system {name!r}")


def rank_main(rank: int, world: int, a: dict[str, Any]) -> None:
    """One rank of one run; writes ``rank{r}.json`` into ``a['result_dir']``."""
    if a["device"] == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        backend = "gloo"
    store = dist.FileStore(a["store"], world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            device_id=device if device.type == "cuda" else None)
    try:
        record = _run(rank, world, a, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _common.write_json(Path(a["result_dir"]) / f"rank{rank}.json", record)


def _run(rank: int, world: int, a: dict[str, Any], device: torch.device) -> dict[str, Any]:
    system_name, mode = a["system"], a["mode"]
    torch.manual_seed(1234 + rank)
    tl = _common.MemoryTimeline(device)
    model = build_model(a, device)
    system = make_system(system_name, mode, model, device, a)
    tl.mark("build")
    record: dict[str, Any] = {"rank": rank, "world": world, "system": system_name, "mode": mode,
                              "num_params": sum(p.numel() for p in model.parameters())}
    ckpt = Path(a["ckpt"])
    first = 1
    if mode != "fresh":
        gc.collect()
        t0 = time.perf_counter()
        with _common.HostRssSampler() as rss:
            system.load(ckpt, tl)
        record["load_s"] = time.perf_counter() - t0
        record["load_rss"] = rss.as_dict()
        first = a["iters"] + 1
    losses = []
    for k in range(1, a["iters"] + 1):
        x, y = batch(model, a, rank, first + k - 1, device)
        losses.append(system.train_step(x, y, tl, f"iter{k}"))
    record["losses"] = losses
    if mode == "fresh":
        gc.collect()
        t0 = time.perf_counter()
        with _common.HostRssSampler() as rss:
            system.save(ckpt, a["iters"])
        _common.cuda_sync(device)
        tl.mark("save")
        dist.barrier()
        record["save_s"] = time.perf_counter() - t0
        record["save_rss"] = rss.as_dict()
    record["describe"] = system.describe()
    record["timeline"] = tl.as_list()
    record["phases"] = tl.phase_peaks()
    return record


def worker_main(a: dict[str, Any]) -> int:
    world = a["nproc"]
    if world == 1:
        rank_main(0, 1, a)
    else:
        import torch.multiprocessing as mp

        mp.start_processes(rank_main, args=(world, a), nprocs=world, join=True,
                           start_method="spawn")
    return 0


# ============================================================================= orchestration
def run_one(system: str, mode: str, args, ckpt: Path, scratch: Path, deadline: float
            ) -> dict[str, Any]:
    """Start one run as a fresh process; return its per-rank records or its error."""
    run_dir = scratch / f"{system}-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    a = {"system": system, "mode": mode, "nproc": args.nproc, "device": args.device,
         "model": args.model, "preset": args.preset, "seq_len": args.seq_len,
         "micro_batch": args.micro_batch,
         "iters": args.iters, "ckpt": str(ckpt), "result_dir": str(run_dir),
         "store": str(run_dir / "store"), "megatron_mixed_groups": args.megatron_mixed_groups}
    log = run_dir / "log.txt"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(a)]
    t0 = time.perf_counter()
    timeout = min(args.run_timeout, max(1.0, deadline - time.monotonic()))
    print(f"--- {system} {mode}: running (timeout {timeout:.0f} s) ...", flush=True)
    with open(log, "w") as f:
        # Its own process group, so a timeout kills the spawned ranks too (they hold GPUs).
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = f"timeout after {timeout:.0f} s"
    wall = time.perf_counter() - t0
    ranks = []
    for r in range(args.nproc):
        p = run_dir / f"rank{r}.json"
        if p.exists():
            ranks.append(json.loads(p.read_text()))
    if rc != 0 or len(ranks) != args.nproc:
        tail = log.read_text(errors="replace").strip().splitlines()[-25:]
        print(f"!!! {system} {mode} FAILED (exit {rc}) after {wall:.0f} s; last lines:", flush=True)
        print("\n".join("    " + line for line in tail), flush=True)
        return {"system": system, "mode": mode, "ok": False, "exit": rc, "wall_s": wall,
                "error": "\n".join(tail[-8:])}
    r0 = ranks[0]
    ph = r0["phases"]
    iters = [ph[f"iter{k}"]["peak_reserved"] / GIB for k in range(1, args.iters + 1)]
    print(f"    ok in {wall:.0f} s; rank 0 loss {r0['losses'][0]:.3f}; iteration peaks reserved "
          + ", ".join(f"{v:.2f}" for v in iters) + " GiB", flush=True)
    return {"system": system, "mode": mode, "ok": True, "wall_s": wall, "ranks": ranks}


def _peak(rec: dict, phases: list[str], key: str) -> int:
    return max(rec["phases"][p][key] for p in phases if p in rec["phases"])


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None  # None: no GPU figures (CPU smoke run)


def evaluate(runs: dict[str, dict], iters: int, gpu: bool) -> tuple[dict[str, Any], list[str]]:
    """Targets for shardopt and resumed/fresh ratios for everyone; returns (figures, verdict lines).

    Without a GPU there are no GPU figures: GPU targets are reported as not evaluated."""
    it = [f"iter{k}" for k in range(1, iters + 1)]
    out: dict[str, Any] = {"targets": {}, "ratios": {}}
    lines: list[str] = []

    def verdict(name: str, ok: bool, detail: str) -> None:
        if not gpu and "RSS" not in name:
            out["targets"][name] = {"pass": None, "detail": "not evaluated: no GPU figures on CPU"}
            lines.append(f"n/a   {name}: not evaluated on CPU")
            return
        out["targets"][name] = {"pass": ok, "detail": detail}
        lines.append(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")

    for system in SYSTEMS:
        fresh = runs.get(f"{system}/fresh")
        if not fresh or not fresh["ok"]:
            continue
        for mode in MODES[system][1:]:
            res = runs.get(f"{system}/{mode}")
            if not res or not res["ok"]:
                continue
            ratios = []
            for fr, rr in zip(fresh["ranks"], res["ranks"]):
                r = {}
                for key in ("peak_allocated", "peak_reserved"):
                    f_all = _peak(fr, it, key)
                    r[f"{key}_overall"] = _ratio(_peak(rr, ["load", *it], key), f_all)
                    r[f"{key}_iter1"] = _ratio(_peak(rr, ["iter1"], key), _peak(fr, ["iter1"], key))
                    r[f"{key}_load_vs_fresh_iters"] = _ratio(_peak(rr, ["load"], key), f_all)
                ratios.append(r)
            out["ratios"][f"{system}/{mode}"] = ratios

    fresh, low, default = (runs.get(f"shardopt/{m}") for m in ("fresh", "low_memory", "default"))
    if fresh and fresh["ok"] and low and low["ok"]:
        for key in ("peak_allocated", "peak_reserved"):
            bad = []
            for rank, (fr, lr) in enumerate(zip(fresh["ranks"], low["ranks"])):
                for k in it:
                    f, r = _peak(fr, [k], key), _peak(lr, [k], key)
                    if not _common.within(r, f, NOISE):
                        bad.append(f"rank {rank} {k}: {r / GIB:.3f} > {f / GIB:.3f} GiB")
                f_min = min(_peak(fr, [k], key) for k in it)
                ld = _peak(lr, ["load"], key)
                if not _common.within(ld, f_min, NOISE):
                    bad.append(f"rank {rank} load: {ld / GIB:.3f} > {f_min / GIB:.3f} GiB")
            verdict(f"low_memory_resume {key.split('_')[1]}: resumed iteration k <= fresh iteration k,"
                    " load <= fresh iterations", not bad, "; ".join(bad) or "all ranks, all iterations")
    if fresh and fresh["ok"] and default and default["ok"]:
        for key in ("peak_allocated", "peak_reserved"):
            bad = []
            for rank, (fr, dr) in enumerate(zip(fresh["ranks"], default["ranks"])):
                f, r = _peak(fr, it, key), _peak(dr, ["load", *it], key)
                if not _common.within(r, f, NOISE):
                    bad.append(f"rank {rank}: {r / GIB:.3f} > {f / GIB:.3f} GiB")
            verdict(f"default load {key.split('_')[1]}: peak over load + iterations <= fresh peak",
                    not bad, "; ".join(bad) or "all ranks")
        growth = [dr["load_rss"]["growth_bytes"] for dr in default["ranks"]]
        verdict("default load host RSS growth <= 512 MiB", max(growth) <= RSS_LIMIT,
                ", ".join(f"rank {r}: {g / MIB:.0f} MiB" for r, g in enumerate(growth)))
    return out, lines


def summary_rows(runs: dict[str, dict], iters: int) -> list[list[Any]]:
    rows = []
    for key, run in runs.items():
        if not run["ok"]:
            rows.append([run["system"], run["mode"], "FAILED"] + ["-"] * (5 + iters))
            continue
        r0 = run["ranks"][0]
        ph = r0["phases"]
        load = ph.get("load")
        it_alloc = [ph[f"iter{k}"]["peak_allocated"] / GIB for k in range(1, iters + 1)]
        it_res = max(ph[f"iter{k}"]["peak_reserved"] for k in range(1, iters + 1)) / GIB
        rss = r0.get("load_rss", {}).get("growth_bytes")
        secs = r0.get("load_s", r0.get("save_s"))
        rows.append([run["system"], run["mode"],
                     f"{load['peak_allocated'] / GIB:.2f}" if load else "-",
                     f"{load['peak_reserved'] / GIB:.2f}" if load else "-",
                     *[f"{v:.2f}" for v in it_alloc], f"{it_res:.2f}",
                     f"{rss / MIB:.0f}" if rss is not None else "-",
                     f"{secs:.1f}" if secs is not None else "-"])
    return rows


def plot(runs: dict[str, dict], iters: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    load_slots = max([sum(1 for e in r["ranks"][0]["timeline"] if e["phase"] == "load")
                      for r in runs.values() if r["ok"]] + [1])
    slots = ["build"] + [f"load.{i}" for i in range(load_slots)]
    for k in range(1, iters + 1):
        slots += [f"iter{k}.forward", f"iter{k}.backward", f"iter{k}.step"]
    slots.append("save")
    colors = {"shardopt": "tab:blue", "fsdp2": "tab:orange", "megatron": "tab:green"}
    styles = {"fresh": ("--", "o"), "default": ("-", "s"), "low_memory": (":", "^")}
    fig, axes = plt.subplots(2, 1, figsize=(12, 8), sharex=True)
    for run in runs.values():
        if not run["ok"]:
            continue
        xs, ya, yr = [], [], []
        n_load = 0
        for e in run["ranks"][0]["timeline"]:
            if e["phase"] == "load":
                slot, n_load = f"load.{n_load}", n_load + 1
            elif e["phase"] in ("build", "save"):
                slot = e["phase"]
            else:
                slot = f"{e['phase']}.{e['event']}"
            if slot in slots:
                xs.append(slots.index(slot))
                ya.append(e["peak_allocated"] / GIB)
                yr.append(e["peak_reserved"] / GIB)
        ls, marker = styles[run["mode"]]
        label = f"{run['system']} {run['mode'].replace('_', ' ')}"
        for ax, ys in zip(axes, (ya, yr)):
            ax.plot(xs, ys, ls, marker=marker, color=colors[run["system"]], label=label, alpha=0.85)
    axes[0].set_ylabel("peak allocated (GiB)")
    axes[1].set_ylabel("peak reserved (GiB)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, ncol=2)
    axes[1].set_xticks(range(len(slots)))
    axes[1].set_xticklabels(slots, rotation=60, ha="right", fontsize=8)
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def default_scratch() -> str | None:
    """/dev/shm when it has room for a 1B-model checkpoint (fast, and no disk noise), else $TMPDIR."""
    try:
        if shutil.disk_usage("/dev/shm").free > 48 * GIB:
            return "/dev/shm"
    except OSError:
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=("cuda", "cpu"))
    ap.add_argument("--nproc", type=int, default=1, help="DP ranks, one GPU each")
    ap.add_argument("--model", choices=_common.MODELS, default="gpt",
                    help="the reference GPT, or Hugging Face's LlamaForCausalLM from a config "
                         "(megatron is skipped: it runs only the GPT)")
    ap.add_argument("--preset", default="1b", help="the model's preset (1b, tiny for smoke runs)")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the preset's (1024 for 1b)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--ckpt-dir", default=None,
                    help="scratch for checkpoints (default: /dev/shm if it has 48 GiB free, else "
                         "the temp dir)")
    ap.add_argument("--run-timeout", type=float, default=180.0, help="seconds per run")
    ap.add_argument("--deadline", type=float, default=450.0,
                    help="seconds for all runs; runs that would start later are skipped, so the "
                         "results of the others are still written")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--force-megatron", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--megatron-mixed-groups", action="store_true",
                    help="let megatron's fp32 router weights share the bf16 matrices' param group "
                         "(reproduces megatron-core's mixed-dtype checkpoint bug)")
    args = ap.parse_args(argv)
    if args.worker is not None:
        return worker_main(json.loads(args.worker))

    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        ap.error(f"--nproc {args.nproc} needs {args.nproc} GPUs, found {torch.cuda.device_count()}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.deadline
    scratch = Path(tempfile.mkdtemp(prefix="resume_memory-", dir=args.ckpt_dir or default_scratch()))
    free_gib = shutil.disk_usage(scratch).free / GIB
    print(f"resume_memory: {args.model} {args.preset}, micro-batch {args.micro_batch}, "
          f"{args.nproc} rank(s) "
          f"on {args.device}; checkpoints under {scratch} ({free_gib:.0f} GiB free)", flush=True)

    runs: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    try:
        for system in systems:
            if system == "megatron":
                import _resume_systems

                why = (_resume_systems.megatron_available() if args.model == "gpt" else
                       f"megatron-core runs only the reference GPT here, not --model {args.model}")
                if why is None and args.device != "cuda" and not args.force_megatron:
                    why = "megatron-core's DDP and DistributedOptimizer allocate on CUDA only"
                if why is not None:
                    skipped[system] = why
                    print(f"!!! megatron: not run: {why}", flush=True)
                    continue
            ckpt = scratch / f"ckpt-{system}"
            for mode in MODES[system]:
                if time.monotonic() > deadline - 20:
                    skipped[f"{system}/{mode}"] = f"--deadline {args.deadline:.0f} s reached"
                    print(f"!!! {system} {mode}: not run, --deadline reached", flush=True)
                    continue
                run = run_one(system, mode, args, ckpt, scratch, deadline)
                runs[f"{system}/{mode}"] = run
                if mode == "fresh" and not run["ok"]:
                    break
            shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    figures, verdicts = evaluate(runs, args.iters, gpu=args.device == "cuda")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    config = {"model": args.model, "preset": args.preset, "seq_len": args.seq_len,
              "micro_batch": args.micro_batch,
              "iters": args.iters, "nproc": args.nproc, "systems": systems,
              "hyperparameters": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                  "max_grad_norm": 1.0},
              "noise_tolerance": NOISE, "rss_limit_bytes": RSS_LIMIT}
    name = "resume_memory" if args.nproc == 1 else f"resume_memory_dp{args.nproc}"
    name += "" if args.model == "gpt" else "_hf"
    doc = {**_common.run_header(device, config), "benchmark": "resume_memory",
           "runs": runs, "skipped": skipped, **figures}
    _common.write_json(out / f"{name}.json", doc)
    try:
        plot(runs, args.iters, out / f"{name}.png",
             f"GPU memory per event, rank 0 of {args.nproc}: {args.preset} {args.model}, "
             f"micro-batch {args.micro_batch} ({doc['device']['name']})")
    except Exception:  # noqa: BLE001 - the JSON is the result; a plot failure must still show
        traceback.print_exc()
        print("!!! plot failed (see above)", flush=True)

    heads = ["system", "mode", "load alloc", "load resv",
             *[f"it{k} alloc" for k in range(1, args.iters + 1)], "it max resv", "load RSS MiB",
             "load/save s"]
    print()
    print("GiB, rank 0 (peaks per phase):")
    print(_common.format_table(summary_rows(runs, args.iters), heads))
    print()
    for key, ratios in figures["ratios"].items():
        r = {k: ("n/a" if v is None else f"{v:.3f}") for k, v in ratios[0].items()}
        print(f"{key:22s} resumed/fresh (rank 0): reserved overall {r['peak_reserved_overall']}, "
              f"allocated overall {r['peak_allocated_overall']}, "
              f"iteration 1 allocated {r['peak_allocated_iter1']}, "
              f"iteration 1 reserved {r['peak_reserved_iter1']}")
    print()
    for line in verdicts:
        print(line)
    failed = [k for k, r in runs.items() if not r["ok"]]
    for k in failed:
        print(f"ERROR: run {k} failed: {runs[k]['error'].splitlines()[-1] if runs[k]['error'] else ''}")
    for k, why in skipped.items():
        print(f"NOTE: {k} not run: {why}")
    print(f"wrote {out / (name + '.json')} and {out / (name + '.png')}")
    return 1 if failed or any("deadline" in why for why in skipped.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
