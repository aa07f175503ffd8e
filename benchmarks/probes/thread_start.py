"""How long starting a background save's thread keeps the caller, when that thread runs Python.

``threading.Thread.start()`` returns once the new thread runs. A new thread that then runs
Python at once holds the GIL, and the caller waits for it up to the interpreter's switch
interval (``sys.getswitchinterval()``, 5 ms) before it can return. Timed here, each over
``--repeats`` starts, the target a ``--busy-ms`` loop of Python (as a save's first steps):

* ``plain``      : ``Thread(target=busy).start()``;
* ``save_handle``: ``shardopt.checkpoint.background.SaveHandle`` with the same work, whose
                   thread waits on an event (set right after the start) before it runs.

    PYTHONPATH=src python3 benchmarks/probes/thread_start.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suites' helpers
from _common import format_table, run_header, stats, write_json  # noqa: E402

from shardopt.checkpoint.background import SaveHandle  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--busy-ms", type=float, default=20.0)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)

    def busy(_group: object = None) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < args.busy_ms / 1e3:
            pass

    def plain() -> threading.Thread:
        thread = threading.Thread(target=busy)
        thread.start()
        return thread

    def save_handle() -> SaveHandle:
        return SaveHandle("probe", busy, None)  # type: ignore[arg-type]

    starts: dict[str, list[float]] = {"plain": [], "save_handle": []}
    for _ in range(args.repeats):
        for name, start in (("plain", plain), ("save_handle", save_handle)):
            t0 = time.perf_counter()
            started = start()
            starts[name].append((time.perf_counter() - t0) * 1e3)
            if isinstance(started, SaveHandle):
                started.wait()
            else:
                started.join()
    result = {name: stats(ms) for name, ms in starts.items()}
    config = {"repeats": args.repeats, "busy_ms": args.busy_ms,
              "switch_interval_ms": sys.getswitchinterval() * 1e3}
    doc = run_header(torch.device("cpu"), config)
    doc.update({"world_size": 1, "start_ms": result})
    out = Path(args.out) / "thread_start.json"
    write_json(out, doc)
    print(format_table([[n, r["median"], r["min"], r["max"]] for n, r in result.items()],
                       ["start", "median ms", "min ms", "max ms"]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
