"""Reading and validating ``manifest.json`` before anything else is trusted.

A manifest comes from disk and may be damaged or hostile: it is size-limited,
read without following symlinks, parsed as plain JSON, checked against its own
checksum, and every field the loader uses is type- and range-checked here, so
later code can index it without defensive checks. Data file names are fixed
patterns (``model-00000.safetensors``), so none can leave the directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from .format import (DATA_FILE, FILE_KINDS, FORMAT_NAME, FORMAT_VERSION, MANIFEST,
                     MAX_BLOCK_BYTES, MAX_MANIFEST_BYTES, TORCH_DTYPE_NAMES, FormatError,
                     data_file_name, manifest_checksum, parse_json_object)
from .storage import open_regular

_HASH = re.compile(r"^[0-9a-f]{16}$")


def read_manifest(path: Path) -> dict[str, Any]:
    """Coordinator-free. Parse ``path/manifest.json`` (size-limited, JSON only)."""
    file = path / MANIFEST
    if not os.path.lexists(file):
        raise FormatError(f"{path} is not a checkpoint: {MANIFEST} is missing")
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
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise FormatError(f"{file}: {what} must be an int >= {minimum}, got {value!r}")
    return value


def validate_manifest(m: dict[str, Any], path: Path) -> None:
    """Coordinator-free. Raise :class:`FormatError` naming the field if ``m`` is malformed."""
    file = path / MANIFEST
    _validate_fields(m, file)
    try:
        checksum = manifest_checksum(m)
    except RecursionError:
        raise FormatError(f"{file}: nested too deeply") from None
    if m.get("checksum") != checksum:
        raise FormatError(f"{file}: checksum mismatch (the manifest is damaged or was edited)")


def _validate_fields(m: dict[str, Any], file: Path) -> None:
    if m.get("format") != FORMAT_NAME:
        raise FormatError(f"{file}: not a {FORMAT_NAME} checkpoint manifest")
    version = _int(m.get("version"), "version", file, 1)
    if version > FORMAT_VERSION:
        raise FormatError(f"{file}: format version {version} is newer than this shardopt "
                          f"reads ({FORMAT_VERSION}); upgrade shardopt")
    _int(m.get("step"), "step", file)
    dp_size = _int(m.get("dp_size"), "dp_size", file, 1)
    optimizer = m.get("optimizer")
    if not (isinstance(optimizer, dict) and isinstance(optimizer.get("kind"), str)
            and isinstance(optimizer.get("state"), list)):
        raise FormatError(f"{file}: optimizer must be an object with 'kind' and 'state'")
    if not isinstance(m.get("config", {}), dict):
        raise FormatError(f"{file}: config must be a JSON object")
    if not isinstance(m.get("extra", {}), dict):
        raise FormatError(f"{file}: extra must be a JSON object")
    if not isinstance(m.get("aliases", {}), dict):
        raise FormatError(f"{file}: aliases must be a JSON object")
    params = m.get("params")
    if not isinstance(params, dict):
        raise FormatError(f"{file}: params must be a JSON object")
    for fqn, info in params.items():
        if not fqn:
            raise FormatError(f"{file}: a param has an empty name")
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list):
            raise FormatError(f"{file}: param {fqn!r} has no shape")
        for s in info["shape"]:
            _int(s, f"a dimension of {fqn!r}", file)
        if info.get("dtype") not in TORCH_DTYPE_NAMES:
            raise FormatError(f"{file}: param {fqn!r} has unknown dtype {info.get('dtype')!r}")
        if not isinstance(info.get("trainable"), bool):
            raise FormatError(f"{file}: param {fqn!r} lacks 'trainable'")
        if info["trainable"]:
            _int(info.get("step"), f"step of {fqn!r}", file)
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        raise FormatError(f"{file}: files must be a non-empty JSON object")
    for name, rec in files.items():
        match = DATA_FILE.fullmatch(name)
        if not match:
            raise FormatError(f"{file}: refusing data file name {name!r} (only names like "
                              "model-00000.safetensors inside the checkpoint are allowed)")
        if int(match.group(2)) >= dp_size:
            raise FormatError(f"{file}: data file {name} belongs to no rank of dp_size {dp_size}")
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
        if len(hashes) != -(-size // block_bytes):
            raise FormatError(f"{file}: {name} has {len(hashes)} block hashes for {size} bytes "
                              f"in blocks of {block_bytes}")
        if not name.startswith("rng-"):
            chunks = rec.get("chunks")
            if not isinstance(chunks, list):
                raise FormatError(f"{file}: chunks of {name} must be a list")
            for c in chunks:
                if not (isinstance(c, list) and len(c) == 3 and isinstance(c[0], str)):
                    raise FormatError(f"{file}: malformed chunk {c!r} in {name}")
                _int(c[1], f"chunk offset in {name}", file)
                _int(c[2], f"chunk length in {name}", file)
    _check_file_set(m["version"], dp_size, files, file)


def _check_file_set(version: int, dp_size: int, files: dict, file: str) -> None:
    """Every rank's file of every kind, and (version 3) a kind's parts numbered without gaps."""
    kinds = FILE_KINDS.get(version)
    if kinds is None:
        raise FormatError(f"{file}: unknown format version {version}")
    least = len(kinds) * dp_size
    what = (f"{file}: lists {len(files)} data files; a version {version} save by "
            f"{dp_size} ranks writes {'at least ' if version >= 3 else ''}{least} "
            f"({', '.join(kinds)} per rank)")
    if len(files) < least or (version < 3 and len(files) != least):  # dp_size may be absurd
        raise FormatError(what)
    parts: dict[tuple[str, int], set[int]] = {}
    for name in files:
        kind, rank, part = DATA_FILE.fullmatch(name).groups()
        if kind not in kinds or (part and (version < 3 or kind == "rng")):
            raise FormatError(f"{file}: a version {version} checkpoint has no file {name}")
        parts.setdefault((kind, int(rank)), set()).add(int(part or 0))
    missing = sorted({data_file_name(k, r) for r in range(dp_size) for k in kinds}
                     - set(files))
    if missing:
        raise FormatError(f"{what}; missing {', '.join(missing[:4])}")
    for (kind, rank), got in sorted(parts.items()):
        gap = min(set(range(len(got) + 1)) - got)
        if gap < len(got):
            raise FormatError(f"{file}: lists parts of {data_file_name(kind, rank)} up to "
                              f"{data_file_name(kind, rank, max(got))} but not "
                              f"{data_file_name(kind, rank, gap)}")


def unknown_files(path: Path, m: dict[str, Any]) -> list[str]:
    """Coordinator-free. Names in the checkpoint directory that its manifest does not list."""
    return sorted(n for n in os.listdir(path) if n != MANIFEST and n not in m["files"])


def check_optimizer(m: dict[str, Any], kind: str, state_names: tuple[str, ...]) -> None:
    """Raise :class:`FormatError` if the stored optimizer state means something else."""
    saved = m["optimizer"]
    if saved["kind"] != kind or tuple(saved["state"]) != state_names:
        raise FormatError(f"the checkpoint holds {saved['kind']!r} optimizer state "
                          f"{saved['state']}, this optimizer is {kind!r} with {list(state_names)}")


__all__ = ["check_optimizer", "read_manifest", "unknown_files", "validate_manifest"]
