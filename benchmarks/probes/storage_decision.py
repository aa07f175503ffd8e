"""The storage decision: shardopt's own safetensors writer against DCP's Hugging Face writer.

DESIGN asked for ``torch.distributed.checkpoint`` planners over safetensors; shardopt writes
its files itself. This measures both on the same state, in one run, interleaved by round:

* ``shardopt``: ``shardopt.checkpoint.save`` with ``io_threads=N`` (its files, block hashes,
  manifest, RNG files, atomic commit).
* ``dcp_hf``: ``dcp.save`` through ``HuggingFaceStorageWriter(path, save_distributed=True,
  thread_count=N, fqn_to_index_mapping=...)`` and ``_dcp_chunks.ChunkSavePlanner``, fed the
  chunks a shardopt save writes (the same ``WriteEntry`` records: bf16 weights, fp32 main
  params and moments, each rank its own 1-D runs at their model-space offsets). The mapping
  spreads the keys over N files of about equal bytes, so the writer's N threads each have a
  file (without it DCP writes a rank's data to one file, on one thread).

Same bytes (the file sizes are recorded; shardopt's extra is its manifest, with the block
hashes, and the RNG files), same threads (N, default shardopt's ``io_threads()`` in the rank),
same target directory, ``--repeats`` rounds (default 3) of one save each, in fresh
directories, timed between barriers after a device sync. The first round's DCP files are read
back with ``safetensors.safe_open`` and compared with the source chunks (offsets and a
strided sample of every chunk). Needs ``safetensors`` (DCP's writer imports it); where the
writer cannot be built the reason is recorded and shardopt is measured alone.

GPU::

    PYTHONPATH=src python3 benchmarks/probes/storage_decision.py --out $OUT

CPU smoke::

    PYTHONPATH=src python benchmarks/probes/storage_decision.py --device cpu --preset tiny --dir /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suites' helpers
import _common  # noqa: E402
import _dcp_chunks  # noqa: E402
import _io_probes  # noqa: E402
import _peers  # noqa: E402

SYSTEMS = ("shardopt", "dcp_hf")


def _hf_writer(path: Path, threads: int, mapping: dict[str, int]) -> Any:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    return HuggingFaceStorageWriter(str(path), fqn_to_index_mapping=mapping,
                                    thread_count=threads, save_distributed=True)


def _check_hf_files(root: Path, entries: list, rank: int) -> int:
    """Compare this rank's DCP files with the chunks they came from; returns keys checked."""
    from safetensors import safe_open

    want = {(e.key, e.offset): e for e in entries}
    seen = 0
    for f in sorted(root.glob(f"shard-{rank + 1:05d}-*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            info = json.loads(st.metadata()["DCP_SHARDING_INFO"])
            for key in st.keys():
                e = want[(key, info[key]["saved_offsets"][0])]
                got = st.get_tensor(key)
                src = e.source.detach().reshape(-1)
                step = max(1, e.numel // 4096)
                if got.shape != (e.numel,) or not torch.equal(got[::step], src[::step].cpu()):
                    raise AssertionError(f"{f.name}: {key} differs from its source chunk")
                seen += 1
    if seen != len(entries):
        raise AssertionError(f"rank {rank}: {seen} chunks in DCP's files, {len(entries)} saved")
    return seen


def _worker(rank: int, world: int, a: dict) -> dict:
    from shardopt import checkpoint
    from shardopt.checkpoint.transfer import io_threads

    device = _peers.rank_device(rank, a["device"])
    model = _peers.build_gpt(a["preset"], device, seed=0, **a["overrides"])
    s = _peers.SETUP["shardopt"](model, _peers.Hyper(), device)
    (x, y), = _peers.make_batches(a["preset"], rank, world, 1, 1, device)
    s.step(x, y)
    _peers.sync(device)
    threads = io_threads(a["io_threads"])
    entries = _dcp_chunks.rank_entries(model, s.optimizer)
    numels = _dcp_chunks.global_numels(model, s.optimizer)
    sd = model.state_dict()
    itemsize = {k: sd[k].element_size() if k in sd else 4 for k in numels}
    mapping = _dcp_chunks.balanced_files(numels, itemsize, threads)
    base = Path(a["dir"])
    out: dict[str, Any] = {"threads": threads, "rank_bytes": sum(
        e.numel * e.dtype.itemsize for e in entries), "rounds": [], "errors": {}}
    systems = list(a["systems"])
    for rep in range(a["repeats"]):
        for name in list(systems):
            root = base / f"{name}-{rep}"
            if rank == 0:
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir(parents=True)
            _peers.barrier()
            try:
                if name == "shardopt":
                    cfg = checkpoint.CheckpointConfig(io_threads=threads)
                    secs = _peers.timed(lambda: checkpoint.save(
                        root, model, s.optimizer, step=1, config=cfg), device)
                else:
                    import torch.distributed.checkpoint as dcp

                    # planning is part of DCP's save, as it is of ours: inside the timing
                    secs = _peers.timed(lambda: dcp.save(
                        {}, storage_writer=_hf_writer(root, threads, mapping),
                        planner=_dcp_chunks.ChunkSavePlanner(entries, numels)), device)
                    if rep == 0:
                        out["dcp_hf_chunks_checked"] = _check_hf_files(root, entries, rank)
            except Exception:  # noqa: BLE001 - recorded; the other system goes on
                out["errors"][name] = traceback.format_exc()[-4000:]
                systems.remove(name)
                _peers.barrier()
                continue
            row = {"system": name, "rep": rep, "s": secs}
            if rank == 0:
                row["bytes"] = _io_probes.dir_bytes(root)
                row["files"] = len(_io_probes.files_under(root))
                print(f"  [{name} rep {rep}] {row['bytes'] / 1e9:.2f} GB, {row['files']} files, "
                      f"{secs:.3f} s", flush=True)
            out["rounds"].append(row)
            _peers.barrier()
            if rank == 0:
                shutil.rmtree(root, ignore_errors=True)
    return out


def summarize(rounds: list[dict]) -> tuple[list[dict], str]:
    rows = []
    for name in SYSTEMS:
        rs = [r for r in rounds if r["system"] == name]
        if rs:
            secs = _common.stats([r["s"] for r in rs])
            rows.append({"system": name, "n": len(rs), "bytes": rs[0]["bytes"],
                         "files": rs[0]["files"], "s": secs,
                         "GBps": rs[0]["bytes"] / secs["median"] / 1e9})
    table = [[r["system"], r["n"], r["files"], r["bytes"] / 1e9, r["s"]["min"], r["s"]["median"],
              r["s"]["max"], r["GBps"]] for r in rows]
    text = _common.format_table(table, ["system", "rounds", "files", "GB", "min s", "median s",
                                        "max s", "GB/s"])
    if len(rows) == 2:
        text += (f"\nshardopt's save takes {rows[0]['s']['median'] / rows[1]['s']['median']:.2f}x "
                 "the time of DCP's Hugging Face writer (medians)")
    return rows, text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--preset", default="1b")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--dir", default="/dev/shm", help="where both write (a new directory in it)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--io-threads", type=int, default=None,
                   help="threads per rank of both writers (default: shardopt's io_threads())")
    p.add_argument("--timeout", type=float, default=500.0)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; use --device cpu for a smoke run")
    systems = [x for x in args.systems.split(",") if x]
    if set(systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(set(systems) - set(SYSTEMS))}")
    work = Path(args.dir) / f"shardopt-storage-decision-{os.getpid()}"
    a = {"device": args.device, "preset": args.preset, "dir": str(work), "systems": systems,
         "repeats": args.repeats, "io_threads": args.io_threads,
         "overrides": {"num_layers": args.num_layers} if args.num_layers else {}}
    start = time.time()
    errors: dict[str, str] = {}
    results: list[dict] = []
    try:
        results = _peers.spawn(_worker, args.nproc, a, device=args.device,
                               timeout_s=args.timeout)
        for r in results:
            errors.update({f"rank{results.index(r)}/{k}": v for k, v in r["errors"].items()})
    except Exception as e:  # noqa: BLE001
        errors["run"] = str(e) if isinstance(e, _peers.RankFailed) else traceback.format_exc()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows, text = summarize(results[0]["rounds"] if results else [])
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    config = {k: v for k, v in vars(args).items() if k not in ("out", "tag")}
    doc = {**_common.run_header(device, config), "benchmark": "storage_decision",
           "target": {"dir": args.dir, **_io_probes.mount_of(Path(args.dir).resolve())},
           "summary": rows, "per_rank": results, "errors": errors, "wall_s": time.time() - start}
    name = f"storage_decision_{args.nproc}gpu{args.tag}.json" if args.device == "cuda" else \
        f"storage_decision_cpu_{args.nproc}rank{args.tag}.json"
    _common.write_json(Path(args.out) / name, doc)
    print(f"\nstorage_decision: {args.nproc} rank(s), {args.preset}, {args.dir}, "
          f"{results[0]['threads'] if results else '?'} threads per rank")
    print(text)
    if errors:
        for k, v in errors.items():
            print(f"{k} FAILED:\n{v}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
