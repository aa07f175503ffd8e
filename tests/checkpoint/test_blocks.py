"""The read engine's verified block reads (checkpoint.read) against the stored bytes."""

import os
from pathlib import Path

import pytest
import torch
import xxhash

from shardopt.checkpoint import read
from shardopt.checkpoint.format import FileRecord, FormatError
from shardopt.checkpoint.storage import FileReader


def _file(tmp_path, data: torch.Tensor, block_bytes: int) -> FileReader:
    """``data``'s bytes as a file hashed in ``block_bytes`` blocks, open for reading."""
    raw = data.view(torch.uint8).numpy().tobytes()
    path = tmp_path / "f.bin"
    path.write_bytes(raw)
    hashes = tuple(xxhash.xxh3_64_hexdigest(raw[i:i + block_bytes])
                   for i in range(0, len(raw), block_bytes))
    return FileReader(tmp_path, FileRecord("f.bin", "model", len(raw), block_bytes, hashes, ()))


def _blocks(f: FileReader) -> range:
    return range(len(f.record.hashes))


@pytest.mark.parametrize("block_bytes", [64, 4096, 1 << 20])
def test_read_blocks_places_direct_and_staged_reads(tmp_path, block_bytes):
    data = torch.randn(10_000)
    f = _file(tmp_path, data, block_bytes)
    direct = torch.zeros(3000)
    cast = torch.zeros(2500, dtype=torch.float64)  # staged through the scratch buffer
    reads = [read.Read(f, 4 * 100, direct, torch.float32),          # gap before it
             read.Read(f, 4 * 5000, cast, torch.float32)]           # gap between
    assert read.one_pass_ok(reads, block_bytes, 1 << 20)
    try:
        done = read.read_blocks(reads, threads=3)
    finally:
        f.close()
    assert torch.equal(direct, data[100:3100])
    assert torch.equal(cast, data[5000:7500].double())
    assert done == {f.path: {b for r in reads for b in range(r.file_start // block_bytes,
                                                              (r.file_end - 1) // block_bytes + 1)}}


def test_staged_read_after_an_odd_sized_int8_chunk(tmp_path):
    """int8 codes of odd length followed by fp32 scales (a low-precision checkpoint's file):
    the scales start off their alignment and are staged (a casting destination here, a GPU
    tensor in real loads), which once failed to view the staged bytes as float32."""
    codes = torch.randint(-127, 128, (5,), dtype=torch.int8)
    scales = torch.randn(7)
    f = _file(tmp_path, torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)]), 4096)
    out_codes, out_scales = torch.zeros(5, dtype=torch.int8), torch.zeros(7, dtype=torch.float64)
    try:
        read.read_blocks([read.Read(f, 0, out_codes, torch.int8),
                          read.Read(f, 5, out_scales, torch.float32)], threads=2)
    finally:
        f.close()
    assert torch.equal(out_codes, codes) and torch.equal(out_scales, scales.double())


def test_one_pass_and_verify_take_several_files_at_once(tmp_path):
    """Blocks of several files (different block sizes) in one call: each file's bytes land
    in its own reads, and damage is reported with the damaged file's name."""
    datas = [torch.randn(5000), torch.randn(7000)]
    files = []
    for i, (data, bb) in enumerate(zip(datas, [256, 4096])):
        d = tmp_path / str(i)
        d.mkdir()
        files.append(_file(d, data, bb))
    try:
        outs = [torch.zeros(4000), torch.zeros(6000, dtype=torch.float64)]
        done = read.read_blocks([read.Read(f, 400, out, torch.float32)
                                 for f, out in zip(files, outs)], threads=4)
        assert torch.equal(outs[0], datas[0][100:4100])
        assert torch.equal(outs[1], datas[1][100:6100].double())
        assert done == {files[0].path: set(range(1, 64 + 1)), files[1].path: set(range(0, 5 + 1))}
        verify = [(f, _blocks(f)) for f in files]
        read.verify_blocks(verify, threads=4)
        with open(files[1].path, "r+b") as fh:
            fh.seek(27_000)
            fh.write(b"\xff")
        with pytest.raises(FormatError, match=f"{files[1].path}: content hash mismatch"):
            read.verify_blocks(verify, threads=4)
    finally:
        for f in files:
            f.close()


def test_read_blocks_detects_damage_and_verify_blocks_too(tmp_path):
    f = _file(tmp_path, torch.randn(10_000), 4096)
    with open(f.path, "r+b") as fh:
        fh.seek(20_000)
        fh.write(b"\xff")
    try:
        with pytest.raises(FormatError, match="hash mismatch in bytes \\[16384, 20480\\)"):
            read.read_blocks([read.Read(f, 0, torch.zeros(10_000), torch.float32)], threads=2)
        with pytest.raises(FormatError, match="hash mismatch"):
            read.verify_blocks([(f, _blocks(f))], threads=2)
        read.verify_blocks([(f, [0, 1, 2])], threads=2)  # undamaged blocks
    finally:
        f.close()


def test_one_pass_refuses_odd_or_large_blocks_and_overlaps(tmp_path):
    f = _file(tmp_path, torch.zeros(8), 64)
    one = [read.Read(f, 0, torch.zeros(4), torch.float32)]
    assert not read.one_pass_ok(one, 12, 1 << 20)  # edges could split an element
    assert not read.one_pass_ok(one, 2 << 20, 1 << 20)  # larger than the staging
    two = [read.Read(f, 0, torch.zeros(4), torch.float32),
           read.Read(f, 8, torch.zeros(4), torch.float32)]
    assert not read.one_pass_ok(two, 64, 1 << 20)
    f.close()


def test_an_in_place_read_is_verified_in_a_file_that_also_had_a_one_pass_read(tmp_path):
    """A fresh (one-pass) read and an in-place read of the same file: the in-place read's
    blocks are hash-checked before anything is written (they once were skipped)."""
    from faults.common import data_offset, trained
    from shardopt import checkpoint
    from shardopt.checkpoint.manifest import parse
    from shardopt.checkpoint.read import DataFiles, read_verified
    from shardopt.layout import Range

    model, opt = trained(1)
    path = Path(checkpoint.save(tmp_path, model, opt, step=1,
                                config=checkpoint.CheckpointConfig(block_bytes=64)))
    m = parse(path)
    name = "model-00000.safetensors"
    files = DataFiles(m, [name])
    try:
        keys = [c.key for c in m.files[name].chunks]
        first, last = keys[0], keys[-1]
        numel = {c.key: c.numel for c in m.files[name].chunks}
        fresh = torch.zeros(numel[first], dtype=files.stored[first].dtype)
        existing = torch.zeros(numel[last], dtype=files.stored[last].dtype)
        reads = (files.reads(first, Range(0, numel[first]), fresh, in_place=False)
                 + files.reads(last, Range(0, numel[last]), existing, in_place=True))
        with open(path / name, "r+b") as f:  # damage the in-place read's bytes only
            f.seek(data_offset(path / name, last))
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(FormatError, match="content hash mismatch"):
            read_verified(reads, verify=True, threads=2)
        assert not existing.any()
    finally:
        files.close()
