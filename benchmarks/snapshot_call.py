"""The snapshot's share of an asynchronous save's call: planning it against repeating it.

An asynchronous ``checkpoint.save`` copies the rank's state into its snapshot before it
returns. The first save builds a view per param and state and the runs of adjacent elements
(``save._state_contents`` + ``Snapshot.take``); a repeated one queues the same copies again
from the optimizer's ``state_sources()`` (``Snapshot.retake``). This times both, and the
copies alone, on the ``1b`` preset's layout (``--d-model`` shrinks the tensors, not their
number), after one step so that the moments exist. On CUDA the copies are only queued.

    PYTHONPATH=src python3 benchmarks/snapshot_call.py --out benchmarks/results   # CPU
    PYTHONPATH=src python3 benchmarks/snapshot_call.py --device cuda --d-model 2048 --out $OUT
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import _peers  # noqa: E402


def _timed(fn, repeats: int, device: torch.device) -> dict:
    times = []
    for _ in range(repeats):
        _common.cuda_sync(device)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)  # host time: what the call costs
    _common.cuda_sync(device)
    return _common.stats(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--preset", default="1b")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    device = _peers.single_rank_group(args.device)
    small = {} if args.d_model == 2048 else {"d_model": args.d_model, "d_ff": 4 * args.d_model,
                                              "vocab_size": 512, "num_heads": 4}
    model = _peers.build_gpt(args.preset, device, seed=0, **small)
    opt = _peers.setup_shardopt(model, _peers.Hyper(), device).optimizer
    vocab = small.get("vocab_size", 50304)
    x = torch.randint(0, vocab, (1, 32), device=device)
    model(x, x).backward()
    opt.step()
    opt.zero_grad()
    save = importlib.import_module("shardopt.checkpoint.save")
    state = importlib.import_module("shardopt.checkpoint.state")
    snap = save._snapshot(opt)
    frozen = state.frozen_tensors(model, opt)
    plan = _timed(lambda: snap.take(save._state_contents(opt, frozen), False,
                                    state.sources(opt, frozen)), args.repeats, device)
    repeat = _timed(lambda: snap.retake(state.sources(opt, frozen), False), args.repeats, device)
    sources = state.sources(opt, frozen)
    pairs = [(snap._buffers[d][at:at + n], sources[name].narrow(0, rel, n))
             for name, rel, n, d, at in snap._plan.runs]
    copies = _timed(lambda: snap._copy(pairs), args.repeats, device)
    result = {"params": len(opt.layout.slots), "copies": len(pairs),
              "snapshot_bytes": snap.nbytes(), "plan_ms": plan, "repeat_ms": repeat,
              "copies_ms": copies}
    print(f"{result['params']} params, {len(pairs)} copies of {snap.nbytes() / 1e6:.1f} MB: "
          f"plan {plan['median']:.2f} ms, repeat {repeat['median']:.2f} ms, copies alone "
          f"{copies['median']:.2f} ms (medians of {args.repeats})")
    doc = {**_common.run_header(device, vars(args)), "benchmark": "snapshot_call", **result}
    _common.write_json(Path(args.out) / f"snapshot_call_{device.type}.json", doc)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
