"""Threaded block writes and segment reads (checkpoint.transfer) against plain byte files."""

import importlib
import os

import pytest
import torch
import xxhash

from shardopt.checkpoint import transfer
from shardopt.checkpoint.transfer import FileSegment, Part, Scratch, Segment


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


def _write(tmp_path, parts, block_bytes, scratch, threads):
    path = str(tmp_path / "f.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        digests = transfer.write_blocks(fd, path, parts, block_bytes, scratch, threads)
    finally:
        os.close(fd)
    return path, digests


@pytest.mark.parametrize("block_bytes,piece,threads", [(4096, 1024, 3), (1 << 20, 1 << 16, 4),
                                                       (1000, 1 << 16, 1)])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_write_blocks_writes_the_bytes_and_their_block_hashes(tmp_path, device, block_bytes,
                                                              piece, threads):
    parts, raw = _parts(device)
    scratch = Scratch(threads, piece, torch.device(device)) if device == "cuda" or piece < (
        1 << 16) else None
    path, digests = _write(tmp_path, parts, block_bytes, scratch, threads)
    with open(path, "rb") as f:
        assert f.read() == raw
    assert digests == [xxhash.xxh3_64_hexdigest(raw[i:i + block_bytes])
                       for i in range(0, len(raw), block_bytes)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_read_segments_fills_direct_staged_and_casting_destinations(tmp_path, device):
    data = torch.randn(50_000)
    path = tmp_path / "f.bin"
    path.write_bytes(data.numpy().tobytes())
    direct = torch.zeros(12_345)
    staged = torch.zeros(20_000, device=device)
    cast = torch.zeros(3_000, dtype=torch.float64, device=device)
    empty = torch.zeros(0)
    fd = os.open(path, os.O_RDONLY)
    try:
        segs = [FileSegment(fd, str(path), Segment(4 * 10, direct, torch.float32)),
                FileSegment(fd, str(path), Segment(4 * 15_000, staged, torch.float32)),
                FileSegment(fd, str(path), Segment(4 * 40_000, cast, torch.float32)),
                FileSegment(fd, str(path), Segment(0, empty, torch.float32))]
        transfer.read_segments(segs, Scratch(3, 4096, torch.device(device)), threads=3)
        with pytest.raises(AssertionError, match="need a scratch"):
            transfer.read_segments(segs[2:3], None, threads=2)
    finally:
        os.close(fd)
    assert torch.equal(direct, data[10:12_355])
    assert torch.equal(staged.cpu(), data[15_000:35_000])
    assert torch.equal(cast.cpu(), data[40_000:43_000].double())


def test_read_segments_names_the_file_at_a_short_read(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(100))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(Exception, match="short.bin: unexpected end of file"):
            transfer.read_segments([FileSegment(fd, str(path),
                                                Segment(0, torch.zeros(1000), torch.float32))],
                                   None, threads=4)
    finally:
        os.close(fd)


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
    monkeypatch.setattr(importlib.import_module("shardopt.checkpoint._writer_main"), "IOV_MAX", 3)
    views = [memoryview(bytes([i]) * (i + 1)) for i in range(10)]
    path = str(tmp_path / "v.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        transfer.pwritev_exact(fd, list(views), 5, path)
        back = [memoryview(bytearray(len(v))) for v in views]
        transfer.preadv_exact(fd, back, 5, path)
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
