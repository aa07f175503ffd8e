"""The one block writer (checkpoint.transfer, storage.write_parts) and the read engine's
plain reads (checkpoint.read) against plain byte files."""

import os

import pytest
import torch
import xxhash

from shardopt.checkpoint import read, storage, transfer
from shardopt.checkpoint.format import FileRecord
from shardopt.checkpoint.storage import FileReader, Scratch
from shardopt.checkpoint.transfer import Part


def _parts(device: str) -> tuple[list[Part], bytes]:
    """A header, tensors on ``device`` and zero runs, contiguous from byte 0; and the bytes."""
    g = torch.Generator().manual_seed(0)
    pieces: list[torch.Tensor | int] = [
        torch.randint(0, 256, (13,), dtype=torch.uint8, generator=g),   # odd-sized header
        torch.randn(5000, generator=g),                                 # crosses blocks
        300,                                                            # zeros
        torch.randn(7, generator=g).to(torch.bfloat16),                 # tiny
        *[torch.randn(3, generator=g) for _ in range(40)],              # many parts per piece
        9000,                                                           # long zero run
        torch.randn(20_000, generator=g).double(),
    ]
    parts, raw, pos = [], bytearray(), 0
    for p in pieces:
        if isinstance(p, int):
            parts.append(Part(pos, p, None))
            raw += bytes(p)
            pos += p
            continue
        data = p.contiguous().view(torch.uint8)
        raw += data.numpy().tobytes()
        parts.append(Part(pos, data.numel(), data.to(device)))
        pos += data.numel()
    return parts, bytes(raw)


def _write(tmp_path, parts, block_bytes, scratch):
    path = str(tmp_path / "f.bin")
    record = storage.write_parts(path, parts, block_bytes, scratch)
    assert record["size"] == os.path.getsize(path) and record["block_bytes"] == block_bytes
    return path, record["hashes"]


@pytest.mark.parametrize("block_bytes,piece", [(4096, 1024), (1 << 20, 1 << 16), (1000, 1 << 16),
                                               (4096, 3000)])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_write_parts_writes_the_bytes_and_their_block_hashes(tmp_path, device, block_bytes,
                                                             piece):
    """Pieces of a scratch buffer's size, smaller than a block or not dividing it: the
    file's bytes and the digest of each block, as hashing the file front to back."""
    parts, raw = _parts(device)
    scratch = Scratch(1, piece, torch.device(device)) if device == "cuda" or piece < (
        1 << 16) else None
    path, digests = _write(tmp_path, parts, block_bytes, scratch)
    with open(path, "rb") as f:
        assert f.read() == raw
    assert digests == [xxhash.xxh3_64_hexdigest(raw[i:i + block_bytes])
                       for i in range(0, len(raw), block_bytes)]


def test_the_file_writer_takes_bytes_in_order_only(tmp_path):
    path = str(tmp_path / "w.bin")
    writer = transfer.FileWriter(path, 10, 4)
    try:
        writer.write(0, [memoryview(b"abc")])
        with pytest.raises(ValueError, match=r"bytes \[5, 7\) out of order \(expected byte 3"):
            writer.write(5, [memoryview(b"xy")])
        with pytest.raises(ValueError, match="3 of 10 bytes came"):
            writer.finish()
        writer.write(3, [memoryview(b"defg"), memoryview(b"hij")])
        assert writer.finish()["hashes"] == [xxhash.xxh3_64_hexdigest(b) for b in
                                             (b"abcd", b"efgh", b"ij")]
    finally:
        writer.close()
    with pytest.raises(FileExistsError):  # a new file, never one in the way
        transfer.FileWriter(path, 1, 4)


def _reader(path) -> FileReader:
    size = os.path.getsize(path)
    return FileReader(path.parent, FileRecord(path.name, "model", size, 1 << 20, (), ()))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_plain_reads_fill_direct_staged_and_casting_destinations(tmp_path, device):
    data = torch.randn(50_000)
    path = tmp_path / "f.bin"
    path.write_bytes(data.numpy().tobytes())
    direct = torch.zeros(12_345)
    staged = torch.zeros(20_000, device=device)
    cast = torch.zeros(3_000, dtype=torch.float64, device=device)
    empty = torch.zeros(0)
    f = _reader(path)
    try:
        reads = [read.Read(f, 4 * 10, direct, torch.float32),
                 read.Read(f, 4 * 15_000, staged, torch.float32),
                 read.Read(f, 4 * 40_000, cast, torch.float32),
                 read.Read(f, 0, empty, torch.float32)]
        read.read_plain(reads, 3 * 4096, threads=3)  # in pieces of 4 KiB per thread
    finally:
        f.close()
    assert torch.equal(direct, data[10:12_355])
    assert torch.equal(staged.cpu(), data[15_000:35_000])
    assert torch.equal(cast.cpu(), data[40_000:43_000].double())


def test_a_plain_read_names_the_file_at_a_short_read(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(100))
    f = _reader(path)
    try:
        with pytest.raises(Exception, match="short.bin: unexpected end of file"):
            read.read_plain([read.Read(f, 0, torch.zeros(1000), torch.float32)], 1 << 20,
                            threads=4)
    finally:
        f.close()


def test_run_parallel_raises_the_earliest_failure_and_stops_taking_jobs():
    done = []

    def work(job, slot):
        if job in (5, 9):
            raise ValueError(f"job {job}")
        done.append(job)

    with pytest.raises(ValueError, match="job 5"):
        transfer.run_parallel(list(range(40)), work, threads=4)
    assert len(done) < 38


def test_many_views_are_written_and_read_past_iov_max(tmp_path, monkeypatch):
    monkeypatch.setattr(transfer, "IOV_MAX", 3)
    views = [memoryview(bytes([i]) * (i + 1)) for i in range(10)]
    path = str(tmp_path / "v.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        transfer.pwritev_exact(fd, list(views), 5, path)
        back = [memoryview(bytearray(len(v))) for v in views]
        read.preadv_exact(fd, back, 5, path)
    finally:
        os.close(fd)
    assert [bytes(b) for b in back] == [bytes(v) for v in views]


def test_a_rank_writes_its_files_side_by_side(tmp_path, monkeypatch):
    """A file takes one writer at a time, so a save writes a rank's files concurrently."""
    import threading
    import time

    from faults.common import trained
    from shardopt import checkpoint

    real, lock, active, most = os.pwritev, threading.Lock(), set(), [0]

    def slow_pwritev(fd, buffers, offset):
        with lock:
            active.add(fd)
            most[0] = max(most[0], len(active))
        time.sleep(0.2)
        try:
            return real(fd, buffers, offset)
        finally:
            with lock:
                active.discard(fd)

    model, opt = trained(1)
    monkeypatch.setattr(os, "pwritev", slow_pwritev)
    path = checkpoint.save(tmp_path / "root", model, opt, step=1)
    monkeypatch.undo()
    assert most[0] >= 4  # model, optim, exp_avg and exp_avg_sq at once (rng is a few bytes)
    checkpoint.verify(path)
