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
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch

from .. import muon, quant
from ..config import GROUP_KEYS, INT8, group_value
from ..layout import STATE_NAMES, Range
from ..moments import NAMES as MOMENT_NAMES
from ..boxes import Box, disjoint_cover, flat_boxes
from .format import (READ_VERSIONS, DATA_FILE, FILE_KINDS, FORMAT_NAME, MANIFEST,
                     MAX_BLOCK_BYTES, MAX_MANIFEST_BYTES, OPTIMIZER_KIND, TORCH_DTYPE_NAMES,
                     ChunkRecord, FileRecord, StoredTensor, data_file_name, dtype_name, is_int,
                     manifest_checksum, parse_json_object)
from .storage import open_regular
from ..errors import FormatError

_HASH = re.compile(r"^[0-9a-f]{16}$")


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


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut short: a forged field may be a 400-digit number or a long list."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


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
    dp_size = _int(m.get("dp_size"), "dp_size", file, 1)
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
    files = {name: _file(name, rec, dp_size, file, version) for name, rec in m["files"].items()}
    _check_file_set(dp_size, files, file)
    created = m.get("created")
    manifest = Manifest(path, version, _int(m.get("step"), "step", file), dp_size,
                        created if isinstance(created, str) else None,
                        MappingProxyType(m.get("config", {})), MappingProxyType(params),
                        MappingProxyType(aliases), MappingProxyType(files),
                        MappingProxyType(m.get("extra", {})), MappingProxyType(moments),
                        checksum)
    _check_tiling(manifest)
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


def _int(value: Any, what: str, file: Path, minimum: int = 0) -> int:
    if not is_int(value, minimum):
        raise FormatError(f"{file}: {what} must be an int in [{minimum}, 2**63 - 1], got "
                          f"{shown(value)}")
    return value


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
    shape = tuple(_int(s, f"a dimension of {fqn!r}", file) for s in info["shape"])
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
    step = _int(info.get("step"), f"step of {fqn!r}", file)
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


def _file(name: str, rec: Any, dp_size: int, file: Path, version: int) -> FileRecord:
    match = DATA_FILE.fullmatch(name)
    if not match:
        raise FormatError(f"{file}: refusing data file name {name!r} (only names like "
                          "model-00000.safetensors inside the checkpoint are allowed)")
    kind = match.group(1)
    if int(match.group(2)) >= dp_size:
        raise FormatError(f"{file}: data file {name} belongs to no rank of dp_size {dp_size}")
    if kind == "rng" and match.group(3):
        raise FormatError(f"{file}: a version {version} checkpoint has no file {name}")
    if not isinstance(rec, dict):
        raise FormatError(f"{file}: record of {name} is not an object")
    size = _int(rec.get("size"), f"size of {name}", file)
    block_bytes = _int(rec.get("block_bytes"), f"block_bytes of {name}", file, 1)
    if block_bytes > MAX_BLOCK_BYTES:
        raise FormatError(f"{file}: block_bytes of {name} is over {MAX_BLOCK_BYTES}")
    hashes = rec.get("hashes")
    if not isinstance(hashes, list) or not all(isinstance(h, str) and _HASH.fullmatch(h)
                                               for h in hashes):
        raise FormatError(f"{file}: hashes of {name} must be a list of 16-hex-digit strings")
    if len(hashes) != Range(0, size).blocks(block_bytes).size:
        raise FormatError(f"{file}: {name} has {len(hashes)} block hashes for {size} bytes "
                          f"in blocks of {block_bytes}")
    chunks = []
    raw = rec.get("chunks") if kind != "rng" else []
    if not isinstance(raw, list):
        raise FormatError(f"{file}: chunks of {name} must be a list")
    lengths = (3, 4) if version >= 4 else (3,)  # version 4: boxes of a tensor-parallel block
    for c in raw:
        if not (isinstance(c, list) and len(c) in lengths and isinstance(c[0], str)):
            raise FormatError(f"{file}: malformed chunk {shown(c)} in {name}")
        boxes = tuple(_box(b, c[0], name, file) for b in _list(c[3], c[0], name, file)) \
            if len(c) == 4 else ()
        chunks.append(ChunkRecord(c[0], _int(c[1], f"chunk offset in {name}", file),
                                  _int(c[2], f"chunk length in {name}", file), boxes))
        if boxes and sum(b.numel for b in boxes) != chunks[-1].numel:
            raise FormatError(f"{file}: the boxes of chunk {c[0]!r} in {name} hold "
                              f"{sum(b.numel for b in boxes)} elements, the chunk {c[2]}")
    return FileRecord(name, kind, size, block_bytes, tuple(hashes), tuple(chunks))


def _list(value: Any, key: str, name: str, file: Path) -> list:
    if not isinstance(value, list) or not value:
        raise FormatError(f"{file}: the boxes of chunk {key!r} in {name} must be a non-empty "
                          "list of [offsets, lengths]")
    return value


def _box(raw: Any, key: str, name: str, file: Path) -> Box:
    """One ``[offsets, lengths]`` box of a chunk (the shape is checked by the tiling)."""
    if not (isinstance(raw, list) and len(raw) == 2 and all(isinstance(x, list) for x in raw)
            and len(raw[0]) == len(raw[1])):
        raise FormatError(f"{file}: malformed box {shown(raw)} of chunk {key!r} in {name}")
    what = f"a box of chunk {key!r} in {name}"
    return Box(tuple(_int(x, what, file) for x in raw[0]),
               tuple(_int(x, what, file) for x in raw[1]))


def _check_file_set(dp_size: int, files: dict[str, FileRecord], file: Path) -> None:
    """Every rank's file of every kind, and a kind's parts numbered without gaps."""
    least = len(FILE_KINDS) * dp_size
    what = (f"{file}: lists {len(files)} data files; a save by {dp_size} ranks writes at "
            f"least {least} ({', '.join(FILE_KINDS)} per rank)")
    if len(files) < least:  # before building the set of names: dp_size may be absurd
        raise FormatError(what)
    missing = sorted({data_file_name(k, r) for r in range(dp_size) for k in FILE_KINDS}
                     - set(files))
    if missing:
        raise FormatError(f"{what}; missing {', '.join(missing[:4])}")
    parts: dict[tuple[str, int], set[int]] = {}  # by kind and rank
    for name in files:
        kind, rank, part = DATA_FILE.fullmatch(name).groups()
        parts.setdefault((kind, int(rank)), set()).add(int(part or 0))
    for (kind, rank), got in sorted(parts.items()):
        gap = min(set(range(len(got) + 1)) - got)
        if gap < len(got):
            raise FormatError(f"{file}: lists parts of {data_file_name(kind, rank)} up to "
                              f"{data_file_name(kind, rank, max(got))} but not "
                              f"{data_file_name(kind, rank, gap)}")


def _check_tiling(m: Manifest) -> None:
    """The files' chunks of every stored tensor tile it exactly: the stored bytes agree
    with the params' shapes, and no key is stored that no param describes."""
    stored = m.stored()
    by_key: dict[str, list[tuple[ChunkRecord, str]]] = {key: [] for key in stored}
    for f in m.data_files():
        for c in f.chunks:
            if c.key not in stored:
                raise FormatError(f"{m.file}: {f.name} stores {c.key!r}, which no param describes")
            by_key[c.key].append((c, f.name))
    for key, chunks in by_key.items():
        if any(c.boxes for c, _ in chunks):
            _check_boxes(m, key, stored[key], [c for c, _ in chunks])
            continue
        pos = 0
        for c, name in sorted(chunks):
            if c.offset != pos:
                what = "overlap" if c.offset < pos else "gap"
                raise FormatError(f"{m.file}: stored chunks of {key!r} have a {what} at element "
                                  f"{pos} (file {name})")
            pos += c.numel
        if pos != stored[key].numel:
            raise FormatError(f"{m.file}: stored chunks of {key!r} cover {pos} of "
                              f"{stored[key].numel} elements")


def _check_boxes(m: Manifest, key: str, stored: StoredTensor, chunks: list[ChunkRecord]) -> None:
    """The chunks of a key saved in tensor-parallel blocks tile its global tensor exactly."""
    shape = stored.shape or (stored.numel,)
    whole = Box.whole(shape)
    for c in chunks:
        if not c.boxes and c.offset + c.numel > stored.numel:
            raise FormatError(f"{m.file}: a chunk of {key!r} holds elements [{c.offset}, "
                              f"{c.offset + c.numel}) of a tensor of {stored.numel}")
    boxes = [b for c in chunks
             for b in c.boxes or flat_boxes(whole, Range(c.offset, c.offset + c.numel))]
    problem = disjoint_cover(boxes, shape)
    if problem:
        raise FormatError(f"{m.file}: stored chunks of {key!r}: {problem}")
