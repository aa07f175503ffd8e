"""Functions that run inside spawned processes of the fault-injection suite.

Each is module level (so it pickles) and takes ``(rank, world_size, ...)`` as
``helpers.dist.run_distributed`` calls it, or is a process target that the
suite kills with SIGKILL.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import importlib
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch
import torch.distributed as dist

from shardopt import checkpoint
from shardopt.checkpoint import commit
from shardopt.checkpoint import read as ckpt_read

from .common import (data_offset, differences, flip_byte, listing, rehash_file, snapshot,
                     train_step, trained)

# The module, not the function the package exports under the same name.
ckpt_save = importlib.import_module("shardopt.checkpoint.save")


class Boom(Exception):
    """A failure that is neither an OSError nor a ValueError (a bug in user code, say)."""


# ----------------------------------------------------------------- fault patches
@contextlib.contextmanager
def failing_writes(match: str, err: int):
    """``os.write`` and ``os.pwritev`` to files whose path contains ``match`` fail with ``err``."""
    real_open, real_write, real_pwritev = os.open, os.write, os.pwritev
    paths: dict[int, str] = {}

    def fake_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        paths[fd] = os.fspath(path)
        return fd

    def fake_write(fd, data):
        if match in paths.get(fd, ""):
            raise OSError(err, os.strerror(err))
        return real_write(fd, data)

    def fake_pwritev(fd, buffers, offset, *args):
        if match in paths.get(fd, ""):
            raise OSError(err, os.strerror(err))
        return real_pwritev(fd, buffers, offset, *args)

    with (mock.patch.object(os, "open", fake_open), mock.patch.object(os, "write", fake_write),
          mock.patch.object(os, "pwritev", fake_pwritev)):
        yield


@contextlib.contextmanager
def failing_call(module: Any, name: str, when: Callable[..., bool], exc: BaseException):
    """``module.name(*args)`` raises ``exc`` when ``when(*args)`` is true."""
    real = getattr(module, name)

    def fake(*args, **kwargs):
        if when(*args):
            raise exc
        return real(*args, **kwargs)

    with mock.patch.object(module, name, fake):
        yield


@contextlib.contextmanager
def failing_in_place_reads(exc: BaseException):
    """Every read of the bytes of in-place reads (those made once every check has passed)
    raises ``exc``, in the reader threads."""
    real = ckpt_read.read_plain

    def fake(reads, *args, **kwargs):
        if not any(r.in_place for r in reads):
            return real(reads, *args, **kwargs)
        with failing_call(ckpt_read, "preadv_exact", lambda *a: True, exc):
            return real(reads, *args, **kwargs)

    with mock.patch.object(ckpt_read, "read_plain", fake):
        yield


@contextlib.contextmanager
def failing_nth_write_file(n: int):
    real = ckpt_save.write_file
    calls = [0]

    def fake(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise Boom("simulated crash in the middle of writing this rank's files")
        return real(*args, **kwargs)

    with mock.patch.object(ckpt_save, "write_file", fake):
        yield


def _eacces(path: str) -> OSError:
    return PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)


# (name, faulty rank, patch factory or None, save kwargs for the faulty rank)
SAVE_FAULTS: list[tuple[str, int, Callable[[], Any] | None, dict[str, Any]]] = [
    ("disk full writing a data file", 1,
     lambda: failing_writes("optim-00001", errno.ENOSPC), {}),
    ("disk full writing the manifest", 0,
     lambda: failing_writes("manifest.json", errno.ENOSPC), {}),
    ("permission denied creating the temporary directory", 0,
     lambda: failing_call(os, "mkdir", lambda p, *a: ".tmp-" in str(p),
                          _eacces("root")), {}),
    ("permission denied creating a data file", 1,
     lambda: failing_call(os, "open", lambda p, *a: "model-00001" in str(p),
                          _eacces("model-00001.safetensors")), {}),
    ("fsync fails (EIO)", 1,
     lambda: failing_call(os, "fsync", lambda *a: True, OSError(errno.EIO, "I/O error")), {}),
    ("a rank raises while writing its files", 1, lambda: failing_nth_write_file(2), {}),
    ("a rank raises before the first collective", 1, None, {"extra": {"bad": object()}}),
    ("ranks disagree on the step", 1, None, {"step_offset": 1}),
    ("ranks disagree on blocking", 1, None, {"blocking": False}),
    ("the commit rename fails", 0,
     lambda: failing_call(os, "rename", lambda src, *a: ".tmp-" in str(src),
                          OSError(errno.EXDEV, "Invalid cross-device link")), {}),
    ("the latest marker cannot be updated", 0,
     lambda: failing_call(os, "replace", lambda s, d, *a: str(d).endswith("latest"),
                          OSError(errno.ENOSPC, "No space left on device")), {}),
]


def save_faults(rank: int, world_size: int, root: str) -> list[dict[str, Any]]:
    """Run every entry of SAVE_FAULTS in turn; report what each rank saw and, from rank 0,
    the root's listing and ``latest()`` after each."""
    root_p = Path(root)
    model, opt = trained(1)
    checkpoint.save(root, model, opt, step=1)
    out = []
    for i, (name, bad_rank, patch, kwargs) in enumerate(SAVE_FAULTS):
        step = 10 + i
        kwargs = dict(kwargs) if rank == bad_rank else {}
        step += kwargs.pop("step_offset", 0)
        before = checkpoint.latest(root)
        t0 = time.monotonic()
        error = None
        with patch() if (patch is not None and rank == bad_rank) else contextlib.nullcontext():
            try:
                checkpoint.save(root, model, opt, step=step, **kwargs)
            except checkpoint.CheckpointError as e:
                error = str(e)
        dist.barrier()
        out.append({"name": name, "error": error, "seconds": time.monotonic() - t0,
                    "latest_before": before, "latest_after": checkpoint.latest(root),
                    "listing": listing(root_p), "step": step})
        dist.barrier()
    checkpoint.save(root, model, opt, step=99)
    out.append({"name": "clean save afterwards", "latest_after": checkpoint.latest(root),
                "listing": listing(root_p)})
    return out


# ------------------------------------------------------------------ failed loads
def _damage(rank: int, good: Path, root: Path) -> dict[str, Path]:
    """Rank 0 makes damaged copies of ``good``; most damage is seen by DP rank 1 only."""
    bad = {k: root / k for k in ("flip_rank1_data", "rng_rank1_missing", "rng_rank1_invalid",
                                 "truncated_model0", "manifest_flipped")}
    if rank == 0:
        for p in bad.values():
            shutil.copytree(good, p)
        opt1 = bad["flip_rank1_data"] / "optim-00001.safetensors"
        flip_byte(opt1, os.path.getsize(opt1) - 3)
        os.unlink(bad["rng_rank1_missing"] / "rng-00001.safetensors")
        rng1 = bad["rng_rank1_invalid"] / "rng-00001.safetensors"
        with open(rng1, "r+b") as f:  # garbage RNG state, hashes made consistent
            f.seek(data_offset(rng1, "torch_cpu"))
            f.write(b"\xff" * 64)
        rehash_file(bad["rng_rank1_invalid"], "rng-00001.safetensors")
        model0 = bad["truncated_model0"] / "model-00000.safetensors"
        os.truncate(model0, os.path.getsize(model0) - 1)
        text = (bad["manifest_flipped"] / "manifest.json").read_text()
        pos = text.index('"step": ') + len('"step": ')
        (bad["manifest_flipped"] / "manifest.json").write_text(
            text[:pos] + str(int(text[pos]) ^ 1) + text[pos + 1:])
    return bad


def failed_loads(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Failed loads leave model, optimizer and RNG bit-identical and training unaffected."""
    root_p = Path(root)
    src_model, src_opt = trained(1)
    good = Path(checkpoint.save(root_p / "good", src_model, src_opt, step=1))
    wide_model, wide_opt = trained(1, width=20)
    wide = Path(checkpoint.save(root_p / "wide", wide_model, wide_opt, step=1))
    bad = _damage(rank, good, root_p)
    bad["shape_mismatch"] = wide
    dist.barrier()

    model, opt = trained(2)
    twin_model, twin_opt = trained(2)
    before = snapshot(model, opt)
    errors, changed = {}, {}
    for kind, path in bad.items():
        try:
            checkpoint.load(path, model, opt)
            errors[kind] = None
        except checkpoint.CheckpointError as e:
            errors[kind] = str(e)
        changed[kind] = differences(before, snapshot(model, opt))
    train_step(model, opt, 3)
    train_step(twin_model, twin_opt, 3)
    after = differences(snapshot(model, opt, rng=False), snapshot(twin_model, twin_opt, rng=False))

    # An I/O error after every check passed (the medium fails mid-read, in a reader
    # thread): every rank raises.
    read_error = None
    with (failing_in_place_reads(OSError(errno.EIO, "I/O error"))
          if rank == 1 else contextlib.nullcontext()):
        try:
            checkpoint.load(good, model, opt)
        except checkpoint.CheckpointError as e:
            read_error = str(e)
    return {"errors": errors, "changed": changed, "diverged_from_twin": after,
            "read_error": read_error}


# --------------------------------------------------------------- kill -9 targets
SAVER_RAISED = 3  # exit code of a saver whose save raised (e.g. its peer was killed)


def saver_loop(rank: int, world_size: int, root: str, store: str, first_step: int,
               log: str, width: int, blocking: bool = True) -> None:
    """Process target: save steps ``first_step, first_step+1, ...`` until killed. If a save
    (or the training step before it, which communicates too) raises, log the exception's
    type and exit with SAVER_RAISED. With ``blocking=False`` the next model is trained
    while the save is written in the background, then the save is waited for."""
    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=60))
    step = first_step
    with open(log, "a", buffering=1) as f:
        while True:
            try:
                model, opt = trained(step, width=width)
                f.write(f"{rank} begin {step}\n")
                saved = checkpoint.save(root, model, opt, step=step, keep_last=2,
                                        extra={"step": step}, blocking=blocking,
                                        config=checkpoint.CheckpointConfig(block_bytes=64 << 10))
                if not blocking:
                    train_step(model, opt, step + 1)  # changes what is being written
                    saved.wait()
            except Exception as e:  # noqa: BLE001 - reported through the log and exit code
                f.write(f"{rank} raised {type(e).__name__}\n")
                os._exit(SAVER_RAISED)
            f.write(f"{rank} end {step}\n")
            step += 1


# The calls that change what is on disk or who holds a lock. os.write is left out: a kill
# between two writes of one file leaves the same state as a kill before its fsync.
FS_CALLS = [(os, "open"), (os, "fsync"), (os, "rename"), (os, "replace"), (os, "mkdir"),
            (os, "unlink"), (os, "rmdir"), (commit.fcntl, "flock")]


def count_fs_calls(fn: Callable[[], Any], kill_at: int | None = None) -> int:
    """Run ``fn`` counting file-system calls; SIGKILL this process just before call
    number ``kill_at``. Returns the count."""
    count = [0]
    patches = []
    for module, name in FS_CALLS:
        real = getattr(module, name)

        def wrapped(*args, _real=real, **kwargs):
            count[0] += 1
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(*args, **kwargs)

        patches.append(mock.patch.object(module, name, wrapped))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        fn()
    return count[0]


def crash_at(root: str, step: int, kill_at: int, blocking: bool = True,
             rollback: bool = False) -> None:
    """Process target: save ``step`` (one process, no process group), dying at a given call
    (with ``blocking=False``: of the save's background thread too, training meanwhile)."""
    model, opt = trained(step)

    def save() -> None:
        saved = checkpoint.save(root, model, opt, step=step, keep_last=2, blocking=blocking,
                                config=checkpoint.CheckpointConfig(block_bytes=4096,
                                                                   rollback=rollback))
        if not blocking:
            train_step(model, opt, step + 1)
            saved.wait()

    count_fs_calls(save, kill_at)


# ------------------------------------------------------------------ concurrent jobs
def concurrent_job(rank: int, world_size: int, root: str, num_saves: int) -> dict[str, Any]:
    """Two independent single-process jobs (no process group) saving into one root, each
    rolling back the other's later steps (``rollback=True``: the point is the locking)."""
    committed, refused = [], []
    for i in range(num_saves):
        step = 2 * i + rank
        model, opt = trained(step)
        checkpoint.save(root, model, opt, step=step, keep_last=4,
                        config=checkpoint.CheckpointConfig(rollback=True))
        committed.append(step)
    model, opt = trained(1000)  # both jobs try the same step
    try:
        checkpoint.save(root, model, opt, step=1000,
                        config=checkpoint.CheckpointConfig(rollback=True))
        committed.append(1000)
    except checkpoint.CheckpointError as e:
        refused.append(str(e))
    return {"committed": committed, "refused": refused}
