"""Reading and validating ``manifest.json`` before anything else is trusted.

A manifest comes from disk and may be damaged or hostile: it is size-limited,
parsed as plain JSON, and every field the loader uses is type- and
range-checked here, so later code can index it without defensive checks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .format import (DATA_FILE, FORMAT_NAME, FORMAT_VERSION, MANIFEST, MAX_MANIFEST_BYTES,
                     TORCH_DTYPE_NAMES, FormatError)


def read_manifest(path: Path) -> dict[str, Any]:
    """Coordinator-free. Parse ``path/manifest.json`` (size-limited, JSON only)."""
    file = path / MANIFEST
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        raise FormatError(f"{path} is not a checkpoint: {MANIFEST} is missing") from None
    if size > MAX_MANIFEST_BYTES:
        raise FormatError(f"{file}: {size} bytes is larger than any manifest we write")
    try:
        data = json.loads(file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise FormatError(f"{file}: not a JSON object")
    return data


def _int(value: Any, what: str, file: Path, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise FormatError(f"{file}: {what} must be an int >= {minimum}, got {value!r}")
    return value


def validate_manifest(m: dict[str, Any], path: Path) -> None:
    """Coordinator-free. Raise :class:`FormatError` naming the field if ``m`` is malformed."""
    file = path / MANIFEST
    if m.get("format") != FORMAT_NAME:
        raise FormatError(f"{file}: not a {FORMAT_NAME} checkpoint manifest")
    version = _int(m.get("version"), "version", file, 1)
    if version > FORMAT_VERSION:
        raise FormatError(f"{file}: format version {version} is newer than this shardopt "
                          f"reads ({FORMAT_VERSION}); upgrade shardopt")
    _int(m.get("step"), "step", file)
    _int(m.get("dp_size"), "dp_size", file, 1)
    if not isinstance(m.get("extra", {}), dict):
        raise FormatError(f"{file}: extra must be a JSON object")
    if not isinstance(m.get("aliases", {}), dict):
        raise FormatError(f"{file}: aliases must be a JSON object")
    params = m.get("params")
    if not isinstance(params, dict):
        raise FormatError(f"{file}: params must be a JSON object")
    for fqn, info in params.items():
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
        if not isinstance(name, str) or not DATA_FILE.match(name):
            raise FormatError(f"{file}: refusing data file name {name!r} (only names like "
                              "model-00000.safetensors inside the checkpoint are allowed)")
        if not isinstance(rec, dict):
            raise FormatError(f"{file}: record of {name} is not an object")
        _int(rec.get("size"), f"size of {name}", file)
        _int(rec.get("block_bytes"), f"block_bytes of {name}", file, 1)
        hashes = rec.get("hashes")
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            raise FormatError(f"{file}: hashes of {name} must be a list of strings")
        if not name.startswith("rng-"):
            chunks = rec.get("chunks")
            if not isinstance(chunks, list):
                raise FormatError(f"{file}: chunks of {name} must be a list")
            for c in chunks:
                if not (isinstance(c, list) and len(c) == 3 and isinstance(c[0], str)):
                    raise FormatError(f"{file}: malformed chunk {c!r} in {name}")
                _int(c[1], f"chunk offset in {name}", file)
                _int(c[2], f"chunk length in {name}", file)
