"""The on-disk pieces of a checkpoint: names, safetensors headers, checksums.

Data files are plain safetensors of 1-D chunks; a chunk's position in its full tensor is in the
header's ``__metadata__`` under ``DCP_SHARDING_INFO`` (``{"key": {"saved_offsets": [offset]}}``),
the convention of ``torch.distributed.checkpoint``'s Hugging Face storage, so its reader loads
these files too. A chunk of a tensor-parallel block is a flat range of that block: its
``offset`` counts in the block, and the manifest lists the N-D boxes of the global tensor it
holds (:mod:`shardopt.boxes`; DCP's reader does not read such chunks). Every file is hashed in
fixed-size blocks (xxh3-64), so a reader that needs part of a file verifies just the blocks
it reads.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ..boxes import Box
from ..config import dtype_name
from ..errors import FormatError

FORMAT_NAME = "shardopt"
FORMAT_VERSION = 4
# Versions this shardopt reads: 3 holds data-parallel checkpoints, the same files without boxes.
READ_VERSIONS = (3, 4)
MANIFEST = "manifest.json"
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{8,})$")
# The kinds of data file every rank writes. Each Adam moment has its own file, so that a rank
# writes its files at once (a file takes one writer at a time); a kind but ``rng`` may continue
# in further parts (``-pN``, N from 1 to 999) of about equal size.
FILE_KINDS = ("model", "optim", "exp_avg", "exp_avg_sq", "rng")
DATA_FILE = re.compile(rf"^({'|'.join(FILE_KINDS)})-(\d{{5}})(?:-p([1-9]\d{{0,2}}))?\.safetensors$")
MAX_PARTS = 1000
SHARDING_KEY = "DCP_SHARDING_INFO"
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_MANIFEST_BYTES = 512 * 1024 * 1024
DEFAULT_BLOCK_BYTES = 8 * 1024 * 1024
MAX_BLOCK_BYTES = 1 << 30  # a reader allocates one block at a time
# Every integer a checkpoint holds (steps, sizes, offsets, dimensions) fits in int64.
MAX_INT = 2**63 - 1
# What the stored optimizer state means: loading it into anything else is refused.
OPTIMIZER_KIND = "adamw"

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
TORCH_DTYPE_NAMES = {dtype_name(v): v for v in DTYPES.values()}


def is_int(value: Any, minimum: int = 0) -> bool:
    """An int (not a bool) in ``[minimum, MAX_INT]``."""
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= MAX_INT


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def data_file_name(kind: str, rank: int, part: int = 0) -> str:
    """``model-00003.safetensors``; later parts of a kind: ``model-00003-p1.safetensors``."""
    return f"{kind}-{rank:05d}{f'-p{part}' if part else ''}.safetensors"


def state_file_kind(name: str) -> str:
    """The file kind that holds optimizer state ``name`` (Muon's momentum buffer: the first
    moments' files, ``exp_avg``)."""
    if name == "momentum_buffer":
        return "exp_avg"
    return "optim" if name == "master_param" else name


@dataclass(frozen=True, order=True)
class ChunkRecord:
    """A chunk as the manifest lists it: elements ``[offset, offset + numel)`` of ``key``
    flattened, or, with ``boxes``, of the flattened block they were cut from, lying in those
    boxes of the global tensor (their row-major data back to back)."""

    key: str
    offset: int
    numel: int
    boxes: tuple[Box, ...] = ()

    @property
    def header_entry(self) -> tuple[str, int, int]:
        """What the file's safetensors header says of it."""
        return self.key, self.offset, self.numel


@dataclass(frozen=True)
class StoredChunk:
    """One 1-D chunk of a full tensor, as stored in one file."""

    key: str
    file: str
    offset: int  # element offset in the flattened full tensor
    numel: int
    dtype: torch.dtype
    data_start: int  # byte offset of the chunk's first element in the file
    boxes: tuple[Box, ...] = ()  # where it lies in the global tensor (none: a flat range)

    @property
    def record(self) -> ChunkRecord:
        return ChunkRecord(self.key, self.offset, self.numel, self.boxes)


@dataclass(frozen=True)
class StoredTensor:
    """A stored tensor (a key of the checkpoint): its element count, dtype and shape."""

    numel: int
    dtype: torch.dtype
    shape: tuple[int, ...] | None = field(default=None, compare=False)  # None: 1-D


@dataclass(frozen=True)
class FileRecord:
    """A data file: its size, block hashes and (but for ``rng``) the chunks it stores."""

    name: str
    kind: str
    size: int
    block_bytes: int
    hashes: tuple[str, ...]
    chunks: tuple[ChunkRecord, ...]


@dataclass(frozen=True)
class FileHeader:
    header_bytes: int  # 8 + JSON length: where data begins
    chunks: tuple[StoredChunk, ...]


def pack_header(header: dict) -> bytes:
    """A safetensors header: its JSON's length, then the JSON, padded so that data is 8-byte
    aligned (as safetensors does)."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return struct.pack("<Q", len(raw)) + raw


def build_header(entries: Iterable) -> tuple[bytes, list[int]]:
    """The header of a data file of ``entries`` (``key``, ``dtype``, ``numel`` and
    ``offset`` in the full tensor) in order; returns it and each entry's data start."""
    header: dict[str, object] = {}
    sharding: dict[str, object] = {}
    starts = [0]
    for e in entries:
        nbytes = e.numel * e.dtype.itemsize
        header[e.key] = {"dtype": DTYPE_CODES[e.dtype], "shape": [e.numel],
                         "data_offsets": [starts[-1], starts[-1] + nbytes]}
        sharding[e.key] = {"saved_offsets": [e.offset]}
        starts.append(starts[-1] + nbytes)
    header["__metadata__"] = {SHARDING_KEY: json.dumps(sharding), "format": "pt",
                              "DCP_VERSION": "1.0"}
    raw = pack_header(header)
    return raw, [len(raw) + s for s in starts[:-1]]


def parse_json_object(raw: bytes | str, what: str) -> dict:
    """Parse untrusted JSON that must be an object (deep nesting is an error, not a crash)."""
    try:
        value = json.loads(raw)
    except (TypeError, ValueError, RecursionError) as e:  # ValueError: also 5000-digit ints
        raise FormatError(f"{what} is not valid JSON ({type(e).__name__})") from None
    if not isinstance(value, dict):
        raise FormatError(f"{what} is not a JSON object")
    return value


def parse_header(raw_len: bytes, read_json: Callable[[int], bytes], file: str, file_size: int,
                 max_bytes: int = MAX_HEADER_BYTES) -> FileHeader:
    """Parse a safetensors header; ``read_json(n)`` returns the next ``n`` bytes. The length
    is checked against ``max_bytes`` and the file size before anything is read, so a hostile
    length cannot make us allocate. The rules are the safetensors library's: the tensors'
    byte ranges, in order, cover the data section exactly, without overlap."""
    if len(raw_len) != 8:
        raise FormatError(f"{file}: truncated safetensors header")
    (n,) = struct.unpack("<Q", raw_len)
    if n > min(max_bytes, MAX_HEADER_BYTES) or 8 + n > file_size:
        raise FormatError(f"{file}: header length {n} is too large for a file of {file_size} "
                          "bytes and the chunks its manifest lists (not a checkpoint data file?)")
    raw = read_json(n)
    if not raw.startswith(b"{"):  # as safetensors requires
        raise FormatError(f"{file}: the safetensors header does not start with '{{'")
    header = parse_json_object(raw, f"{file}: header")
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FormatError(f"{file}: header __metadata__ is not a JSON object of strings")
    sharding = parse_json_object(meta.get(SHARDING_KEY, "{}"), f"{file}: {SHARDING_KEY} metadata")
    chunks = []
    for key, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            (numel,) = info["shape"]
            begin, end = info["data_offsets"]
            (offset,) = sharding.get(key, {"saved_offsets": [0]})["saved_offsets"]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise FormatError(f"{file}: malformed header entry for {key!r} (one 1-D tensor "
                              "with its dtype, shape and data_offsets)") from None
        if not all(is_int(x) for x in (numel, begin, end, offset)) or \
                end - begin != numel * dtype.itemsize:
            raise FormatError(f"{file}: header entry {key!r} is inconsistent with the file")
        chunks.append(StoredChunk(key, file, offset, numel, dtype, 8 + n + begin))
    pos = 0  # in the data section
    for c in sorted(chunks, key=lambda c: (c.data_start, c.numel * c.dtype.itemsize)):
        begin = c.data_start - 8 - n
        if begin != pos:
            what = "overlaps the tensor before it" if begin < pos else \
                f"leaves bytes [{pos}, {begin}) of the data section uncovered"
            raise FormatError(f"{file}: header entry {c.key!r} {what} (not a valid safetensors "
                              "file)")
        pos = begin + c.numel * c.dtype.itemsize
    if pos != file_size - 8 - n:
        raise FormatError(f"{file}: the tensors cover {pos} of the {file_size - 8 - n} bytes of "
                          "the data section (not a valid safetensors file)")
    return FileHeader(8 + n, tuple(chunks))


def manifest_checksum(manifest: dict) -> str:
    """xxh3-64 of the manifest's canonical JSON without its ``checksum`` field: catches
    accidental damage (a flipped digit in a step, size or hash); it is not a signature."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "xxh3-64:" + xxhash.xxh3_64_hexdigest(canonical.encode())
