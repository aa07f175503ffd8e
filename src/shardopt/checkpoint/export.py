"""Single-process tools over a committed checkpoint: export, inspect, verify.

None needs a GPU or a process group; all read through :mod:`.read`. Export assembles full
tensors one output file at a time (host memory near ``max_file_bytes``) and writes plain
safetensors through the block writer, split Hugging Face style past ``max_file_bytes``.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..boxes import Box, flat_boxes
from ..layout import STATE_NAMES, Range
from ..muon import MOMENTUM
from . import commit
from .format import DEFAULT_BLOCK_BYTES, DTYPE_CODES, MANIFEST, dtype_name, pack_header
from .manifest import Manifest, MomentEncoding, parse
from .read import DataFiles, read_verified
from .storage import write_parts
from .transfer import Part, io_threads
from ..errors import CheckpointError, FormatError

EXPORT_MOMENTS = ("float32", "stored")
# Past this a file is split, Hugging Face style (as `save_pretrained`'s default shard size).
MAX_FILE_BYTES = 5 << 30


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
    keys, batch = sorted(files.scale_keys), []
    while keys:
        batch.append(keys.pop())
        if not keys or sum(files.stored[k].numel * 4 for k in batch) >= SCALE_BATCH_BYTES:
            _read_whole(files, batch, verify=False)
            batch = []


def _read_whole(files: DataFiles, keys: list[str], verify: bool) -> dict[str, torch.Tensor]:
    """Stored tensors ``keys``, whole (1-D, as stored), in one read; 8-bit moment scales
    value-checked."""
    out = {k: torch.empty(files.stored[k].numel, dtype=files.stored[k].dtype) for k in keys}
    read_verified([r for k, t in out.items()
                   for r in files.reads(k, Range(0, t.numel()), t, in_place=False)],
                  verify=verify, threads=io_threads())
    for k, t in out.items():
        if k in files.scale_keys:
            files.check_scales(k, 0, t)
    return out


def _saved_boxes(m: Manifest) -> dict[str, list[dict[str, Any]]]:
    """Where each param's weights lie: per stored box of its global tensor, the file, the
    box's global offsets and lengths (the saved layout)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for f in m.data_files():
        for c in f.chunks:
            p = m.params.get(c.key)
            if p is None:
                continue
            whole = Range(c.offset, c.offset + c.numel)
            for b in c.boxes or flat_boxes(Box.whole(p.shape), whole):
                out.setdefault(c.key, []).append(
                    {"file": f.name, "offsets": list(b.offsets), "lengths": list(b.lengths)})
    return out


def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """Summary of a checkpoint from its manifest (no data is read)."""
    m = _open(path)
    stored = m.stored()

    def state_bytes(fqn: str) -> int:
        keys = [f"{fqn}.{n}{scale}" for n in (*STATE_NAMES, MOMENTUM) for scale in ("", ".scale")]
        return sum(stored[k].numel * stored[k].dtype.itemsize for k in keys if k in stored)

    boxes = _saved_boxes(m)
    rows = [{"fqn": fqn, "shape": list(p.shape), "dtype": dtype_name(p.dtype),
             "trainable": p.trainable, "numel": p.numel,
             "weight_bytes": p.numel * p.dtype.itemsize,
             "state_bytes": state_bytes(fqn) if p.trainable else 0,
             "placements": list(p.placements), "boxes": boxes.get(fqn, [])}
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


def export(path: str | os.PathLike, out_dir: str | os.PathLike,
           max_file_bytes: int = MAX_FILE_BYTES, verify: bool = True,
           moments_dtype: str = "float32") -> list[str]:
    """Write ``model*.safetensors`` and ``optimizer*.safetensors`` with full-shape tensors;
    return their paths. Adam moments (and Muon's ``"{fqn}.momentum_buffer"``, fp32) in fp32
    (``moments_dtype="float32"``, decoded exactly as the optimizer reads them) or as stored (``"stored"``: bf16, or 8-bit codes with their fp32
    scales as ``"{fqn}.exp_avg.scale"``, one per block of the flattened param).

    ``out_dir`` must not exist or be empty, nor hold a checkpoint or lie inside this one; the
    files go into a temporary sibling renamed to ``out_dir`` at the end, so a failed export
    leaves no partial output.
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
        model_shapes = {fqn: p.shape for fqn, p in m.params.items()}
        optim_shapes = {}
        for fqn, p in m.params.items():
            for n in (*p.moment_names, "master_param") if p.trainable else ():
                enc = m.moments.get(n)
                optim_shapes[f"{fqn}.{n}"] = p.shape
                if enc is not None and enc.block and moments_dtype == "stored":
                    optim_shapes[f"{fqn}.{n}.scale"] = (files.stored[f"{fqn}.{n}.scale"].numel,)
        decode = {} if moments_dtype == "stored" else dict(m.moments)
        needed = sum(_out_bytes(files, k, decode) for k in [*model_shapes, *optim_shapes])
        names = _write_split(files, tmp, "model", model_shapes, verify, max_file_bytes, {})
        names += _write_split(files, tmp, "optimizer", optim_shapes, verify, max_file_bytes,
                              decode)
        os.rename(tmp, out)  # replaces an empty directory; fails on anything else
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, _WriteFailed):  # what is free is measured without the partial output
            raise _write_error(m.path, out, e, needed) from e.__cause__
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


class _WriteFailed(Exception):
    """Writing export file ``name`` failed (a full disk, a read-only file system, ...)."""

    def __init__(self, name: str, cause: OSError) -> None:
        super().__init__(name)
        self.name, self.reason = name, cause.strerror or str(cause)


def _writing(out: Path, name: str, write: Callable[[str], object]) -> None:
    try:
        write(str(out / name))
    except OSError as e:
        raise _WriteFailed(name, e) from e


def _write_error(ckpt: Path, out: Path, failed: _WriteFailed, needed: int) -> CheckpointError:
    try:
        free = f"{_mib(shutil.disk_usage(out.parent).free)} are free there"
    except OSError:
        free = "how much is free there cannot be read"
    return CheckpointError(
        f"exporting {ckpt} to {out} failed writing {failed.name}: {failed.reason}; the export "
        f"needs {_mib(needed)} of free space in {out.parent}, {free} (nothing was left behind)")


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB ({num_bytes} bytes)"


def save_file(tensors: dict[str, torch.Tensor], filename: str,
              metadata: dict[str, str] | None = None) -> None:
    """Write host ``tensors`` as a plain safetensors file through the block writer, laid out
    as the safetensors library does (widest dtypes first, then by name)."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    data = [tensors[k].contiguous().view(-1).view(torch.uint8) for k in order]
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    pos = 0
    for key, d in zip(order, data):
        header[key] = {"dtype": DTYPE_CODES[tensors[key].dtype],
                       "shape": list(tensors[key].shape), "data_offsets": [pos, pos + d.numel()]}
        pos += d.numel()
    raw = pack_header(header)
    parts = [Part(0, len(raw), torch.frombuffer(bytearray(raw), dtype=torch.uint8))]
    for d in data:
        parts.append(Part(parts[-1].end, d.numel(), d))
    write_parts(filename, parts, DEFAULT_BLOCK_BYTES, None)


def _decoded(decode: dict[str, MomentEncoding], key: str) -> MomentEncoding | None:
    """How moment ``key`` is stored, if the export writes it decoded to fp32."""
    enc = decode.get(key.rsplit(".", 1)[-1])
    return enc if enc is not None and enc.dtype != torch.float32 else None


def _out_bytes(files: DataFiles, key: str, decode: dict[str, MomentEncoding]) -> int:
    stored = files.stored[key]
    return stored.numel * (torch.float32 if _decoded(decode, key) else stored.dtype).itemsize


def _write_split(files: DataFiles, out: Path, stem: str, shapes: dict[str, tuple],
                 verify: bool, max_file_bytes: int,
                 decode: dict[str, MomentEncoding]) -> list[str]:
    """Write the tensors of ``shapes`` (key: full shape) as ``stem`` files under ``out``
    (split past ``max_file_bytes``); return their names. Moments named in ``decode`` are
    written in fp32."""
    groups: list[list[str]] = [[]]
    size = 0
    for key in shapes:
        nbytes = _out_bytes(files, key, decode)
        if groups[-1] and size + nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    names = ([f"{stem}.safetensors"] if len(groups) == 1 else
             [f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map, total = {}, 0
    for name, group in zip(names, groups):
        scales = [f"{k}.scale" for k in group if getattr(_decoded(decode, k), "block", 0)]
        tensors = _read_whole(files, group + scales, verify)
        for key in group:
            weight_map[key] = name
            enc = _decoded(decode, key)
            if enc is not None:
                tensors[key] = enc.decode(tensors[key], tensors.get(f"{key}.scale"), 0)
            tensors[key] = tensors[key].view(shapes[key])
            total += tensors[key].numel() * tensors[key].element_size()
        write = functools.partial(save_file, {key: tensors[key] for key in group},
                                  metadata={"format": "pt"})
        del tensors  # the scales read for decoding go before the file is written
        _writing(out, name, write)
        del write
    if len(names) > 1:
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                           indent=2)
        _writing(out, f"{stem}.safetensors.index.json", lambda file: Path(file).write_text(index))
    return names

