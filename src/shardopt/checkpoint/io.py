"""save / load / latest: atomic commits, manifest, resharding loads.

Save schedule (collective over the optimizer's DP group):

1. DP rank 0 picks a temporary directory ``root/.tmp-step_XXXXXXXX-<id>``; all
   ranks learn its name.
2. Every rank streams its own chunks into ``model-RRRRR``, ``optim-RRRRR`` and
   ``rng-RRRRR`` safetensors files there and fsyncs them (no gathering).
3. Ranks exchange their file records (sizes, block hashes, chunk lists) and
   whether they succeeded; on any failure every rank raises and the
   temporary directory is removed.
4. Rank 0 writes ``manifest.json``, fsyncs, renames the directory to
   ``step_XXXXXXXX``, then points ``latest`` at it, then applies retention.

Load (collective): every rank reads the manifest, validates it against the
model, plans the reads that cover its own shard, verifies the hashes of the
blocks it will read, and only when every rank found everything in order does
any rank write into model or optimizer tensors.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import comm
from ..optimizer import DistributedOptimizer
from . import state
from .format import (DATA_FILE, FORMAT_NAME, FORMAT_VERSION, LATEST, MANIFEST, STEP_DIR,
                     TORCH_DTYPE_NAMES, FormatError, StoredChunk, step_dir_name)
from .manifest import read_manifest, validate_manifest
from .planner import ChunkIndex
from .storage import FileReader, WriteEntry, make_staging, sync_staging, write_file


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file, FQN or rank."""


@dataclass(frozen=True)
class LoadInfo:
    """What :func:`load` restored."""

    step: int
    extra: dict[str, Any]
    path: str
    dp_size_saved: int


def _agree(dp: comm.DPGroup, error: str | None, what: str) -> None:
    """Collective. Raise the same :class:`CheckpointError` on every rank if any rank failed."""
    errors = comm.all_gather_objects(error, dp)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        detail = "; ".join(f"[dp rank {r}] {e}" for r, e in failed)
        raise CheckpointError(f"{what} failed: {detail}")


def _fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# --------------------------------------------------------------------------- latest
def _is_complete(path: Path) -> bool:
    return STEP_DIR.match(path.name) is not None and (path / MANIFEST).is_file()


def latest(root: str | os.PathLike) -> str | None:
    """Coordinator-free. Path of the newest committed checkpoint under ``root``, or None.

    Follows the ``latest`` marker when it names a complete checkpoint, otherwise
    the highest-numbered complete ``step_*`` directory. Temporary directories of
    unfinished saves are never returned.
    """
    root = Path(root)
    marker = root / LATEST
    if marker.is_file():
        name = marker.read_text().strip()
        if STEP_DIR.match(name) and _is_complete(root / name):
            return str(root / name)
    steps = sorted((p for p in root.glob("step_*") if _is_complete(p)),
                   key=lambda p: int(STEP_DIR.match(p.name).group(1)))
    return str(steps[-1]) if steps else None


# ----------------------------------------------------------------------------- save
def _rng_entries() -> list[WriteEntry]:
    out = [WriteEntry("torch_cpu", torch.uint8, torch.get_rng_state().numel(), 0,
                      torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        t = torch.cuda.get_rng_state()
        out.append(WriteEntry("torch_cuda", torch.uint8, t.numel(), 0, t))
    return out


def save(
    root: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: DistributedOptimizer,
    step: int,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    block_bytes: int = 8 << 20,
    staging_bytes: int = 64 << 20,
) -> str:
    """Collective. Save ``model`` and ``optimizer`` as ``root/step_{step:08d}``; return its path.

    ``extra`` must be JSON-serialisable (data position, scheduler state, ...).
    ``keep_last`` deletes older committed checkpoints beyond the newest ``k``.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step must be an int >= 0, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1 or None, got {keep_last!r}")
    try:
        extra_json = json.dumps(extra if extra is not None else {})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra must be JSON-serialisable: {e}") from None
    dp = optimizer.dp
    root = Path(root)
    final = root / step_dir_name(step)

    tmp_name, error = None, None
    if dp.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if final.exists():
                raise FileExistsError(f"checkpoint {final} already exists")
            tmp_name = f".tmp-{final.name}-{uuid.uuid4().hex[:12]}"
            (root / tmp_name).mkdir()
        except OSError as e:
            error = str(e)
    _agree(dp, error, f"saving {final}")
    tmp = root / str(comm.broadcast_object(tmp_name, dp))

    records, error = {}, None
    try:
        r = f"{dp.rank:05d}"
        for kind, entries in (("model", state.model_entries(model, optimizer)),
                              ("optim", state.optim_entries(optimizer)),
                              ("rng", _rng_entries())):
            name = f"{kind}-{r}.safetensors"
            rec = write_file(str(tmp / name), entries, block_bytes, staging_bytes)
            if kind != "rng":
                rec["chunks"] = _chunk_list(entries)
            records[name] = rec
    except (OSError, RuntimeError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    all_records = comm.all_gather_objects((records, error), dp)
    errors = [e for _, e in all_records]
    if any(errors) and dp.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _agree(dp, errors[dp.rank], f"saving {final}")

    error = None
    if dp.rank == 0:
        try:
            files: dict[str, Any] = {}
            for recs, _ in all_records:
                files.update(recs)
            manifest = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "step": step,
                "dp_size": dp.size,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "torch_version": torch.__version__,
                "config": optimizer.config.to_dict(),
                "params": state.describe(model, optimizer),
                "aliases": dict(optimizer.aliases),
                "files": files,
                "extra": json.loads(extra_json),
            }
            _write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
            os.rename(tmp, final)
            _fsync_dir(root)
            _write_text_atomic(root / LATEST, final.name + "\n")
            if keep_last is not None:
                _apply_retention(root, keep_last, final)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
            shutil.rmtree(tmp, ignore_errors=True)
    _agree(dp, error, f"committing {final}")
    return str(final)


def _chunk_list(entries: list[WriteEntry]) -> list[list[Any]]:
    return [[e.key, e.offset, e.numel] for e in entries]


def _apply_retention(root: Path, keep_last: int, newest: Path) -> None:
    steps = sorted((p for p in root.glob("step_*") if _is_complete(p)),
                   key=lambda p: int(STEP_DIR.match(p.name).group(1)))
    for old in steps[:-keep_last]:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- load
def resolve(root_or_path: str | os.PathLike) -> Path:
    """Coordinator-free. A checkpoint directory, given itself or a root holding some."""
    p = Path(root_or_path)
    if (p / MANIFEST).is_file():
        return p
    if not p.exists():
        raise CheckpointError(f"no checkpoint at {p}: the path does not exist")
    found = latest(p)
    if found is None:
        raise CheckpointError(f"no committed checkpoint in {p} (no {MANIFEST} found)")
    return Path(found)


def load(
    root_or_path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: DistributedOptimizer,
    low_memory_resume: bool | None = None,
    verify: bool = True,
    staging_bytes: int = 64 << 20,
) -> LoadInfo:
    """Collective. Restore ``model`` and ``optimizer`` from a checkpoint saved at any DP size.

    ``low_memory_resume`` (default: the optimizer config's) keeps the Adam moments
    in host memory until the first ``step()``. On any error every rank raises a
    :class:`CheckpointError` and model and optimizer are left as they were.
    """
    dp = optimizer.dp
    if low_memory_resume is None:
        low_memory_resume = optimizer.config.low_memory_resume
    plan, error = None, None
    try:
        path = resolve(root_or_path)
        manifest = read_manifest(path)
        validate_manifest(manifest, path)
        plan = _plan_load(path, manifest, model, optimizer, verify)
        steps = _group_steps(manifest, optimizer)
    except (ValueError, OSError) as e:
        error = str(e)
    _agree(dp, error, f"loading {root_or_path}")
    assert plan is not None
    readers, requests = plan

    cuda = optimizer.device.type == "cuda"
    host = bool(low_memory_resume)
    moments = _moment_tensors(optimizer, host)
    staging = make_staging(staging_bytes, cuda) if cuda or requests.casts else None
    error = None
    try:
        for dest, reqs in requests.items:
            t = dest.resolve(moments)
            for req, dtype in reqs:
                readers[req.file].read_into(req, t, dtype, staging)
        sync_staging(staging)
    except (OSError, ValueError) as e:
        error = str(e)
    finally:
        for r in readers.values():
            r.close()
    _agree(dp, error, f"reading {path}")

    optimizer._adopt_loaded_state(moments, host, steps)
    saved_dp = int(manifest["dp_size"])
    if saved_dp == dp.size:
        _restore_rng(path, manifest, dp.rank)
    return LoadInfo(int(manifest["step"]), dict(manifest.get("extra") or {}), str(path), saved_dp)


@dataclass
class _Requests:
    items: list[tuple[state.Destination, list[tuple[Any, torch.dtype]]]]
    casts: bool


def _plan_load(path: Path, manifest: dict, model: torch.nn.Module,
               opt: DistributedOptimizer, verify: bool) -> tuple[dict[str, FileReader], _Requests]:
    """Coordinator-free. Validate compatibility, open files, plan and verify this rank's reads."""
    params = manifest["params"]
    _check_compatible(params, model, opt)
    numels = state.stored_numels(params)
    dtypes = {k: torch.float32 for k in numels}
    for fqn, info in params.items():
        dtypes[fqn] = TORCH_DTYPE_NAMES[info["dtype"]]
    files = {n: rec for n, rec in manifest["files"].items() if not n.startswith("rng-")}
    readers: dict[str, FileReader] = {}
    try:
        # Headers are small: read every one to locate chunks, cross-checked with the manifest.
        stored: list[StoredChunk] = []
        for name, rec in files.items():
            reader = readers[name] = FileReader(str(path / name), name, rec)
            header = reader.header()
            found = sorted((c.key, c.offset, c.numel) for c in header.chunks)
            if found != sorted((k, int(o), int(n)) for k, o, n in rec["chunks"]):
                raise FormatError(f"{path / name}: header disagrees with the manifest's chunk list")
            for c in header.chunks:
                if c.key in dtypes and c.dtype != dtypes[c.key]:
                    raise FormatError(f"{path / name}: {c.key!r} is stored as {c.dtype}, "
                                      f"the manifest says {dtypes[c.key]}")
            stored.extend(StoredChunk(c.key, name, c.offset, c.numel, c.dtype, c.data_start)
                          for c in header.chunks)
        index = ChunkIndex(stored, numels)
        items = []
        spans: dict[str, list[tuple[int, int]]] = {}
        casts = False
        for d in state.destinations(model, opt):
            reqs = index.plan(d.key, d.want)
            dtype = dtypes[d.key]
            casts |= d.dtype != dtype
            items.append((d, [(r, dtype) for r in reqs]))
            for r in reqs:
                spans.setdefault(r.file, []).append(
                    (r.file_start, r.file_start + r.numel * dtype.itemsize))
        for name in list(readers):
            if name not in spans:
                readers.pop(name).close()
        if verify:
            for name, sp in spans.items():
                readers[name].verify(sp)
    except BaseException:
        for r in readers.values():
            r.close()
        raise
    return readers, _Requests(items, casts)


def _moment_tensors(opt: DistributedOptimizer, host: bool):
    """Where loaded moments go: existing device tensors, new device tensors, or pinned host."""
    def alloc(existing: list[torch.Tensor] | None) -> list[torch.Tensor]:
        if existing is not None and not host:
            return existing
        pin = host and opt.device.type == "cuda"
        return [opt._zeros_local(b.local_numel, torch.device("cpu") if host else None, pin=pin)
                for b in opt.layout.buffers]
    return alloc(opt._exp_avg), alloc(opt._exp_avg_sq)


def _group_steps(manifest: dict, opt: DistributedOptimizer) -> list[int]:
    steps: list[int | None] = [None] * len(opt.param_groups)
    for fqn, gi in opt.group_of.items():
        s = int(manifest["params"][fqn]["step"])
        if steps[gi] is None:
            steps[gi] = s
        elif steps[gi] != s:
            raise CheckpointError(f"param {fqn!r} was saved at optimizer step {s} but others in "
                                  f"its param group at step {steps[gi]}")
    return [s or 0 for s in steps]


def _check_compatible(params: dict, model: torch.nn.Module, opt: DistributedOptimizer) -> None:
    frozen = state.frozen_tensors(model, opt)
    current = {fqn: (list(s.shape), True) for fqn, s in opt.layout.slots.items()}
    current.update({fqn: (list(t.shape), False) for fqn, t in frozen.items()})
    for fqn, (shape, trainable) in current.items():
        if fqn not in params:
            raise CheckpointError(f"param {fqn!r} of the model is missing from the checkpoint")
        saved = params[fqn]
        if [int(s) for s in saved["shape"]] != shape:
            raise CheckpointError(f"param {fqn!r}: checkpoint shape {saved['shape']} != "
                                  f"model shape {shape}")
        if trainable and not saved["trainable"]:
            raise CheckpointError(f"param {fqn!r} is trainable but the checkpoint holds no "
                                  "optimizer state for it (it was frozen when saved)")
    for fqn in params:
        if fqn not in current and fqn not in opt.aliases:
            raise CheckpointError(f"checkpoint param {fqn!r} does not exist in the model")


def _restore_rng(path: Path, manifest: dict, rank: int) -> None:
    from safetensors.torch import load_file

    name = f"rng-{rank:05d}.safetensors"
    if name not in manifest["files"] or not DATA_FILE.match(name):
        return
    reader = FileReader(str(path / name), name, manifest["files"][name])
    try:
        reader.verify()
    finally:
        reader.close()
    states = load_file(str(path / name))
    torch.set_rng_state(states["torch_cpu"])
    if "torch_cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["torch_cuda"])
