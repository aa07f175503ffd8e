"""``manifest.json``: parsed once, validated, into frozen records nothing else re-checks.

A manifest may be damaged or hostile: it is size-limited, read without following symlinks,
parsed as plain JSON and checked against its own checksum; :func:`parse` then checks every
field ``load``, ``verify``, ``export`` and ``inspect`` use. Data file names are fixed
patterns (``model-00000.safetensors``), so none can leave the directory.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch

from .. import muon, quant
from ..config import GROUP_KEYS, INT8, group_value
from ..layout import STATE_NAMES, Range
from ..moments import NAMES as MOMENT_NAMES
from .format import (READ_VERSIONS, FORMAT_NAME, MANIFEST, MAX_MANIFEST_BYTES, OPTIMIZER_KIND,
                     TORCH_DTYPE_NAMES, FileRecord, StoredTensor, dtype_name, manifest_checksum,
                     parse_json_object)
from .manifest_files import check_file_set, check_tiling, checked_int, file_record, shown
from .storage import open_regular
from ..errors import FormatError

@dataclass(frozen=True)
class ParamRecord:
    """A stored model tensor: a trainable param (with optimizer state) or a frozen tensor."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool
    step: int  # optimizer steps taken (0 for frozen tensors)
    hyper: Mapping[str, Any]  # lr, betas (a tuple), eps, weight_decay (& Muon's); empty when frozen
    optimizer: str = muon.ADAMW  # which optimizer's state it has: "adamw" or "muon"
    placements: tuple[str, ...] = ()  # of the DTensor it was saved from; () for a plain one

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def moment_names(self) -> tuple[str, ...]:
        """The moments stored for it: Adam's, or Muon's momentum buffer."""
        return (muon.MOMENTUM,) if self.optimizer == muon.MUON else MOMENT_NAMES


@dataclass(frozen=True)
class MomentEncoding:
    """How an Adam moment is stored (manifest ``optimizer.moments``): ``dtype`` elements,
    and for 8-bit codes one fp32 scale per ``block`` elements (key ``"{fqn}.{name}.scale"``)
    with the block's absolute maximum stored as ``code_max``; ``sqrt``: the codes encode
    the moment's square root (:mod:`shardopt.quant`)."""

    dtype: torch.dtype
    block: int = 0  # 0: no scales
    sqrt: bool = False
    code_max: int = 0

    @classmethod
    def of(cls, kind: torch.dtype | str, name: str) -> MomentEncoding:
        """The encoding of moment ``name`` stored as ``kind`` (``exp_avg_dtype`` & co.)."""
        if kind != INT8:
            return cls(kind)  # type: ignore[arg-type]
        sqrt = name == MOMENT_NAMES[1]
        return cls(quant.storage_dtype(INT8, sqrt), quant.QBLOCK, sqrt, int(quant.code_max(sqrt)))

    def decode(self, values: torch.Tensor, scales: torch.Tensor | None,
               start: int) -> torch.Tensor:
        """fp32 values of a stored piece from element ``start`` of its param (``scales``:
        those of the blocks from ``start // block`` on), bit-identical to
        :meth:`shardopt.quant.Moment.to_fp32`."""
        x = values.float()
        if not self.block:
            return x
        if scales is None:
            raise ValueError(f"decoding {dtype_name(self.dtype)} codes needs their scales")
        # In place, by block: a ragged first block, whole blocks, a ragged last block.
        head = min(x.numel(), -start % self.block)
        whole = (x.numel() - head) // self.block
        x[:head].mul_(scales[:1])
        first = 1 if head else 0
        x[head:head + whole * self.block].view(whole, self.block).mul_(
            scales[first:first + whole, None])
        x[head + whole * self.block:].mul_(scales[first + whole:first + whole + 1])
        return x.square_() if self.sqrt else x

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": dtype_name(self.dtype)}
        if self.block:
            out |= {"block": self.block, "map": "sqrt" if self.sqrt else "linear",
                    "code_max": self.code_max}
        return out


# The encodings this shardopt writes, and so reads.
ENCODINGS = (MomentEncoding(torch.float32), MomentEncoding(torch.bfloat16),
             *(MomentEncoding.of(INT8, n) for n in MOMENT_NAMES))


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest of the checkpoint directory ``path``."""

    path: Path
    version: int
    step: int
    dp_size: int
    created: str | None
    config: Mapping[str, Any]
    params: Mapping[str, ParamRecord]
    aliases: Mapping[str, str]
    files: Mapping[str, FileRecord]
    extra: Mapping[str, Any]
    moments: Mapping[str, MomentEncoding]  # by moment name
    checksum: str  # the manifest's own (checked): what tells two checkpoints apart

    @property
    def file(self) -> Path:
        return self.path / MANIFEST

    def stored(self) -> dict[str, StoredTensor]:
        """Every stored key."""
        out: dict[str, StoredTensor] = {}
        for fqn, p in self.params.items():
            out[fqn] = StoredTensor(p.numel, p.dtype, p.shape)
            if not p.trainable:
                continue
            out[f"{fqn}.master_param"] = StoredTensor(p.numel, torch.float32, p.shape)
            if p.optimizer == muon.MUON:
                out[f"{fqn}.{muon.MOMENTUM}"] = StoredTensor(p.numel, torch.float32, p.shape)
                continue
            for name, enc in self.moments.items():
                out[f"{fqn}.{name}"] = StoredTensor(p.numel, enc.dtype, p.shape)
                if enc.block:
                    out[f"{fqn}.{name}.scale"] = StoredTensor(
                        Range(0, p.numel).blocks(enc.block).size, torch.float32)
        return out

    def scale_keys(self) -> list[str]:
        """The stored keys of 8-bit moments' scales (``"{fqn}.exp_avg.scale"`` & co.)."""
        return [f"{fqn}.{name}.scale" for fqn, p in self.params.items()
                if p.trainable and p.optimizer == muon.ADAMW
                for name, enc in self.moments.items() if enc.block]

    def data_files(self) -> list[FileRecord]:
        return [f for f in self.files.values() if f.kind != "rng"]

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def unknown_files(self) -> list[str]:
        """Names in the checkpoint directory that the manifest does not list."""
        return sorted(n for n in os.listdir(self.path) if n != MANIFEST and n not in self.files)


def parse(path: Path) -> Manifest:
    """Coordinator-free. Read and validate ``path/manifest.json``; raise :class:`FormatError`
    naming the file and the field."""
    file = path / MANIFEST
    m = _read(file)
    try:
        checksum = manifest_checksum(m)
    except RecursionError:
        raise FormatError(f"{file}: nested too deeply") from None
    if m.get("format") != FORMAT_NAME:
        raise FormatError(f"{file}: not a {FORMAT_NAME} checkpoint manifest")
    version = m.get("version")
    if version not in READ_VERSIONS:
        raise FormatError(f"{file}: format version {m.get('version')!r}; this shardopt reads "
                          f"versions {', '.join(map(str, READ_VERSIONS))}")
    if m.get("checksum") != checksum:
        raise FormatError(f"{file}: checksum mismatch (the manifest is damaged or was edited)")
    dp_size = checked_int(m.get("dp_size"), "dp_size", file, 1)
    moments = _moments(m.get("optimizer"), file)
    for key in ("config", "extra", "aliases"):
        if not isinstance(m.get(key, {}), dict):
            raise FormatError(f"{file}: {key} must be a JSON object")
    if not isinstance(m.get("params"), dict):
        raise FormatError(f"{file}: params must be a JSON object")
    params = {fqn: _param(fqn, info, file) for fqn, info in m["params"].items()}
    aliases = m.get("aliases", {})
    for alias, target in aliases.items():  # another name of a tied param
        if not isinstance(target, str) or target not in params:
            raise FormatError(f"{file}: alias {alias!r} names {shown(target)}, which is not a "
                              "stored param")
        if not alias or alias in params:
            raise FormatError(f"{file}: alias {alias!r} of {target!r} is empty or also a "
                              "stored param")
    if not isinstance(m.get("files"), dict) or not m["files"]:
        raise FormatError(f"{file}: files must be a non-empty JSON object")
    files = {name: file_record(name, rec, dp_size, file, version) for name, rec in m["files"].items()}
    check_file_set(dp_size, files, file)
    created = m.get("created")
    manifest = Manifest(path, version, checked_int(m.get("step"), "step", file), dp_size,
                        created if isinstance(created, str) else None,
                        MappingProxyType(m.get("config", {})), MappingProxyType(params),
                        MappingProxyType(aliases), MappingProxyType(files),
                        MappingProxyType(m.get("extra", {})), MappingProxyType(moments),
                        checksum)
    check_tiling(manifest)
    return manifest


def _read(file: Path) -> dict[str, Any]:
    if not os.path.lexists(file):
        raise FormatError(f"{file.parent} is not a checkpoint: {MANIFEST} is missing")
    fd = open_regular(file)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_MANIFEST_BYTES:
            raise FormatError(f"{file}: {size} bytes is larger than any manifest we write")
        raw = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    return parse_json_object(raw, str(file))


def _moments(saved: Any, file: Path) -> dict[str, MomentEncoding]:
    """How each moment is stored (fp32 where the manifest does not say), once the stored
    state is known to mean what this optimizer's does."""
    if not (isinstance(saved, dict) and isinstance(saved.get("kind"), str)
            and isinstance(saved.get("state"), list)):
        raise FormatError(f"{file}: optimizer must be an object with 'kind' and 'state'")
    if saved["kind"] != OPTIMIZER_KIND or tuple(saved["state"]) != STATE_NAMES:
        raise FormatError(f"{file}: the checkpoint holds {saved['kind']!r} optimizer state "
                          f"{saved['state']}, this optimizer is {OPTIMIZER_KIND!r} with "
                          f"{list(STATE_NAMES)}")
    moments = saved.get("moments", {})
    if not isinstance(moments, dict) or set(moments) - set(MOMENT_NAMES):
        raise FormatError(f"{file}: optimizer.moments must map {list(MOMENT_NAMES)} to their "
                          f"encodings, got {moments!r}")
    out = {}
    for name in MOMENT_NAMES:
        raw = moments.get(name)
        out[name] = ENCODINGS[0] if raw is None else next(
            (e for e in ENCODINGS if raw == e.to_json()), None)
        if out[name] is None:
            raise FormatError(f"{file}: unsupported encoding of {name}: {raw!r}; this shardopt "
                              f"reads {[e.to_json() for e in ENCODINGS]}")
    return out


def _param(fqn: str, info: Any, file: Path) -> ParamRecord:
    if not fqn:
        raise FormatError(f"{file}: a param has an empty name")
    if not isinstance(info, dict) or not isinstance(info.get("shape"), list):
        raise FormatError(f"{file}: param {fqn!r} has no shape")
    shape = tuple(checked_int(s, f"a dimension of {fqn!r}", file) for s in info["shape"])
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in TORCH_DTYPE_NAMES:
        raise FormatError(f"{file}: param {fqn!r} has unknown dtype {shown(dtype)} (a torch "
                          f"dtype name: {', '.join(sorted(TORCH_DTYPE_NAMES))})")
    trainable = info.get("trainable")
    if not isinstance(trainable, bool):
        raise FormatError(f"{file}: param {fqn!r} lacks 'trainable'")
    placements = info.get("placements", [])
    if not (isinstance(placements, list) and all(isinstance(p, str) for p in placements)):
        raise FormatError(f"{file}: placements of {fqn!r} must be a list of strings")
    if not trainable:
        return ParamRecord(fqn, shape, TORCH_DTYPE_NAMES[dtype], False, 0, MappingProxyType({}))
    step = checked_int(info.get("step"), f"step of {fqn!r}", file)
    group = info.get("group")
    if not isinstance(group, dict):
        raise FormatError(f"{file}: param {fqn!r} lacks its hyperparameters ('group')")
    hyper = {key: group_value(key, group.get(key)) for key in GROUP_KEYS}  # in AdamW's range
    for key, v in hyper.items():
        if v is None:
            raise FormatError(f"{file}: param group value {key}={shown(group.get(key))} of "
                              f"{fqn!r} is malformed")
    optimizer = group.get("optimizer", muon.ADAMW)
    if optimizer not in muon.OPTIMIZERS:
        raise FormatError(f"{file}: param {fqn!r} has optimizer {shown(optimizer)}, not one of "
                          f"{list(muon.OPTIMIZERS)}")
    if optimizer == muon.MUON:
        if len(shape) != 2:
            raise FormatError(f"{file}: Muon param {fqn!r} has shape {list(shape)}, not 2-D")
        try:
            hyper.update(dataclasses.asdict(muon.settings_of(group)))
        except (ValueError, TypeError) as e:
            raise FormatError(f"{file}: Muon hyperparameters of {fqn!r} are malformed: "
                              f"{shown(str(e), 200)}") from None
    return ParamRecord(fqn, shape, TORCH_DTYPE_NAMES[dtype], True, step, MappingProxyType(hyper),
                       optimizer, tuple(placements))
