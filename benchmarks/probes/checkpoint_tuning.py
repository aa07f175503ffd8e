"""shardopt's checkpoint save and load against its I/O settings (one rank, one process).

Builds the ``--preset`` GPT with shardopt's optimizer (one training step, so the moments
exist), then saves and loads it to ``--dir`` once per setting and repeat, interleaved:
``io_threads`` (files written at once, blocks read at once), ``staging_bytes`` (host memory a
save or load stages through; per writer thread it is ``staging_bytes / files / 2``, capped at
``block_bytes``), ``block_bytes`` (hash block) and the writer threads per file
(``storage.FILE_THREADS``, an internal constant, patched here). Each save is followed by an
in-place load of it; the checkpoint is then deleted. Prints a table and, with ``--out``,
writes ``checkpoint_tuning.json``. This is what chose the defaults; the comparison with other
systems is ``checkpoint_io.py``.

    PYTHONPATH=src python3 benchmarks/probes/checkpoint_tuning.py --out benchmarks/results
    PYTHONPATH=src python3 benchmarks/probes/checkpoint_tuning.py --device cpu --preset tiny --repeats 1
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suites' helpers
import _common  # noqa: E402
import _peers  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="1b")
    p.add_argument("--dir", default="/dev/shm", help="where checkpoints are written")
    p.add_argument("--io-threads", default="8,16", help="comma-separated")
    p.add_argument("--staging-mib", default="128,512", help="comma-separated")
    p.add_argument("--block-mib", default="8", help="comma-separated")
    p.add_argument("--file-threads", default="1,2", help="comma-separated")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None, help="directory for checkpoint_tuning.json")
    args = p.parse_args(argv)

    import importlib

    from shardopt import checkpoint
    from shardopt.checkpoint import storage

    ckpt_save = importlib.import_module("shardopt.checkpoint.save")

    device = torch.device(args.device)
    model = _peers.build_gpt(args.preset, device)
    s = _peers.SETUP["shardopt"](model, _peers.Hyper(), device)
    (x, y), = _peers.make_batches(args.preset, 0, 1, 1, 1, device)
    s.step(x, y)
    _peers.sync(device)
    grid = list(itertools.product(_ints(args.io_threads), _ints(args.staging_mib),
                                  _ints(args.block_mib), _ints(args.file_threads)))
    times: dict[tuple, dict[str, list[float]]] = {g: {"save": [], "load": []} for g in grid}
    nbytes = 0
    base = Path(tempfile.mkdtemp(prefix="shardopt-tuning-", dir=args.dir))
    try:
        for rep in range(args.repeats):
            for g in grid:
                threads, staging, block, per_file = g
                storage.FILE_THREADS = ckpt_save.FILE_THREADS = per_file
                root = base / f"t{threads}-s{staging}-b{block}-f{per_file}"
                cfg = checkpoint.CheckpointConfig(block_bytes=block << 20,
                                                  staging_bytes=staging << 20, io_threads=threads)
                t0 = time.perf_counter()
                path = checkpoint.save(root, s.model, s.optimizer, step=1, config=cfg)
                _peers.sync(device)
                t1 = time.perf_counter()
                checkpoint.load(path, s.model, s.optimizer, config=cfg)
                _peers.sync(device)
                t2 = time.perf_counter()
                nbytes = sum(f.stat().st_size for f in Path(path).iterdir())
                files = len(list(Path(path).iterdir())) - 1
                times[g]["save"].append(t1 - t0)
                times[g]["load"].append(t2 - t1)
                times[g]["files"] = files
                shutil.rmtree(root)
                print(f"rep {rep} io_threads {threads} staging {staging} MiB block {block} MiB "
                      f"file_threads {per_file}: {files} files, save {t1 - t0:.3f} s, "
                      f"load {t2 - t1:.3f} s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows, runs = [], []
    for g in grid:
        save, load = times[g]["save"], times[g]["load"]
        runs.append({"io_threads": g[0], "staging_mib": g[1], "block_mib": g[2],
                     "file_threads": g[3], "files": times[g]["files"],
                     "save_s": _common.stats(save), "load_s": _common.stats(load)})
        rows.append([*g, times[g]["files"], statistics.median(save),
                     nbytes / statistics.median(save) / 1e9, statistics.median(load),
                     nbytes / statistics.median(load) / 1e9])
    print(_common.format_table(rows, ["io_threads", "staging MiB", "block MiB", "file threads",
                                      "files", "save s", "save GB/s", "load s", "load GB/s"]))
    if args.out:
        result = _common.run_header(device, vars(args))
        result.update(benchmark="checkpoint_tuning", bytes=nbytes, runs=runs)
        _common.write_json(Path(args.out) / "checkpoint_tuning.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
