"""Host time ``step()`` spends on its per-param bookkeeping, for a model of many params.

Each ``step()`` walks the params a few times in Python (C-level ``map`` where it can):

* ``check``   : ``ParamWatch.written()`` -- compares every param's ``data_ptr()`` and
                version counter with the recorded ones (a moved model raises; params the
                user wrote in place get their main params re-seeded);
* ``record``  : ``ParamWatch.record()`` after the step's own writes;
* ``steps``   : ``update.next_steps`` + ``update.advance`` -- per-param step counts;
* ``presence``: did every param get a gradient on this rank (with DP 1 that is all).

One rank, no collectives; each part is timed alone over ``--repeats`` calls.

    PYTHONPATH=src python3 benchmarks/probes/step_bookkeeping.py --num-params 1000 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suites' helpers
from _common import format_table, run_header, stats, write_json  # noqa: E402

from shardopt import DistributedOptimizer, OptimizerConfig  # noqa: E402
from shardopt import update as step_plan  # noqa: E402


def per_call_us(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return stats(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-params", type=int, default=1000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    model = nn.ParameterList(nn.Parameter(torch.zeros(16, device=device, dtype=torch.bfloat16))
                             for _ in range(args.num_params))
    opt = DistributedOptimizer(model, OptimizerConfig(bucket_numel=1 << 20))
    opt._grad_sync.mark_written(opt.layout.fqns)  # as after a backward that reached every param
    steps = {}

    def plan() -> None:
        n = step_plan.next_steps(opt.param_steps, opt._group_fqns, None)
        step_plan.advance(opt.param_steps, opt._group_fqns, None, n)

    parts = {
        "check": lambda: opt._watch.written(),
        "record": opt._watch.record,
        "steps": plan,
        "presence": lambda: opt._norm.agree(None),
    }
    for name, fn in parts.items():
        steps[name] = per_call_us(fn, args.repeats)
    total = sum(s["median"] for s in steps.values())
    rows = [[k, s["median"], s["median"] / args.num_params * 1e3] for k, s in steps.items()]
    rows.append(["total", total, total / args.num_params * 1e3])
    print(f"step bookkeeping, {args.num_params} params, host {device}")
    print(format_table(rows, ["part", "median us/step", "ns/param"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "step_bookkeeping.json",
               {**run_header(device, vars(args)), "parts_us": steps, "total_median_us": total})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
