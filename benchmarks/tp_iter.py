"""Tensor parallelism: a training iteration and a checkpoint of the HF Llama at (dp, tp).

Every rank builds the Hugging Face Llama of ``--preset`` (bf16), parallelises its attention and
MLP projections over the "tp" dim of a ``(dp, tp)`` mesh (``parallelize_module``: q/k/v, gate
and up column-parallel, o and down row-parallel; embeddings, norms and head plain), and trains
it with ``DistributedOptimizer(process_group=mesh["dp"])``. Recorded: seconds per iteration
(forward and backward, then the step, each between barriers: median and max over ranks of each
rank's median over ``--iters`` after ``--warmup``), the step alone, peak GPU memory, then a
checkpoint save at this layout and its load at ``--load-tp`` (default: no TP, DP the whole
world) with the exports compared. One JSON under ``--out``. Needs ``dp * tp`` GPUs
(``--device cuda``); ``--device cpu --preset tiny`` runs on gloo.

    PYTHONPATH=src python3 benchmarks/tp_iter.py --tp 2 --dp 4 --out $OUT        # 8 GPUs
    PYTHONPATH=src python3 benchmarks/tp_iter.py --tp 4 --dp 2 --out $OUT
    PYTHONPATH=src python3 benchmarks/tp_iter.py --device cpu --preset tiny --tp 2 --dp 1 --out /tmp
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import _peers  # noqa: E402

PROJECTIONS = [("self_attn.q_proj", "col"), ("self_attn.k_proj", "col"),
               ("self_attn.v_proj", "col"), ("self_attn.o_proj", "row"),
               ("mlp.gate_proj", "col"), ("mlp.up_proj", "col"), ("mlp.down_proj", "row")]


def _build(a: dict, rank: int, world: int, tp: int):
    """This rank's model (tensor parallel over ``tp`` ranks when ``tp`` > 1) and optimizer."""
    import shardopt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    device = _peers.rank_device(rank, a["device"])
    model = _common.build_hf_llama(a["preset"], device)
    hp = _peers.Hyper()
    config = shardopt.OptimizerConfig(lr=hp.lr, betas=hp.betas, eps=hp.eps,
                                      weight_decay=hp.weight_decay, max_grad_norm=hp.max_grad_norm)
    if tp == 1:
        return model, shardopt.DistributedOptimizer(model, config), device, rank, world
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    styles = {"col": ColwiseParallel, "row": RowwiseParallel}
    parallelize_module(model, mesh["tp"], {f"lm.model.layers.*.{name}": styles[kind]()
                                           for name, kind in PROJECTIONS})
    opt = shardopt.DistributedOptimizer(model, config, process_group=mesh["dp"].get_group())
    return model, opt, device, mesh["dp"].get_local_rank(), world // tp


def _train(rank: int, world: int, a: dict, root: str) -> dict:
    from shardopt import checkpoint

    model, opt, device, dp_rank, dp = _build(a, rank, world, a["tp"])
    batches = _common.make_batches("hf-llama", a["preset"], dp_rank, dp, a["micro_batch"],
                                   a["warmup"] + a["iters"], device)
    iters, steps = [], []
    for i, (x, y) in enumerate(batches):
        backward = _peers.timed(lambda x=x, y=y: model(x, y).backward(), device)
        step = _peers.timed(opt.step, device)
        opt.zero_grad()
        if i >= a["warmup"]:
            iters.append(backward + step)
            steps.append(step)
    out = {"iter_s": statistics.median(iters), "step_s": statistics.median(steps)}
    if device.type == "cuda":
        out["peak_allocated"] = torch.cuda.max_memory_allocated(device)
    t0 = time.perf_counter()
    out["path"] = checkpoint.save(root, model, opt, step=len(batches))
    out["save_s"] = time.perf_counter() - t0
    return out


def _load(rank: int, world: int, a: dict, src: str, root: str) -> dict:
    from shardopt import checkpoint

    model, opt, device, _, _ = _build(a, rank, world, a["load_tp"])
    t0 = time.perf_counter()
    checkpoint.load(src, model, opt)
    _peers.sync(device)
    out = {"load_s": time.perf_counter() - t0}
    out["path"] = checkpoint.save(root, model, opt, step=0)
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--load-tp", type=int, default=1, help="TP size of the load (same world)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--preset", default="1b", choices=sorted(_common.HF_LLAMA_PRESETS))
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args(argv)
    world = a.dp * a.tp
    if world % a.load_tp:
        p.error(f"--load-tp {a.load_tp} does not divide the world of {world} ranks")
    args = {k: getattr(a, k) for k in ("device", "preset", "micro_batch", "warmup", "iters",
                                       "tp", "load_tp")}
    base = Path(tempfile.mkdtemp(prefix="tp-iter-",
                                 dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    from shardopt import checkpoint

    trained = _peers.spawn(_train, world, args, str(base / "trained"), device=a.device,
                           timeout_s=a.timeout)
    loaded = _peers.spawn(_load, world, args, trained[0]["path"], str(base / "loaded"),
                          device=a.device, timeout_s=a.timeout)
    exports = []
    for name, ranks in (("trained", trained), ("loaded", loaded)):
        checkpoint.export(ranks[0]["path"], base / f"export_{name}")
        exports.append({k: v for f in sorted((base / f"export_{name}").glob("*.safetensors"))
                        for k, v in load_file(f).items()})
    identical = exports[0].keys() == exports[1].keys() and all(
        torch.equal(exports[0][k], exports[1][k]) for k in exports[0])
    result = {**_common.run_header(torch.device(a.device), vars(a)), "benchmark": "tp_iter",
              "world_size": world, "dp": a.dp, "tp": a.tp, "load_tp": a.load_tp,
              "iter_s": _stats([r["iter_s"] for r in trained]),
              "step_s": _stats([r["step_s"] for r in trained]),
              "save_s": _stats([r["save_s"] for r in trained]),
              "load_s": _stats([r["load_s"] for r in loaded]),
              "exports_identical": identical}
    if "peak_allocated" in trained[0]:
        result["peak_allocated_max"] = max(r["peak_allocated"] for r in trained)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    path = Path(a.out) / f"tp_iter_{a.device}_dp{a.dp}_tp{a.tp}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"(dp{a.dp}, tp{a.tp}): iteration {result['iter_s']['median']:.4f} s, step "
          f"{result['step_s']['median']:.4f} s; load at tp{a.load_tp}: exports identical: "
          f"{identical}")
    print(f"wrote {path}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
