"""Single-process tools over a committed checkpoint: export, inspect, verify.

None of these needs a GPU or a process group. Export assembles each full
tensor from its chunks one tensor at a time, so host memory stays near the
largest single tensor, and writes plain safetensors (split Hugging Face style
past ``max_file_bytes``).
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
from . import commit, state
from .format import MANIFEST, TORCH_DTYPE_NAMES, FormatError, StoredChunk
from .io import CheckpointError, resolve
from .manifest import read_manifest, unknown_files, validate_manifest
from .planner import ChunkIndex
from .storage import FileReader
from .transfer import io_threads, read_segments


def _open(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    p = resolve(path)
    m = read_manifest(p)
    validate_manifest(m, p)
    return p, m


def _dtypes(m: dict[str, Any]) -> dict[str, torch.dtype]:
    out = {}
    for fqn, info in m["params"].items():
        out[fqn] = TORCH_DTYPE_NAMES[info["dtype"]]
        if info["trainable"]:
            out.update({f"{fqn}.{n}": torch.float32 for n in STATE_NAMES})
    return out


class _Store:
    """All data files of one checkpoint, with headers cross-checked against the manifest."""

    def __init__(self, path: Path, m: dict[str, Any], verify: bool) -> None:
        self.readers: dict[str, FileReader] = {}
        chunks: list[StoredChunk] = []
        try:
            for name, rec in m["files"].items():
                reader = self.readers[name] = FileReader(str(path / name), name, rec)
                if verify:
                    reader.verify()
                if name.startswith("rng-"):
                    reader.header()  # well-formed, though export does not need it
                else:
                    chunks.extend(reader.chunks(_dtypes(m)))
            self.index = ChunkIndex(chunks, state.stored_numels(m["params"]))
        except BaseException:
            self.close()
            raise

    def read(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        read_segments([self.readers[req.file].segment(req, out, dtype)
                       for req in self.index.plan(key, Range(0, numel))], None, io_threads())
        return out

    def close(self) -> None:
        for r in self.readers.values():
            r.close()


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """Check completeness and every content hash; raise :class:`FormatError` naming the file."""
    p, m = _open(path)
    store = _Store(p, m, verify=True)
    store.close()
    unknown = unknown_files(p, m)
    if unknown:
        raise FormatError(f"{p}: files not listed in the manifest: {', '.join(unknown)}")
    return {"path": str(p), "step": m["step"], "files": len(m["files"]),
            "bytes": sum(r["size"] for r in m["files"].values())}


def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """Summary of a checkpoint from its manifest (no data is read)."""
    p, m = _open(path)
    rows = []
    for fqn, info in m["params"].items():
        numel = 1
        for s in info["shape"]:
            numel *= s
        state_bytes = 12 * numel if info["trainable"] else 0
        rows.append({"fqn": fqn, "shape": info["shape"], "dtype": info["dtype"],
                     "trainable": info["trainable"], "numel": numel,
                     "weight_bytes": numel * TORCH_DTYPE_NAMES[info["dtype"]].itemsize,
                     "state_bytes": state_bytes})
    return {
        "path": str(p),
        "format_version": m["version"],
        "step": m["step"],
        "dp_size": m["dp_size"],
        "created": m.get("created"),
        "num_params": len(rows),
        "numel": sum(r["numel"] for r in rows),
        "numel_trainable": sum(r["numel"] for r in rows if r["trainable"]),
        "bytes_on_disk": sum(r["size"] for r in m["files"].values()),
        "num_files": len(m["files"]),
        "config": m.get("config", {}),
        "extra": m.get("extra", {}),
        "params": rows,
    }


def export(path: str | os.PathLike, out_dir: str | os.PathLike,
           max_file_bytes: int = 5 << 30, verify: bool = True) -> list[str]:
    """Write ``model*.safetensors`` and ``optimizer*.safetensors`` with full-shape tensors.

    Returns the written file paths. Tensors are read and written one file's
    worth at a time, so memory stays near ``max_file_bytes``. ``out_dir`` must not
    exist or be empty, and must not hold a checkpoint or lie inside this one. The
    files are written into a temporary sibling renamed to ``out_dir`` at the end, so
    a failed export leaves no partial output.
    """
    p, m = _open(path)
    out = Path(out_dir)
    _check_output_dir(p, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    store = None
    try:
        store = _Store(p, m, verify=verify)
        dtypes = _dtypes(m)
        model_keys = [(fqn, fqn, info["shape"]) for fqn, info in m["params"].items()]
        optim_keys = [(f"{fqn}.{n}", f"{fqn}.{n}", info["shape"])
                      for fqn, info in m["params"].items() if info["trainable"]
                      for n in ("exp_avg", "exp_avg_sq", "master_param")]
        names = _write_split(store, tmp, "model", model_keys, dtypes, max_file_bytes)
        names += _write_split(store, tmp, "optimizer", optim_keys, dtypes, max_file_bytes)
        os.rename(tmp, out)  # replaces an empty directory; fails on anything else
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if store is not None:
            store.close()
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


def _write_split(store: _Store, out: Path, stem: str, keys: list[tuple[str, str, list[int]]],
                 dtypes: dict[str, torch.dtype], max_file_bytes: int) -> list[str]:
    """Write ``keys`` as ``stem`` files under ``out`` (split past ``max_file_bytes``);
    return the file names."""
    groups: list[list[tuple[str, str, list[int]]]] = [[]]
    size = 0
    for item in keys:
        numel = 1
        for s in item[2]:
            numel *= s
        nbytes = numel * dtypes[item[1]].itemsize
        if groups[-1] and size + nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    names = ([f"{stem}.safetensors"] if len(groups) == 1 else
             [f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map, total = {}, 0
    for name, group in zip(names, groups):
        tensors = {}
        for out_key, key, shape in group:
            numel = 1
            for s in shape:
                numel *= s
            tensors[out_key] = store.read(key, numel, dtypes[key]).view(shape)
            weight_map[out_key] = name
            total += tensors[out_key].numel() * tensors[out_key].element_size()
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        del tensors
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names


__all__ = ["export", "inspect", "verify", "CheckpointError", "MANIFEST"]
