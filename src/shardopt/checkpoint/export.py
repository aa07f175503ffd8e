"""Single-process tools over a committed checkpoint: export, inspect, verify.

None of these needs a GPU or a process group, and all read through :mod:`.read`.
Export assembles full tensors from their chunks one output file at a time, so
host memory stays near ``max_file_bytes``, and writes plain safetensors (split
Hugging Face style past ``max_file_bytes``).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..layout import Range
from ..optimizer import STATE_NAMES
from . import commit
from .agree import CheckpointError
from .format import MANIFEST, FormatError, dtype_name
from .manifest import Manifest, MomentEncoding, parse
from .read import DataFiles, read_verified
from .transfer import io_threads

EXPORT_MOMENTS = ("float32", "stored")


def _open(path: str | os.PathLike) -> Manifest:
    return parse(commit.resolve(path))


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """Check the manifest as ``load`` does, every file's header and every content hash;
    raise :class:`FormatError` naming the file."""
    m = _open(path)
    files = DataFiles(m, m.files)
    try:
        read_verified([], verify=True, threads=io_threads(), whole=files.readers.values())
        _check_every_scale(files)
    finally:
        files.close()
    unknown = m.unknown_files()
    if unknown:
        raise FormatError(f"{m.path}: files not listed in the manifest: {', '.join(unknown)}")
    return {"path": str(m.path), "step": m.step, "files": len(m.files), "bytes": m.nbytes}


# Scales verify reads at a time.
SCALE_BATCH_BYTES = 64 << 20


def _check_every_scale(files: DataFiles) -> None:
    """The value check ``load`` and ``export`` make of the 8-bit moment scales they read,
    on every scale (hashes already checked), a batch of keys at a time."""
    keys = sorted(files.scale_keys)
    while keys:
        batch: list[tuple[str, torch.Tensor]] = []
        while keys and sum(t.numel() * 4 for _, t in batch) < SCALE_BATCH_BYTES:
            key = keys.pop()
            batch.append((key, torch.empty(files.stored[key][0], dtype=torch.float32)))
        read_verified([r for key, t in batch
                       for r in files.reads(key, Range(0, t.numel()), t, in_place=False)],
                      verify=False, threads=io_threads())
        for key, t in batch:
            files.check_scales(key, 0, t)


def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """Summary of a checkpoint from its manifest (no data is read)."""
    m = _open(path)
    stored = m.stored()

    def state_bytes(fqn: str) -> int:
        keys = [f"{fqn}.{n}{scale}" for n in STATE_NAMES for scale in ("", ".scale")]
        return sum(stored[k][0] * stored[k][1].itemsize for k in keys if k in stored)

    rows = [{"fqn": fqn, "shape": list(p.shape), "dtype": dtype_name(p.dtype),
             "trainable": p.trainable, "numel": p.numel,
             "weight_bytes": p.numel * p.dtype.itemsize,
             "state_bytes": state_bytes(fqn) if p.trainable else 0}
            for fqn, p in m.params.items()]
    return {
        "path": str(m.path),
        "format_version": m.version,
        "step": m.step,
        "dp_size": m.dp_size,
        "created": m.created,
        "num_params": len(rows),
        "numel": sum(r["numel"] for r in rows),
        "numel_trainable": sum(r["numel"] for r in rows if r["trainable"]),
        "bytes_on_disk": m.nbytes,
        "num_files": len(m.files),
        "config": dict(m.config),
        "moments": {name: enc.to_json() for name, enc in m.moments.items()},
        "extra": dict(m.extra),
        "params": rows,
    }


# Past this a file is split, Hugging Face style (as `save_pretrained`'s default shard size).
MAX_FILE_BYTES = 5 << 30


def export(path: str | os.PathLike, out_dir: str | os.PathLike,
           max_file_bytes: int = MAX_FILE_BYTES, verify: bool = True,
           moments_dtype: str = "float32") -> list[str]:
    """Write ``model*.safetensors`` and ``optimizer*.safetensors`` with full-shape tensors.

    Adam moments are written in fp32 (``moments_dtype="float32"``, decoded from bf16 or
    int8 storage exactly as the optimizer reads them), or as stored
    (``moments_dtype="stored"``): bf16, or 8-bit codes with their fp32 scales as
    ``"{fqn}.exp_avg.scale"`` (1-D, one per block of the flattened param).

    Returns the written file paths. Tensors are read and written one file's
    worth at a time, so memory stays near ``max_file_bytes``. ``out_dir`` must not
    exist or be empty, and must not hold a checkpoint or lie inside this one. The
    files are written into a temporary sibling renamed to ``out_dir`` at the end, so
    a failed export leaves no partial output.
    """
    if moments_dtype not in EXPORT_MOMENTS:
        raise ValueError(f"moments_dtype must be one of {list(EXPORT_MOMENTS)}, "
                         f"got {moments_dtype!r}")
    m = _open(path)
    out = Path(out_dir)
    _check_output_dir(m.path, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    files = None
    try:
        files = DataFiles(m, m.files)  # every header is checked, the RNG files' too
        if verify:  # the data files' blocks are checked as they are read
            read_verified([], verify=True, threads=io_threads(),
                          whole=[f for f in files.readers.values() if f.record.kind == "rng"])
        model_keys = [(fqn, p.shape) for fqn, p in m.params.items()]
        optim_keys = []
        for fqn, p in m.params.items():
            for n in ("exp_avg", "exp_avg_sq", "master_param") if p.trainable else ():
                enc = m.moments.get(n)
                optim_keys.append((f"{fqn}.{n}", p.shape))
                if enc is not None and enc.block and moments_dtype == "stored":
                    optim_keys.append((f"{fqn}.{n}.scale", (files.stored[f"{fqn}.{n}.scale"][0],)))
        decode = {} if moments_dtype == "stored" else dict(m.moments)
        names = _write_split(files, tmp, "model", model_keys, verify, max_file_bytes, {})
        names += _write_split(files, tmp, "optimizer", optim_keys, verify, max_file_bytes,
                              decode)
        os.rename(tmp, out)  # replaces an empty directory; fails on anything else
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if files is not None:
            files.close()
    return [str(out / n) for n in names]


def _check_output_dir(ckpt: Path, out: Path) -> None:
    """Refuse an export target that would write into a checkpoint or over other files."""
    where, target = ckpt.resolve(), out.resolve()
    if target == where or where in target.parents:
        raise CheckpointError(f"refusing to export {ckpt} into {out}: it is inside the "
                              "checkpoint, whose files verify would then reject")
    if not os.path.lexists(out):
        return
    if not out.is_dir() or out.is_symlink():
        raise CheckpointError(f"refusing to export into {out}: it exists and is not a directory")
    if (out / MANIFEST).exists() or commit.complete_steps(out) or target in where.parents:
        raise CheckpointError(f"refusing to export into {out}: it holds a checkpoint")
    if any(out.iterdir()):
        raise CheckpointError(f"refusing to export into {out}: the directory is not empty")


def _write_split(files: DataFiles, out: Path, stem: str, keys: list[tuple[str, tuple]],
                 verify: bool, max_file_bytes: int,
                 decode: dict[str, MomentEncoding]) -> list[str]:
    """Write ``keys`` as ``stem`` files under ``out`` (split past ``max_file_bytes``), each
    file's tensors read in one call; return the file names. Moments named in ``decode``
    (by moment name) are written in fp32."""
    def wide(key: str) -> MomentEncoding | None:
        enc = decode.get(key.rsplit(".", 1)[-1])
        return enc if enc is not None and enc.dtype != torch.float32 else None

    groups: list[list[tuple[str, tuple]]] = [[]]
    size = 0
    for key, shape in keys:
        numel, dtype = files.stored[key]
        dtype = torch.float32 if wide(key) else dtype
        if groups[-1] and size + numel * dtype.itemsize > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append((key, shape))
        size += numel * dtype.itemsize
    names = ([f"{stem}.safetensors"] if len(groups) == 1 else
             [f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map, total = {}, 0
    for name, group in zip(names, groups):
        tensors, reads, scales = {}, [], {}
        for key, shape in group:
            numel, dtype = files.stored[key]
            tensors[key] = torch.empty(numel, dtype=dtype)
            reads += files.reads(key, Range(0, numel), tensors[key], in_place=False)
            enc = wide(key)
            if enc is not None and enc.block:
                scale = f"{key}.scale"
                scales[key] = torch.empty(files.stored[scale][0], dtype=torch.float32)
                reads += files.reads(scale, Range(0, scales[key].numel()), scales[key],
                                     in_place=False)
            weight_map[key] = name
        read_verified(reads, verify=verify, threads=io_threads())
        for key, shape in group:
            enc = wide(key)
            if enc is not None:
                tensors[key] = enc.decode(tensors[key], scales.pop(key, None), 0)
            tensors[key] = tensors[key].view(shape)
            total += tensors[key].numel() * tensors[key].element_size()
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        del tensors, reads
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names


__all__ = ["export", "inspect", "verify"]
