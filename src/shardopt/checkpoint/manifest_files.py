"""The data files a manifest lists: each file's record parsed and checked, the set complete
for the ranks that saved, and the chunks of every stored tensor tiling it exactly (flat ranges,
or N-D boxes of a tensor-parallel block). :mod:`.manifest` parses the rest; both raise
:class:`~shardopt.errors.FormatError` naming the file and the field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..boxes import Box, disjoint_cover, flat_boxes
from ..errors import FormatError
from ..layout import Range
from .format import (DATA_FILE, FILE_KINDS, MAX_BLOCK_BYTES, ChunkRecord, FileRecord,
                     StoredTensor, data_file_name, is_int)

_HASH = re.compile(r"^[0-9a-f]{16}$")


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut short: a forged field may be a 400-digit number or a long list."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def checked_int(value: Any, what: str, file: Path, minimum: int = 0) -> int:
    if not is_int(value, minimum):
        raise FormatError(f"{file}: {what} must be an int in [{minimum}, 2**63 - 1], got "
                          f"{shown(value)}")
    return value


def file_record(name: str, rec: Any, dp_size: int, file: Path, version: int) -> FileRecord:
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
    size = checked_int(rec.get("size"), f"size of {name}", file)
    block_bytes = checked_int(rec.get("block_bytes"), f"block_bytes of {name}", file, 1)
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
        chunks.append(ChunkRecord(c[0], checked_int(c[1], f"chunk offset in {name}", file),
                                  checked_int(c[2], f"chunk length in {name}", file), boxes))
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
    return Box(tuple(checked_int(x, what, file) for x in raw[0]),
               tuple(checked_int(x, what, file) for x in raw[1]))


def check_file_set(dp_size: int, files: dict[str, FileRecord], file: Path) -> None:
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


def check_tiling(m: Any) -> None:
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


def _check_boxes(m: Any, key: str, stored: StoredTensor, chunks: list[ChunkRecord]) -> None:
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
