"""Raw storage bandwidth against the number of files written and read at once (one process).

The checkpoint benchmark holds a save or load to the raw bandwidth of its target; this script
shows how that bandwidth depends on how many files are written side by side, which is what
decides how many files a rank's checkpoint is split into. For each target and each thread count
``t``, ``--mib`` MiB are written in 32 MiB pieces dealt round-robin to ``t`` threads, each thread
writing its own file (``os.pwrite`` from its own buffer, pinned on a GPU host) and ``fsync`` ing
it; the files are evicted from the page cache where that means anything (not on tmpfs) and read
back the same way (``_io_probes._raw_pass``, the checkpoint benchmark's raw test). Best of
``--repeats``.

    PYTHONPATH=src python3 benchmarks/probes/storage_scaling.py --out benchmarks/results
    PYTHONPATH=src python3 benchmarks/probes/storage_scaling.py --mib 256 --threads 1,2 --targets disk  # smoke
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suites' helpers
import _common  # noqa: E402
import _io_probes  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="shm,disk", help="comma-separated: shm, disk")
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--disk-dir", default="/tmp", help="a directory on local disk")
    p.add_argument("--threads", default="1,2,4,6,8,12,16", help="comma-separated thread counts")
    p.add_argument("--mib", type=int, default=4096, help="MiB written and read per test")
    p.add_argument("--repeats", type=int, default=2, help="tests per count (best kept)")
    p.add_argument("--out", default=None, help="directory for storage_scaling.json")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    counts = [int(x) for x in args.threads.split(",") if x]
    pieces = (args.mib << 20) // _io_probes.CHUNK_BYTES
    nbytes = pieces * _io_probes.CHUNK_BYTES
    result = _common.run_header(torch.device("cuda" if cuda else "cpu"),
                                {"mib": args.mib, "threads": counts, "repeats": args.repeats,
                                 "piece_bytes": _io_probes.CHUNK_BYTES, "pinned_buffers": cuda})
    result["benchmark"] = "storage_scaling"
    result["targets"] = {}
    rows = []
    for target in [t for t in args.targets.split(",") if t]:
        base = {"shm": args.shm_dir, "disk": args.disk_dir}[target]
        if shutil.disk_usage(base).free < nbytes * 1.2:
            print(f"{target}: skipped, {base} has less than {nbytes * 1.2 / 1e9:.1f} GB free")
            continue
        d = Path(tempfile.mkdtemp(prefix="shardopt-scaling-", dir=base))
        runs = []
        try:
            for t in counts:
                tests = [_io_probes._raw_pass(d / f"raw-t{t}.bin", pieces, t, cuda,
                                              evict_cache=target != "shm")
                         for _ in range(args.repeats)]
                write = min(x["write_s"] for x in tests)
                read = min(x["read_s"] for x in tests)
                runs.append({"threads": t, "write_s": write, "read_s": read,
                             "write_GBps": nbytes / write / 1e9, "read_GBps": nbytes / read / 1e9,
                             "tests": tests})
                rows.append([target, t, nbytes / write / 1e9, nbytes / read / 1e9,
                             max(x["cached_fraction_before_read"] or 0.0 for x in tests)])
                print(_common.format_table(rows[-1:], ["target", "threads", "write GB/s",
                                                       "read GB/s", "cached before read"]),
                      flush=True)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        mount = _io_probes.mount_of(d.resolve())
        result["targets"][target] = {"dir": base, "bytes": nbytes, **mount, "runs": runs}
    print(_common.format_table(rows, ["target", "threads", "write GB/s", "read GB/s",
                                      "cached before read"]))
    if args.out:
        _common.write_json(Path(args.out) / "storage_scaling.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
