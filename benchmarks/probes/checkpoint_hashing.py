"""Cost of content hashing in checkpoint save and load (one process, CPU).

Saves a ~400 MB state (25M fp32 params: weights + main params + two Adam
moments = 16 bytes per param) with block hashing on and off, and loads it with
``verify=True`` and ``verify=False``, warm (files in the page cache, as right
after a save) and cold (pages dropped with ``posix_fadvise(DONTNEED)``).
Reports the median and minimum of ``--repeats`` runs, interleaved so that
background load hits every variant alike.

    python benchmarks/probes/checkpoint_hashing.py --repeats 5 --out /tmp/ckpt-hash
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
import xxhash
from torch import nn

from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint
from shardopt.checkpoint import transfer as ckpt_transfer


def build(num_layers: int, width: int) -> tuple[nn.Module, DistributedOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(num_layers)])
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-3))
    sum((p * p).sum() for p in model.parameters()).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


class _NoHash:
    """Stands in for an xxh3-64 hasher: takes the bytes, hashes nothing."""

    def update(self, data) -> None:
        pass

    def hexdigest(self) -> str:
        return ""


def no_hashing():
    """Patch the save's block hashing out (the manifest's hashes become empty)."""
    return mock.patch.object(ckpt_transfer, "xxhash", mock.Mock(xxh3_64=_NoHash))


def drop_cache(path: Path) -> None:
    for f in path.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--width", type=int, default=2240)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="directory for checkpoints (default: a temp dir)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out or tempfile.mkdtemp(prefix="ckpt-hash-"))
    out.mkdir(parents=True, exist_ok=True)
    model, opt = build(args.layers, args.width)
    numel = sum(p.numel() for p in model.parameters())

    times: dict[str, list[float]] = {k: [] for k in (
        "save, hashing", "save, no hashing", "load warm, verify", "load warm, no verify",
        "load cold, verify", "load cold, no verify")}
    checkpoint.save(out / "warmup", model, opt, step=0)  # first-touch costs
    shutil.rmtree(out / "warmup")
    step, hashing_first = 0, True
    for _ in range(args.repeats):
        for hashing in (True, False) if hashing_first else (False, True):
            root = out / f"run-{step}"
            with contextlib.nullcontext() if hashing else no_hashing():
                times["save, hashing" if hashing else "save, no hashing"].append(
                    timed(lambda: checkpoint.save(root, model, opt, step=step)))
            if hashing:
                path = Path(checkpoint.latest(root))
                size = sum(f.stat().st_size for f in path.iterdir())
                for cold in (False, True):
                    for verify in (True, False):
                        if cold:
                            drop_cache(path)
                        key = f"load {'cold' if cold else 'warm'}, {'' if verify else 'no '}verify"
                        cfg = checkpoint.CheckpointConfig(verify=verify)
                        times[key].append(timed(lambda: checkpoint.load(path, model, opt,
                                                                        config=cfg)))
            shutil.rmtree(root)
            step += 1
        hashing_first = not hashing_first
    buf = torch.randint(0, 256, (size,), dtype=torch.uint8).numpy()  # touched pages
    hash_s = min(timed(lambda: [xxhash.xxh3_64_hexdigest(buf[i:i + (8 << 20)])
                                for i in range(0, size, 8 << 20)]) for _ in range(3))

    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    print(f"state: {numel / 1e6:.1f}M fp32 params, {size / 2**20:.0f} MiB on disk, "
          f"single process, {args.repeats} repeats, files under {out}")
    print(f"xxh3-64 alone over {size / 2**20:.0f} MiB in memory: {hash_s * 1e3:.0f} ms "
          f"({size / hash_s / 2**30:.1f} GiB/s)")
    print(f"{'':24} {'median s':>9} {'min s':>7} {'MiB/s (median)':>15}")
    for key, ts in times.items():
        med = statistics.median(ts)
        print(f"{key:24} {med:9.3f} {min(ts):7.3f} {size / med / 2**20:15.0f}")


if __name__ == "__main__":
    main()
