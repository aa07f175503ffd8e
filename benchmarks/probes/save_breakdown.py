"""Where a save's time goes: the same bytes written by shardopt's file writer with parts removed.

One process writes ``--files`` files of ``--gib-per-file`` GiB at once to ``--dir``, one thread per
file, through ``shardopt.checkpoint.storage.write_file`` (what ``checkpoint.save`` runs per file),
in four variants, interleaved over ``--repeats``:

* ``device``: the data on the GPU, staged through pinned buffers, hashed (what a save does);
* ``device_nohash``: the same with xxh3 replaced by a no-op hasher;
* ``host``: the data in pinned host memory, written straight from it, hashed;
* ``host_nohash``: the same without hashing: the writer's own overhead over a raw write;

and the raw test beside them (``_io_probes._raw_pass`` with ``--files`` threads, a file each).
Staging per thread is ``--staging-mib`` / ``--files`` (the save's default split).

    PYTHONPATH=src python3 benchmarks/probes/save_breakdown.py --out benchmarks/results
    PYTHONPATH=src python3 benchmarks/probes/save_breakdown.py --files 2 --gib-per-file 0.125 --repeats 1  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suites' helpers
import _common  # noqa: E402
import _io_probes  # noqa: E402


class _NoHash:
    def update(self, _data) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 16


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--files", type=int, default=15)
    p.add_argument("--gib-per-file", type=float, default=1.2)
    p.add_argument("--staging-mib", type=int, default=128)
    p.add_argument("--block-mib", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="directory for save_breakdown.json")
    args = p.parse_args(argv)

    from shardopt.checkpoint import transfer
    from shardopt.checkpoint.storage import WriteEntry, write_file, write_scratch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    numel = int(args.gib_per_file * (1 << 30)) // 4
    sources = {"device": [torch.randn(numel, device=device) for _ in range(args.files)]}
    sources["host"] = [torch.empty(numel, pin_memory=cuda).copy_(t) for t in sources["device"]]
    nbytes = args.files * numel * 4
    block, staging = args.block_mib << 20, (args.staging_mib << 20) // args.files
    variants = ["device", "device_nohash", "host", "host_nohash", "raw"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    base = Path(tempfile.mkdtemp(prefix="shardopt-breakdown-", dir=args.dir))
    try:
        for rep in range(args.repeats):
            for v in variants:
                d = base / f"{v}-{rep}"
                d.mkdir()
                if v == "raw":
                    pieces = nbytes // _io_probes.CHUNK_BYTES
                    raw = _io_probes._raw_pass(d / "raw.bin", pieces, args.files, cuda, False)
                    times[v].append(raw["write_s"] * nbytes / (pieces * _io_probes.CHUNK_BYTES))
                else:
                    where = v.split("_")[0]
                    scratch = [write_scratch(block, staging, device if where == "device"
                                             else torch.device("cpu"))
                               for _ in range(args.files)]
                    jobs = list(range(args.files))
                    hasher = mock.patch.object(transfer.xxhash, "xxh3_64", _NoHash) \
                        if v.endswith("nohash") else contextlib.nullcontext()
                    with hasher:
                        if cuda:
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        transfer.run_parallel(jobs, lambda i, slot: write_file(
                            str(d / f"f{i}.safetensors"),
                            [WriteEntry("x", torch.float32, numel, 0, sources[where][i])],
                            block, scratch[i]), len(jobs))
                        times[v].append(time.perf_counter() - t0)
                shutil.rmtree(d)
                print(f"rep {rep} {v}: {times[v][-1]:.3f} s, "
                      f"{nbytes / times[v][-1] / 1e9:.2f} GB/s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = [[v, statistics.median(times[v]), min(times[v]), max(times[v]),
             nbytes / statistics.median(times[v]) / 1e9] for v in variants]
    print(_common.format_table(rows, ["variant", "median s", "min s", "max s", "GB/s"]))
    if args.out:
        result = _common.run_header(device, vars(args))
        result.update(benchmark="save_breakdown", bytes=nbytes,
                      runs={v: _common.stats(times[v]) for v in variants})
        _common.write_json(Path(args.out) / "save_breakdown.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
