"""Checkpoint save/load throughput: shardopt against the checkpoint paths users pick.

Checkpoint systems (each saves the full training state of the ``1b`` preset after one step;
classes in ``_ckpt_systems.py``):

* ``shardopt``: ``shardopt.checkpoint.save`` / ``load`` (bf16 weights + fp32 main/exp_avg/exp_avg_sq,
  each rank its own chunks; load verifies block hashes and all-gathers the params).
* ``torch_save``: the same tensors, one ``torch.save`` file per rank (+ ``fsync``),
  ``torch.load(map_location=<gpu>)`` + ``copy_`` back.
* ``dcp_plain``: the same tensors as a plain state dict (rank-unique keys) through
  ``torch.distributed.checkpoint``'s ``FileSystemWriter`` / ``FileSystemReader``.
* ``dcp_async``: the same through ``dcp.async_save``: ``save_return_s`` is the time until it
  returned, ``save_s`` until the checkpoint was complete.
* ``dcp_fsdp2``: an FSDP2 model (fp32 sharded params) + AdamW, its ``get_state_dict`` state through
  DCP; load with ``dcp.load`` + ``set_state_dict`` (torchtitan's recipe).
* ``megatron``: megatron-core's DDP + distributed optimizer, ``dist_checkpointing`` (needs
  megatron-core; ``--no-megatron`` leaves it out).

Fairness: every writer runs ``--io-threads`` threads per rank (default: shardopt's
``io_threads()`` in that rank): shardopt's ``io_threads`` and DCP's ``FileSystemWriter(thread_count=
...)``. Every system runs ``--repeats`` save + load rounds in the same run, interleaved by
repeat. Each round is a save, an in-place ``load`` (into the optimizer that saved, compared
with the other systems' in-place loads) and, for every system but megatron-core, a
``load_resume``: a new optimizer is built and loaded into, as after a process restart, with
the construction inside the timed region for every system (shardopt and the generic writers
on shardopt's state: a new ``DistributedOptimizer``, for the latter with its moments allocated
as a first step would; FSDP2: a new AdamW, whose state ``get_state_dict`` initialises). The old
moments are freed before, outside the timed region, so the device never holds two copies.

Targets: ``shm`` (/dev/shm) and ``disk`` (a directory on local disk). Before any checkpoint, the raw
bandwidth of each target is measured by every rank at once with the bytes a save writes per
rank (``--raw-mib`` overrides), ``--raw-repeats`` times (default 3) for each thread count of
``--raw-threads`` and write size of ``--raw-piece-mib``, each repeat into new files; the best is
the bar (``_io_probes.raw_bandwidth``). "vs raw" is against the best raw test, per operation
(write for a save, read for a load), and ``raw_basis`` says which. Before every read on ``disk``
(raw or checkpoint) the pages are evicted from the page cache (``posix_fadvise``, and
``drop_caches`` where writable) and the cached fraction is recorded. Every load is checked: the
state is zeroed before the load and must come back bit for bit (``restored``;
``load_resume_restored``).

shardopt's save and loads are split into phases by timing wrappers around its internals
(``_io_probes.hook_shardopt``): the calling thread's phases, which add up to the operation's time,
and the busy time of the worker threads that overlap them (hashing during a save, reads during a
load), which does not add to it. Rounds are skipped, and said so, when the ``--budget`` would
be exceeded.

GPU::

    PYTHONPATH=src python3 benchmarks/checkpoint_io.py --nproc 1 --no-megatron --out $OUT

CPU smoke::

    PYTHONPATH=src python benchmarks/checkpoint_io.py --device cpu --preset tiny --no-megatron
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import _io_probes  # noqa: E402
import _peers  # noqa: E402
from _ckpt_systems import CKPT  # noqa: E402

CKPT_SYSTEMS = tuple(CKPT)
OPS = ("save", "load", "load_resume")  # load_resume: systems with a resume()
# training stack -> checkpoint systems that use it (one process group each, in this order)
GROUPS = {"shardopt": ("shardopt", "torch_save", "dcp_plain", "dcp_async"),
          "fsdp2": ("dcp_fsdp2",), "megatron": ("megatron",)}
GROUP_WEIGHT = {"shardopt": 0.6, "fsdp2": 0.2, "megatron": 0.2}


# ----------------------------------------------------------------------------- worker
def _checksum(tensors: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return float(sum(t.double().sum() for t in tensors if t.numel()))


def _scramble(tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for t in tensors:
            t.zero_()


def _bcast(obj: Any) -> Any:
    box = [obj]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _max_over_ranks(x: float) -> float:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, x)
    return max(values)


def _all_true(flag: bool) -> bool:
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return all(flags)


def _one(name: str, ck: Any, target: dict, rep: int, rank: int, device: torch.device,
         probe: _io_probes.Probe | None) -> dict[str, Any]:
    """One save and its loads (``load``; shardopt also ``load_resume``), each load from a
    scrambled state, checked for the saved bits, after evicting the files on ``disk``."""
    root = Path(target["dir"]) / f"{name}-{rep}"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    _peers.barrier()
    ref = _checksum(ck.tensors())
    hooks = _io_probes.hook_shardopt(probe) if probe else None
    out: dict[str, Any] = {"system": name, "target": target["name"], "rep": rep}
    try:
        if hooks:
            out["hooks"] = hooks.__enter__()
        _measure(out, "save", lambda: ck.save(root), device, probe)
        if rank == 0:
            out["bytes"] = _io_probes.dir_bytes(root)
            out["files"] = len(_io_probes.files_under(root))
        if getattr(ck, "returned_s", None) is not None:
            out["save_return_s"] = _max_over_ranks(ck.returned_s)
        for op in ("load", "load_resume") if hasattr(ck, "resume") else ("load",):
            if op == "load_resume":
                ck.prepare_resume()
            if rank == 0:
                if target["evict"]:
                    _io_probes.evict(root)
                out[f"cached_fraction_before_{op}"] = _io_probes.cached_fraction(root)
            _scramble(ck.tensors())
            _peers.sync(device)
            with _common.HostRssSampler(interval_s=0.005) as rss:
                _measure(out, op, lambda: (ck.resume if op == "load_resume" else ck.load)(root),
                         device, probe)
            out[f"{op}_rss_growth_bytes"] = rss.growth_bytes
            out[_restored_key(op)] = _all_true(_checksum(ck.tensors()) == ref)
    finally:
        if hooks:
            hooks.__exit__(None, None, None)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    _peers.barrier()
    return out


def _restored_key(op: str) -> str:
    return "restored" if op == "load" else f"{op}_restored"


def _measure(out: dict[str, Any], op: str, fn, device: torch.device,
             probe: _io_probes.Probe | None) -> None:
    """Time ``fn`` into ``out[f"{op}_s"]``; with a probe, also its phases (rank 0's)."""
    if probe:
        probe.reset()
    out[f"{op}_s"] = _peers.timed(fn, device)
    if probe:
        snapshot = probe.snapshot()
        split = _io_probes.save_phases if op == "save" else _io_probes.load_phases
        out[f"{op}_phases"], out[f"{op}_overlapped"] = split(snapshot, out[f"{op}_s"])
        out[f"{op}_probe"] = snapshot


def _group_worker(rank: int, world: int, group: str, a: dict) -> dict:
    from shardopt.checkpoint.transfer import io_threads

    device = _peers.rank_device(rank, a["device"])
    if device.type == "cpu":
        torch.set_num_threads(max(1, a["cpu_threads"]))
    model = _peers.build_gpt(a["preset"], device, seed=0, **a["overrides"])
    s = _peers.SETUP[group](model, _peers.Hyper(), device)
    (x, y), = _peers.make_batches(a["preset"], rank, world, 1, 1, device)
    loss = float(s.step(x, y))
    _peers.sync(device)
    names = [n for n in GROUPS[group] if n in a["systems"]]
    threads = io_threads(a["io_threads"])  # in the rank: it sees LOCAL_WORLD_SIZE
    ckpts = {n: CKPT[n](s, rank, device, threads) for n in names}
    state_bytes = sum(t.numel() * t.element_size() for t in ckpts[names[0]].tensors())
    probe = _io_probes.Probe(device)
    last: dict[str, float] = {}
    results = []
    plan = _plan(names, a)
    skip, current = None, None
    for target, name, rep in plan:
        # A round is run whole or skipped whole, so every system keeps the same number of
        # rounds; a system not measured yet is estimated at --first-gbps.
        if (target["name"], rep) != current:
            def estimate(n: str) -> float:
                num_ops = 3 if hasattr(ckpts[n], "resume") else 2
                return 1.3 * last.get(n, num_ops * state_bytes * world / (a["first_gbps"] * 1e9))
            need = sum(estimate(n) for t, n, r in plan if (t["name"], r) == (target["name"], rep))
            skip = None
            if rank == 0 and time.time() + need > a["deadline"]:
                skip = f"time budget: ~{need:.0f} s needed for the round, " \
                       f"{max(0.0, a['deadline'] - time.time()):.0f} s left"
            skip, current = _bcast(skip), (target["name"], rep)
        if skip:
            results.append({"system": name, "target": target["name"], "rep": rep, "skipped": skip})
            continue
        t0 = time.time()
        results.append(_one(name, ckpts[name], target, rep, rank, device,
                            probe if name == "shardopt" else None))
        last[name] = time.time() - t0
        r = results[-1]
        if rank == 0:
            loads = "".join(f" {op} {r[op + '_s']:.2f} s restored={r[_restored_key(op)]}"
                            for op in OPS[1:] if op + "_s" in r)
            print(f"  [{name} {target['name']} rep {rep}] {r.get('bytes', 0) / 1e9:.2f} GB "
                  f"save {r['save_s']:.2f} s{loads}", flush=True)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"results": results, "loss": loss, "notes": s.notes, "peak_allocated": peak,
            "io_threads": threads, "cpus_allowed": _io_probes.cpus_allowed(),
            "host_cpus": os.cpu_count(),
            "copy": _io_probes.copy_bandwidth(device) if rank == 0 else {}}


def _plan(names: list[str], a: dict) -> list[tuple[dict, str, int]]:
    """(target, system, rep): per target (shm first), every system once per repeat, the
    systems interleaved so that each sees the machine in the same states; on disk only
    ``disk_systems``."""
    plan: list[tuple[dict, str, int]] = []
    for target in sorted(a["targets"], key=lambda t: t["name"] != "shm"):
        members = [n for n in names if target["name"] != "disk" or n in a["disk_systems"]]
        plan += [(target, n, r) for r in range(a["repeats"]) for n in members]
    return plan


def _raw_worker(rank: int, world: int, a: dict) -> dict:
    from shardopt.checkpoint.transfer import io_threads

    io = io_threads(a["io_threads"])  # "io" / "2io": multiples of what the save runs on
    threads = sorted({int(t[:-2] or 1) * io if t.endswith("io") else int(t)
                      for t in a["raw_threads"]})
    return {target["name"]: _io_probes.raw_bandwidth(
        Path(target["dir"]), rank, a["raw_bytes"], a["device"] == "cuda", target["evict"],
        threads, a["raw_piece_bytes"], a["raw_repeats"]) for target in a["targets"]}


def raw_summary(per_rank: list[list[dict]]) -> dict[str, Any]:
    """The raw tests of one target, every rank's at once: a test takes as long as its slowest
    rank and moves every rank's bytes; ``best`` per kind is the fastest test of all."""
    tests = []
    for same in zip(*per_rank):
        t = {k: same[0][k] for k in ("rep", "threads", "piece_bytes")}
        t["bytes_total"] = sum(r["bytes"] for r in same)
        for kind in ("write", "read"):
            t[f"{kind}_s"] = max(r[f"{kind}_s"] for r in same)
            t[f"{kind}_GBps"] = t["bytes_total"] / t[f"{kind}_s"] / 1e9
        t["cached_fraction_before_read"] = max(
            (r["cached_fraction_before_read"] or 0.0) for r in same)
        t["drop_caches"] = all(r["drop_caches"] for r in same)
        t["cpus_allowed"] = [r.get("cpus_allowed") for r in same]
        t["per_rank"] = list(same)
        tests.append(t)
    best = {}
    for kind in ("write", "read"):
        top = max(tests, key=lambda t: t[f"{kind}_GBps"])
        best[kind] = {"GBps": top[f"{kind}_GBps"], "s": top[f"{kind}_s"],
                      "bytes_total": top["bytes_total"], "basis": _raw_basis(top)}
    return {"tests": tests, "best": best, "nproc": len(per_rank)}


def _raw_basis(test: dict) -> str:
    return f"{test['threads']} thread(s), {test['piece_bytes'] >> 20} MiB writes"


# ----------------------------------------------------------------------------- parent
def _checkpoint_bytes(args: argparse.Namespace) -> int:
    """About what shardopt writes: model-dtype weights + 3 fp32 states per param."""
    from shardopt.recipes.model import GPT, model_config

    overrides = {"num_layers": args.num_layers} if args.num_layers else {}
    with torch.device("meta"):
        model = GPT(model_config(args.preset, **overrides))
    return sum(p.numel() * (p.element_size() + 12) for p in model.parameters())


def _targets(args: argparse.Namespace) -> list[dict]:
    out = []
    need = max(_checkpoint_bytes(args) * 1.1, (args.raw_mib << 20) * args.nproc) + (1 << 30)
    for name in args.targets.split(","):
        base = {"shm": args.shm_dir, "disk": args.disk_dir}[name]
        free = shutil.disk_usage(base).free
        if free < need:
            print(f"target {name} SKIPPED: {base} has {free / 1e9:.1f} GB free, "
                  f"{need / 1e9:.1f} GB needed", flush=True)
            continue
        d = Path(base) / f"shardopt-ckpt-bench-{os.getpid()}"
        d.mkdir(parents=True, exist_ok=True)
        out.append({"name": name, "dir": str(d), "evict": name != "shm",
                    "free_bytes": shutil.disk_usage(d).free, **_io_probes.mount_of(d.resolve())})
    return out


def _gbps(nbytes: int | None, s: float | None) -> float | None:
    return nbytes / s / 1e9 if nbytes and s else None


def summarize(raw: dict, ops: list[dict], nproc: int) -> tuple[list[dict], str]:
    """One row per (system, target, op): median time, GB/s, the ratio to the raw bandwidth
    (write for a save, read for a load: the faster of the one-thread and threaded raw tests,
    named by ``raw_basis``) and, for a peer, shardopt's speedup at the same op."""
    rows, table = [], []
    keyed: dict[tuple[str, str, str], list[dict]] = {}
    for r in ops:
        for op in OPS:
            if f"{op}_s" in r:
                keyed.setdefault((r["system"], r["target"], op), []).append(r)
    for (system, target, op), rs in keyed.items():
        secs = _common.stats([r[f"{op}_s"] for r in rs])
        nbytes = rs[0].get("bytes")
        row = {"system": system, "op": op, "target": target, "bytes": nbytes, "s": secs,
               "GBps": _gbps(nbytes, secs["median"])}
        if op != "save":
            row["restored"] = all(r[_restored_key(op)] for r in rs)
            row["cached_fraction_before"] = [r.get(f"cached_fraction_before_{op}") for r in rs]
            row["rss_growth_bytes"] = [r.get(f"{op}_rss_growth_bytes") for r in rs]
        if op == "save" and "save_return_s" in rs[0]:
            row["return_s"] = _common.stats([r["save_return_s"] for r in rs])
        rw = raw.get(target)
        if rw and row["GBps"]:
            best = rw["best"]["write" if op == "save" else "read"]
            row["raw_basis"], row["vs_raw"] = best["basis"], row["GBps"] / best["GBps"]
        rows.append(row)
    ours = {(r["target"], r["op"]): r for r in rows if r["system"] == "shardopt"}
    for row in rows:
        o = ours.get((row["target"], row["op"]))
        if o and row["system"] != "shardopt" and o["GBps"] and row["GBps"]:
            row["ours_speedup"] = o["GBps"] / row["GBps"]
    for target, rw in raw.items():
        for setting in dict.fromkeys((t["threads"], t["piece_bytes"]) for t in rw["tests"]):
            same = [t for t in rw["tests"] if (t["threads"], t["piece_bytes"]) == setting]
            for op in ("write", "read"):
                top = min(same, key=lambda t: t[f"{op}_s"])
                table.append([f"raw ({nproc} proc, {_raw_basis(top)}, best of {len(same)})",
                              op, target, top["bytes_total"] / 1e9, top[f"{op}_s"],
                              top[f"{op}_GBps"], None, None])
    for row in rows:
        table.append([row["system"], row["op"], row["target"], (row["bytes"] or 0) / 1e9,
                      row["s"]["median"], row["GBps"], _pct(row.get("vs_raw")),
                      None if "restored" not in row else "yes" if row["restored"] else "NO"])
    text = _common.format_table(table, ["system", "op", "target", "GB", "s", "GB/s", "vs raw",
                                        "restored"])
    lines = [text, ""]
    peers = {(r["system"], r["target"]): {} for r in rows if "ours_speedup" in r}
    for row in rows:
        if "ours_speedup" in row:
            peers[row["system"], row["target"]][row["op"]] = row["ours_speedup"]
    for (system, target), speedup in peers.items():
        lines.append(f"shardopt vs {system} ({target}): " + ", ".join(
            f"{op} {x:.2f}x" for op, x in speedup.items()) + " throughput (target >= 3x)")
    for target in dict.fromkeys(r["target"] for r in rows):
        mine = [r for r in rows if r["system"] == "shardopt" and r["target"] == target
                and "vs_raw" in r]
        if mine:
            lines.append(f"shardopt {target}: " + " / ".join(
                f"{r['op']} {r['vs_raw']:.0%} ({r['raw_basis']})" for r in mine)
                + " of raw bandwidth, the best raw test (target >= 90%)")
    for row in rows:
        if "return_s" in row:
            lines.append(f"{row['system']} ({row['target']}): save returned after "
                         f"{row['return_s']['median']:.3f} s, complete after "
                         f"{row['s']['median']:.3f} s (medians)")
    return rows, "\n".join(lines)


def _pct(v: float | None) -> str | None:
    return None if v is None else f"{v:.0%}"


def phase_table(ops: list[dict]) -> str:
    """shardopt's phases per operation (rank 0): what adds up to the time, then what overlaps."""
    lines = []
    for r in ops:
        if r.get("system") != "shardopt":
            continue
        for op in OPS:
            if f"{op}_phases" not in r:
                continue
            cells = "  ".join(f"{k}={v:.3f}" for k, v in r[f"{op}_phases"].items()
                              if abs(v) >= 0.0005)
            bg = "  ".join(f"{k}={v:.3f}" for k, v in r[f"{op}_overlapped"].items()
                           if abs(v) >= 0.0005)
            lines.append(f"shardopt {op} {r['target']} rep {r['rep']} "
                         f"({r[op + '_s']:.3f} s, rank 0): {cells}"
                         + (f"  | overlapped, not in the total: {bg}" if bg else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--preset", default="1b")
    p.add_argument("--num-layers", type=int, default=None,
                   help="override the preset's depth (quick checks at a smaller size)")
    p.add_argument("--systems", default=",".join(CKPT_SYSTEMS))
    p.add_argument("--targets", default="shm,disk", help="comma-separated: shm, disk")
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--disk-dir", default="/tmp", help="a directory on local disk")
    p.add_argument("--repeats", type=int, default=3,
                   help="save + load rounds of every system (interleaved by round)")
    p.add_argument("--io-threads", type=int, default=None,
                   help="writer threads per rank of every system (default: shardopt's "
                   "io_threads() in the rank)")
    p.add_argument("--no-megatron", action="store_true",
                   help="leave megatron-core out (where it is not installed)")
    p.add_argument("--raw-mib", type=int, default=None,
                   help="raw test size per rank (default: what a save writes per rank)")
    p.add_argument("--raw-repeats", type=int, default=3, help="repeats of each raw test")
    p.add_argument("--raw-threads", default="1,io,2io",
                   help="thread counts of the raw tests; 'io' is the writers' thread count "
                   "(--io-threads), '2io' twice that")
    p.add_argument("--raw-piece-mib", default="32,256",
                   help="write sizes of the raw tests (MiB per pwrite)")
    p.add_argument("--budget", type=float, default=270.0,
                   help="seconds for all checkpoint groups; peers beyond it are skipped")
    p.add_argument("--disk-systems", default=",".join(CKPT_SYSTEMS),
                   help="systems also measured on disk (after every system on shm)")
    p.add_argument("--first-gbps", type=float, default=0.8,
                   help="assumed GB/s of a system's first save and load, for the budget")
    p.add_argument("--timeout", type=float, default=150.0,
                   help="seconds a process group may run past its share of the budget")
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s and not (
        args.no_megatron and s == "megatron")]
    if set(systems) - set(CKPT_SYSTEMS):
        p.error(f"unknown systems {sorted(set(systems) - set(CKPT_SYSTEMS))}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; use --device cpu for a smoke run")
    if args.raw_mib is None:
        args.raw_mib = max(1, _checkpoint_bytes(args) // args.nproc >> 20)
    targets = _targets(args)
    for t in targets:
        print(f"target {t['name']}: {t['dir']} ({t['fstype']} on {t['source']}, "
              f"{t['free_bytes'] / 1e9:.0f} GB free)", flush=True)
    start = time.time()
    a = {"device": args.device, "preset": args.preset, "systems": systems, "targets": targets,
         "repeats": args.repeats, "io_threads": args.io_threads,
         "raw_bytes": args.raw_mib << 20, "raw_repeats": args.raw_repeats,
         "raw_threads": [t for t in args.raw_threads.split(",") if t],
         "raw_piece_bytes": [int(x) << 20 for x in args.raw_piece_mib.split(",") if x],
         "cpu_threads": args.cpu_threads,
         "first_gbps": args.first_gbps,
         "disk_systems": [x for x in args.disk_systems.split(",") if x],
         "overrides": {"num_layers": args.num_layers} if args.num_layers else {}}
    errors: dict[str, str] = {}
    raw: dict[str, dict] = {}
    try:
        print("raw storage bandwidth ...", flush=True)
        per_rank = _peers.spawn(_raw_worker, args.nproc, a, device=args.device,
                                timeout_s=args.timeout)
        for t in targets:
            raw[t["name"]] = raw_summary([r[t["name"]] for r in per_rank])
            allowed = raw[t["name"]]["tests"][0]["cpus_allowed"]
            print(f"raw {t['name']}: CPUs allowed per rank {allowed} of {os.cpu_count()}",
                  flush=True)
    except Exception as e:  # noqa: BLE001
        errors["raw"] = str(e) if isinstance(e, _peers.RankFailed) else traceback.format_exc()
        print(f"raw bandwidth FAILED:\n{errors['raw']}", flush=True)

    groups = [g for g, members in GROUPS.items() if set(members) & set(systems)]
    ops: list[dict] = []
    extras: dict[str, Any] = {}
    budget_end = time.time() + args.budget
    for i, g in enumerate(groups):
        left = max(0.0, budget_end - time.time())
        share = GROUP_WEIGHT[g] / sum(GROUP_WEIGHT[h] for h in groups[i:])
        a["deadline"] = time.time() + left * share
        print(f"{g}: {', '.join(n for n in GROUPS[g] if n in systems)} "
              f"({left * share:.0f} s budget) ...", flush=True)
        try:
            res = _peers.spawn(_group_worker, args.nproc, g, a, device=args.device,
                               timeout_s=left * share + args.timeout)
            ops.extend(res[0]["results"])
            extras[g] = {k: v for k, v in res[0].items() if k != "results"}
            phase_keys = ("target", "rep") + tuple(
                f"{op}_{kind}" for op in OPS for kind in ("phases", "overlapped"))
            extras[g]["per_rank_phases"] = [
                [{k: r[k] for k in phase_keys if k in r}
                 for r in rr["results"] if "save_phases" in r] for rr in res]
        except Exception as e:  # noqa: BLE001 - record and go on with the next system
            msg = str(e) if isinstance(e, _peers.RankFailed) else traceback.format_exc()
            errors[g] = msg[-6000:]
            print(f"[{g}] FAILED:\n{msg}", flush=True)
    for t in targets:
        shutil.rmtree(t["dir"], ignore_errors=True)

    rows, text = summarize(raw, ops, args.nproc)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    config = {k: v for k, v in vars(args).items() if k not in ("out", "tag")}
    doc = {**_common.run_header(device, config), "benchmark": "checkpoint_io",
           "targets": targets, "raw": raw, "summary": rows, "ops": ops, "groups": extras,
           "errors": errors, "wall_s": time.time() - start}
    name = f"checkpoint_io_{args.nproc}gpu{args.tag}.json" if args.device == "cuda" else \
        f"checkpoint_io_cpu_{args.nproc}rank{args.tag}.json"
    _common.write_json(Path(args.out) / name, doc)
    skipped = [f"{r['system']}/{r['target']}#{r['rep']}" for r in ops if "skipped" in r]
    print(f"\ncheckpoint_io: {args.nproc} rank(s), {args.preset}")
    print(phase_table(ops))
    if skipped:
        print(f"skipped for the time budget: {', '.join(skipped)}")
    print(text)
    bad = [f"{r['system']} {r['op']}/{r['target']}" for r in rows if r.get("restored") is False]
    if errors or bad:
        print(f"FAILED: {', '.join(list(errors) + [f'{b} not restored' for b in bad])} "
              f"(details in {name})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
