"""Checkpoint save/load throughput: shardopt against the checkpoint paths of the systems users pick.

Checkpoint systems (each saves the full training state of the ``1b`` preset after one step):

* ``shardopt``: ``shardopt.checkpoint.save`` / ``load`` (bf16 weights + fp32 main/exp_avg/exp_avg_sq,
  each rank its own chunks; load verifies block hashes and all-gathers the params). Two loads of
  each save: ``load`` back into the same optimizer (its moments are verified, then read in place)
  and ``load_resume`` into a new ``DistributedOptimizer`` over the same model, as after a process
  restart: it has no moments, so the load reads them into new tensors in one verifying pass. The
  old optimizer's moments are freed before the new one is built (never two copies at once); the
  new one replaces it for the rest of the run.
* ``torch_save``: the same tensors, one ``torch.save`` file per rank (+ ``fsync``, as every other
  writer here makes its files durable), ``torch.load(map_location=<gpu>)`` + ``copy_`` back.
* ``dcp_plain``: the same tensors as a plain state dict (rank-unique keys) through
  ``torch.distributed.checkpoint``'s default ``FileSystemWriter`` / ``FileSystemReader``.
* ``dcp_fsdp2``: an FSDP2 model (fp32 sharded params) + AdamW, its ``get_state_dict`` state through
  the same default DCP writer; load with ``dcp.load`` + ``set_state_dict`` (torchtitan's recipe).
* ``megatron``: megatron-core's DDP + distributed optimizer, ``dist_checkpointing.save/load`` of the
  model's sharded state dict + ``optimizer.sharded_state_dict`` (``dp_reshardable``, Megatron-LM's
  default, with its fully-parallel save wrapper).

Targets: ``shm`` (/dev/shm) and ``disk`` (a directory on local disk). Before any checkpoint, the raw
bandwidth of each target is measured with the same number of writer processes (one per rank), each
rank once with one thread (sequential writes) and once with ``--raw-threads`` threads (default:
shardopt's ``io_threads()`` in that rank, the files a save writes at once; each thread writes and
reads its own file): see
``_io_probes.raw_bandwidth``. "vs raw" is against the faster of the two, per operation (write for
a save, read for a load), and ``raw_basis`` says which. Before every load on ``disk`` the
checkpoint's pages are evicted from the page cache (``posix_fadvise``) and the cached fraction is
recorded. Every load is checked: the state is zeroed before the load and must come back bit for
bit (``restored``; ``load_resume_restored``).

shardopt's save and loads are split into phases by timing wrappers around its internals
(``_io_probes.hook_shardopt``): the calling thread's phases, which add up to the operation's time,
and the busy time of the worker threads that overlap them (hashing during a save, reads during a
load), which does not add to it. Peers are skipped, and said so, when the ``--budget`` would be
exceeded.

GPU::

    PYTHONPATH=src python3 benchmarks/checkpoint_io.py --nproc 1 --out $OUT

CPU smoke::

    PYTHONPATH=src python benchmarks/checkpoint_io.py --device cpu --preset tiny --raw-mib 64
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

CKPT_SYSTEMS = ("shardopt", "torch_save", "dcp_plain", "dcp_fsdp2", "megatron")
OPS = ("save", "load", "load_resume")  # load_resume: shardopt only
# training stack -> checkpoint systems that use it (one process group each, in this order)
GROUPS = {"shardopt": ("shardopt", "torch_save", "dcp_plain"), "fsdp2": ("dcp_fsdp2",),
          "megatron": ("megatron",)}
GROUP_WEIGHT = {"shardopt": 0.45, "fsdp2": 0.25, "megatron": 0.3}


# ----------------------------------------------------------------------------- checkpointers
class ShardoptCkpt:
    """``load`` restores into the same optimizer; ``load_resume``, after :meth:`new_optimizer`,
    into a new one. The optimizer is read from the shared ``System``, which both replace."""

    def __init__(self, s: _peers.System, rank: int, device: torch.device) -> None:
        self.s = s
        self.path: str | None = None

    def save(self, root: Path) -> None:
        from shardopt import checkpoint

        self.path = checkpoint.save(root, self.s.model, self.s.optimizer, step=1)

    def load(self, root: Path) -> None:
        from shardopt import checkpoint

        checkpoint.load(self.path, self.s.model, self.s.optimizer)

    def new_optimizer(self) -> None:
        """Replace the optimizer by a new one over the same model, config and param groups,
        which has no moments (as after a process restart). The old one's moments are freed
        first, so the device never holds two copies, and its grad hooks are removed."""
        from shardopt import DistributedOptimizer
        from shardopt.config import GROUP_KEYS

        old = self.s.optimizer
        _drop_moments(old)
        group = {fqn: old.param_groups[gi] for fqn, gi in old.group_of.items()}
        new = DistributedOptimizer(
            self.s.model, old.config, process_group=old.dp.group,
            param_group_fn=lambda fqn, p: {k: group[fqn][k] for k in GROUP_KEYS})
        for hook in getattr(old, "_hooks", ()):
            hook.remove()
        self.s.optimizer = new

    def tensors(self) -> list[torch.Tensor]:
        """Params and every allocated state of this rank (a new optimizer has no moments)."""
        return [p.detach() for p in self.s.model.parameters()] + \
            list(_shardopt_states(self.s.optimizer).values())


def _shardopt_states(opt: Any) -> dict[str, torch.Tensor]:
    from shardopt.optimizer import STATE_NAMES

    out = {}
    for shard in opt.shards:
        for n in STATE_NAMES:
            try:
                out[f"{shard.fqn}.{n}"] = opt.state_view(n, shard)
            except RuntimeError:  # moments not allocated before the first step or load
                pass
    return out


def _drop_moments(opt: Any) -> None:
    """Free a DistributedOptimizer's Adam moments (it has no public call for that)."""
    for attr, empty in (("_exp_avg", None), ("_exp_avg_sq", None), ("_views", None)):
        if hasattr(opt, attr):
            setattr(opt, attr, empty)
    host = getattr(opt, "_host", None)
    if host is not None:  # moments a low_memory_resume load staged on the host
        host.staged, host._staged_pinned = None, []
    if any(not n.endswith(".master_param") for n in _shardopt_states(opt)):
        raise RuntimeError("the old optimizer still holds moments; shardopt's internals changed")


class _ShardoptTensors:
    """shardopt's per-rank state as a plain FQN-keyed dict of live views (what it saves)."""

    def __init__(self, s: _peers.System, rank: int, device: torch.device) -> None:
        self.s, self.rank, self.device = s, rank, device

    def live(self) -> dict[str, torch.Tensor]:
        opt = self.s.optimizer  # shardopt's load_resume replaces it
        return {**{s.fqn: opt.buffers.shard_params(s) for s in opt.shards},
                **_shardopt_states(opt)}

    def tensors(self) -> list[torch.Tensor]:
        return list(self.live().values())


class TorchSaveCkpt(_ShardoptTensors):
    def _file(self, root: Path) -> Path:
        return root / f"rank{self.rank:05d}.pt"

    def save(self, root: Path) -> None:
        # Model shards are views into the full param buffer; torch.save would write the whole
        # storage, so they are cloned first (a GPU copy of a few GB: milliseconds).
        params = {s.fqn for s in self.s.optimizer.shards}
        state = {k: (v.clone() if k in params else v) for k, v in self.live().items()}
        with open(self._file(root), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, root: Path) -> None:
        loaded = torch.load(self._file(root), map_location=self.device, weights_only=True)
        live = self.live()
        with torch.no_grad():
            for k, v in loaded.items():
                live[k].copy_(v)


class DcpPlainCkpt(_ShardoptTensors):
    def _state(self) -> dict[str, torch.Tensor]:
        return {f"rank{self.rank:05d}/{k}": v for k, v in self.live().items()}

    def save(self, root: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=str(root))

    def load(self, root: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(self._state(), checkpoint_id=str(root))


class DcpFsdp2Ckpt:
    def __init__(self, s: _peers.System, rank: int, device: torch.device) -> None:
        self.model, self.opt = s.model, s.optimizer

    def save(self, root: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(root))

    def load(self, root: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(root))
        set_state_dict(self.model, self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for p in self.model.parameters():
            out.append(p.to_local() if hasattr(p, "to_local") else p.detach())
            st = self.opt.state.get(p, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    t = st[k]
                    out.append(t.to_local() if hasattr(t, "to_local") else t)
        return out


class MegatronCkpt:
    METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}

    def __init__(self, s: _peers.System, rank: int, device: torch.device) -> None:
        self.ddp, self.opt, self.rank = s.wrapped, s.optimizer, rank

    def _sharded(self, is_loading: bool) -> dict:
        model_sd = _peers.megatron_model_sharded_state_dict(self.ddp.module, self.rank)
        return {"model": model_sd,
                "optimizer": self.opt.sharded_state_dict(model_sd, is_loading=is_loading,
                                                         metadata=dict(self.METADATA))}

    def save(self, root: Path) -> None:
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.serialization import (
            get_default_save_sharded_strategy)
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper)

        strategy = FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy(),
            parallel_state.get_data_parallel_group(with_context_parallel=True))
        dist_checkpointing.save(self._sharded(False), str(root), sharded_strategy=strategy)

    def load(self, root: Path) -> None:
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(self._sharded(True), str(root))
        self.ddp.module.load_state_dict(loaded["model"])
        # no_grad: for fp32 params the main param is a view of the model param (a leaf that
        # requires grad), and megatron-core 0.19.2 copies into it in place without no_grad.
        with torch.no_grad():
            self.opt.load_state_dict(loaded["optimizer"])

    def tensors(self) -> list[torch.Tensor]:
        out = [p.detach() for p in self.ddp.module.parameters()]
        for inner in _peers.megatron_inner(self.opt):
            torch_opt = inner.optimizer
            for g in torch_opt.param_groups:
                for p in g["params"]:
                    out.append(p.detach())
                    st = torch_opt.state.get(p, {})
                    out.extend(st[k] for k in ("exp_avg", "exp_avg_sq") if k in st)
        return out


CKPT = {"shardopt": ShardoptCkpt, "torch_save": TorchSaveCkpt, "dcp_plain": DcpPlainCkpt,
        "dcp_fsdp2": DcpFsdp2Ckpt, "megatron": MegatronCkpt}


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


def _all_true(flag: bool) -> bool:
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return all(flags)


def _timed(fn, device: torch.device) -> float:
    _peers.barrier()
    _peers.sync(device)
    t0 = time.perf_counter()
    fn()
    _peers.sync(device)
    _peers.barrier()
    return time.perf_counter() - t0


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
        for op in ("load", "load_resume") if hasattr(ck, "new_optimizer") else ("load",):
            if op == "load_resume":
                ck.new_optimizer()
            if rank == 0:
                if target["evict"]:
                    _io_probes.evict(root)
                out[f"cached_fraction_before_{op}"] = _io_probes.cached_fraction(root)
            _scramble(ck.tensors())
            _peers.sync(device)
            with _common.HostRssSampler(interval_s=0.005) as rss:
                _measure(out, op, lambda: ck.load(root), device, probe)
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
    out[f"{op}_s"] = _timed(fn, device)
    if probe:
        snapshot = probe.snapshot()
        split = _io_probes.save_phases if op == "save" else _io_probes.load_phases
        out[f"{op}_phases"], out[f"{op}_overlapped"] = split(snapshot, out[f"{op}_s"])
        out[f"{op}_probe"] = snapshot


def _group_worker(rank: int, world: int, group: str, a: dict) -> dict:
    device = _peers.rank_device(rank, a["device"])
    if device.type == "cpu":
        torch.set_num_threads(max(1, a["cpu_threads"]))
    model = _peers.build_gpt(a["preset"], device, seed=0, **a["overrides"])
    s = _peers.SETUP[group](model, _peers.Hyper(), device)
    (x, y), = _peers.make_batches(a["preset"], rank, world, 1, 1, device)
    loss = float(s.step(x, y))
    _peers.sync(device)
    names = [n for n in GROUPS[group] if n in a["systems"]]
    ckpts = {n: CKPT[n](s, rank, device) for n in names}
    state_bytes = sum(t.numel() * t.element_size() for t in ckpts[names[0]].tensors())
    probe = _io_probes.Probe(device)
    last: dict[str, float] = {}
    results = []
    for target, name, rep in _plan(names, a):
        # a save and its loads of a system not measured yet: all at --first-gbps
        num_ops = 3 if hasattr(ckpts[name], "new_optimizer") else 2
        first = num_ops * state_bytes * world / (a["first_gbps"] * 1e9)
        estimate = 1.3 * last.get(name, first)
        skip = None
        if rank == 0 and time.time() + estimate > a["deadline"]:
            skip = f"time budget: ~{estimate:.0f} s needed, " \
                   f"{max(0.0, a['deadline'] - time.time()):.0f} s left"
        skip = _bcast(skip)
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
            "copy": _io_probes.copy_bandwidth(device) if rank == 0 else {}}


def _plan(names: list[str], a: dict) -> list[tuple[dict, str, int]]:
    """(target, system, rep) in priority order: every system once on shm, shardopt once on disk,
    shardopt's repeats on shm, the peers on disk, shardopt's repeats on disk."""
    targets = {t["name"]: t for t in a["targets"]}
    shm, disk = targets.get("shm"), targets.get("disk")
    ours = [n for n in names if n == "shardopt"]
    peers_disk = [n for n in names if n != "shardopt" and n in a["disk_systems"]]
    plan: list[tuple[dict, str, int]] = []
    if shm:
        plan += [(shm, n, 0) for n in names]
    if disk:
        plan += [(disk, n, 0) for n in ours]
    if shm:
        plan += [(shm, n, r) for n in ours for r in range(1, a["repeats"])]
        plan += [(shm, n, r) for n in names if n != "shardopt" for r in range(1, a["peer_repeats"])]
    if disk:
        plan += [(disk, n, r) for n in peers_disk for r in range(a["peer_repeats"])]
        plan += [(disk, n, r) for n in ours for r in range(1, a["repeats"])]
    return plan


def _raw_worker(rank: int, world: int, a: dict) -> dict:
    out = {}
    for target in a["targets"]:
        out[target["name"]] = [_io_probes.raw_bandwidth(
            Path(target["dir"]), rank, a["raw_bytes"], a["device"] == "cuda", target["evict"],
            threads=a["raw_threads"]) for _ in range(a["raw_repeats"])]
    return out


# ----------------------------------------------------------------------------- parent
def _checkpoint_bytes(args: argparse.Namespace) -> int:
    """About what shardopt writes: model-dtype weights + 3 fp32 states per param."""
    from shardopt.model import GPT, model_config

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


def _raw_best(rw: dict, kind: str) -> tuple[float, str]:
    """The faster raw test of a target for ``kind`` ("write" or "read"): (seconds, basis), of the
    one-thread test and, when it was run (results of older runs lack it), the threaded one."""
    best, basis = rw[f"{kind}_s"], "1 thread"
    threaded = rw.get(f"{kind}_s_threads")
    if threaded and threaded < best:
        best, basis = threaded, f"{rw['threads']} threads"
    return best, basis


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
        rw = raw.get(target)
        if rw and row["GBps"]:
            raw_s, row["raw_basis"] = _raw_best(rw, "write" if op == "save" else "read")
            row["vs_raw"] = row["GBps"] / _gbps(rw["bytes_total"], raw_s)
        rows.append(row)
    ours = {(r["target"], r["op"]): r for r in rows if r["system"] == "shardopt"}
    for row in rows:
        o = ours.get((row["target"], row["op"]))
        if o and row["system"] != "shardopt" and o["GBps"] and row["GBps"]:
            row["ours_speedup"] = o["GBps"] / row["GBps"]
    for target, rw in raw.items():
        for op in ("write", "read"):
            for key, label in ((f"{op}_s", "1 thread"),
                               (f"{op}_s_threads", f"{rw.get('threads')} threads")):
                if rw.get(key):
                    table.append([f"raw ({nproc} proc, {label})", op, target,
                                  rw["bytes_total"] / 1e9, rw[key],
                                  _gbps(rw["bytes_total"], rw[key]), None, None])
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
                + " of raw bandwidth, the faster raw test (target >= 90%)")
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
    p.add_argument("--repeats", type=int, default=2, help="save+load repeats for shardopt")
    p.add_argument("--peer-repeats", type=int, default=1)
    p.add_argument("--raw-mib", type=int, default=4096, help="raw bandwidth test size per rank")
    p.add_argument("--raw-repeats", type=int, default=2, help="raw tests per target (best kept)")
    p.add_argument("--raw-threads", type=int, default=None,
                   help="threads per rank of the threaded raw test (default: as many as "
                   "shardopt's io_threads() gives each rank; 1: one-thread test only)")
    p.add_argument("--budget", type=float, default=270.0,
                   help="seconds for all checkpoint groups; peers beyond it are skipped")
    p.add_argument("--disk-systems", default="shardopt,torch_save,dcp_fsdp2,megatron",
                   help="systems also measured on disk (after every system on shm)")
    p.add_argument("--first-gbps", type=float, default=0.8,
                   help="assumed GB/s of a system's first save and load, for the budget")
    p.add_argument("--timeout", type=float, default=150.0,
                   help="seconds a process group may run past its share of the budget")
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if set(systems) - set(CKPT_SYSTEMS):
        p.error(f"unknown systems {sorted(set(systems) - set(CKPT_SYSTEMS))}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; use --device cpu for a smoke run")
    targets = _targets(args)
    for t in targets:
        print(f"target {t['name']}: {t['dir']} ({t['fstype']} on {t['source']}, "
              f"{t['free_bytes'] / 1e9:.0f} GB free)", flush=True)
    start = time.time()
    a = {"device": args.device, "preset": args.preset, "systems": systems, "targets": targets,
         "repeats": args.repeats, "peer_repeats": args.peer_repeats,
         "raw_bytes": args.raw_mib << 20, "raw_repeats": args.raw_repeats,
         "raw_threads": args.raw_threads,
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
            reps = list(zip(*(r[t["name"]] for r in per_rank)))  # per repeat: every rank
            # a repeat takes as long as its slowest rank; the best repeat is the bandwidth
            entry: dict[str, Any] = {"bytes_total": sum(r["bytes"] for r in reps[0])}
            keys = ["write_s", "read_s"]
            if "threads" in reps[0][0]:
                entry["threads"] = reps[0][0]["threads"]
                keys += ["write_s_threads", "read_s_threads"]
            for key in keys:
                per_rep = [max(r[key] for r in rep) for rep in reps]
                entry[key], entry[f"{key}_all"] = min(per_rep), per_rep
            entry["per_rank"] = [list(rep) for rep in reps]
            raw[t["name"]] = entry
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
