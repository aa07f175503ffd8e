"""The writer process of asynchronous saves (``shardopt.checkpoint.writer_process``): one
process serves every save of an optimizer, maps each snapshot once and unmaps it when it is
released or collected, reports its errors as the save's, ends with its optimizer, and a
killed or forked-off process costs only the save it was writing."""

from __future__ import annotations

import gc
import importlib
import logging
import os
import signal
import time
from pathlib import Path

import pytest

from helpers.checks import checkpoint_bytes
from helpers.models import build, train
from shardopt import checkpoint
from shardopt.checkpoint import CheckpointError, background, transfer

SAVE_MODULE = "shardopt.checkpoint.save"
pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"),
                                reason="the writer process needs memfd")


def test_one_writer_process_outlives_the_save_threads_that_use_it(trained_model, tmp_path):
    """Each asynchronous save runs on a thread of its own; the writer process started by
    the first stays up for the next ones (one that died with the thread that started it
    would fail every later save with 'Connection reset by peer')."""
    model, opt = trained_model
    pids = []
    for step in range(1, 4):
        checkpoint.save(tmp_path, model, opt, step=step, blocking=False).wait()
        pids.append(_writer(opt).pid)
        time.sleep(0.3)  # time for a signal at the save thread's end to land
        assert _running(pids[-1])
    assert len(set(pids)) == 1


def _writer(opt):
    """The writer process of ``opt``'s asynchronous saves."""
    return background.of(opt).writer


def _running(pid: int | None) -> bool:
    """Whether child process ``pid`` runs (neither gone nor a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _snapshot_maps(pid: int) -> int:
    """Snapshot buffers process ``pid`` maps (none once it has ended)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return sum("shardopt-snapshot" in line for line in f)
    except FileNotFoundError:
        return 0


def _until(cond, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_writer_process_unmaps_snapshots_released_or_collected(tmp_path, caplog):
    """A snapshot's shared memory is unmapped in the writer process when the snapshot is
    released (the mapping would keep gigabytes alive for the rest of the run), and the process
    ends when its optimizer is garbage-collected."""
    model, opt = build(0)
    train(model, opt, range(2), 0, 1)
    saves = background.of(opt)
    checkpoint.save(tmp_path / "a", model, opt, step=1, blocking=False).wait()
    pid = saves.writer.pid
    before = _snapshot_maps(pid)
    checkpoint.save(tmp_path / "a", model, opt, step=2, blocking=False).wait()
    mine = len(saves.snapshot.host_buffers())
    assert mine > 0 and _snapshot_maps(pid) == before == mine  # reused, not mapped again
    saves.snapshot.release()
    assert _until(lambda: _snapshot_maps(pid) == 0)
    checkpoint.save(tmp_path / "b", model, opt, step=2, blocking=False).wait()
    assert saves.writer.pid == pid and _snapshot_maps(pid) == mine
    del model, opt, saves
    with caplog.at_level(logging.WARNING, logger="shardopt.checkpoint"):
        gc.collect()
    # Ended by its socket's end with status 0, not killed after the 10 s the closing side waits.
    assert _until(lambda: not _running(pid), seconds=5)
    assert not [r for r in caplog.records if "writer process" in r.getMessage()], caplog.text


def test_a_writer_process_that_dies_is_reported_when_it_is_closed(tmp_path, caplog):
    """The test above would see a writer that exits with an error: one killed here is
    reported, with its status, when its owner lets it go."""
    model, opt = build(0)
    train(model, opt, range(1), 0, 1)
    saves = background.of(opt)
    checkpoint.save(tmp_path / "a", model, opt, step=1, blocking=False).wait()
    pid = saves.writer.pid
    os.kill(pid, signal.SIGKILL)
    assert _until(lambda: not _running(pid), seconds=5)
    del model, opt, saves
    with caplog.at_level(logging.WARNING, logger="shardopt.checkpoint"):
        gc.collect()
    assert f"writer process (pid {pid}) ended with status -9" in caplog.text


def test_a_forked_child_leaves_the_parents_writer_process_alone(tmp_path):
    """A child forked after the writer process started (a data loader worker) that drops a
    snapshot or exits sends nothing down the parent's socket: the parent's mappings and
    saves are intact."""
    model, opt = build(0)
    train(model, opt, range(2), 0, 1)
    checkpoint.save(tmp_path / "a", model, opt, step=2, blocking=False).wait()
    pid = _writer(opt).pid
    before = _snapshot_maps(pid)
    child = os.fork()
    if child == 0:
        try:
            background.of(opt).snapshot.release()  # would queue unmaps of the parent's buffers
            _writer(opt).close()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    time.sleep(0.2)
    assert _running(pid) and _snapshot_maps(pid) >= before
    reference = checkpoint.save(tmp_path / "sync", model, opt, step=2)
    path = checkpoint.save(tmp_path / "b", model, opt, step=2, blocking=False).wait()
    assert _writer(opt).pid == pid
    assert checkpoint_bytes(Path(path)) == checkpoint_bytes(Path(reference))


def test_a_buffer_the_writer_process_cannot_map_fails_the_write_that_needs_it(tmp_path):
    """A mapping that fails in the process (here: a descriptor of a directory) is answered
    at the write that needs the buffer, as that write's error; the process lives on."""
    import torch

    from shardopt.checkpoint.storage import Job, WriteEntry
    writer = importlib.import_module("shardopt.checkpoint.writer_process")
    buf = writer.PinnedBuffer(4096, torch.uint8, shared=True, lock=False)
    os.close(buf.fd)
    buf.fd = os.open(str(tmp_path), os.O_RDONLY)
    proc = writer.WriterProcess()
    try:
        x = Job("x", [WriteEntry("k", torch.uint8, 4, 0, buf.tensor[:4])])
        with pytest.raises(OSError, match="mapping 4096 bytes of the snapshot failed"):
            proc.write_files(tmp_path, [x], 4, [buf])
        pid = proc.pid
        y = Job("y", [WriteEntry("k", torch.uint8, 3, 0, torch.tensor([97, 98, 99],
                                                                      dtype=torch.uint8))])
        records = proc.write_files(tmp_path, [y], 4, [])
        data = (tmp_path / "y").read_bytes()
        assert data.endswith(b"abc") and records["y"]["size"] == len(data)
        assert not (tmp_path / "x").exists() and proc.pid == pid
    finally:
        proc.close()
        buf.release()


def test_a_killed_writer_process_fails_that_save_only(trained_model, tmp_path, monkeypatch):
    """The writer process is SIGKILLed in the middle of a save: that save fails on wait()
    naming the process, nothing is committed, and the next save starts a new one."""
    model, opt = trained_model
    checkpoint.save(tmp_path, model, opt, step=1, blocking=False).wait()
    pid = _writer(opt).pid
    assert pid is not None and _running(pid)
    real = transfer.recv

    def killed_while_writing(sock):  # the request is sent; the answer never comes
        os.kill(pid, signal.SIGKILL)
        return real(sock)

    monkeypatch.setattr(transfer, "recv", killed_while_writing)
    handle = checkpoint.save(tmp_path, model, opt, step=2, blocking=False)
    with pytest.raises(CheckpointError, match="writer process failed"):
        handle.wait()
    monkeypatch.undo()
    assert checkpoint.latest(tmp_path) == str(tmp_path / "step_00000001")
    reference = checkpoint.save(tmp_path / "sync", model, opt, step=2)
    path = checkpoint.save(tmp_path, model, opt, step=2, blocking=False).wait()
    assert _writer(opt).pid != pid
    assert checkpoint_bytes(Path(path)) == checkpoint_bytes(Path(reference))


def test_the_writer_process_names_the_file_it_could_not_write(trained_model, tmp_path,
                                                              monkeypatch):
    """An error inside the writer process (here: the file exists already) comes back as
    the save's error, naming the file."""
    model, opt = trained_model
    save_module = importlib.import_module(SAVE_MODULE)
    real = save_module.write_rank_files

    def clash(tmp, jobs, *args, **kwargs):
        (tmp / jobs[0].name).write_bytes(b"in the way")
        return real(tmp, jobs, *args, **kwargs)

    monkeypatch.setattr(save_module, "write_rank_files", clash)
    handle = checkpoint.save(tmp_path, model, opt, step=2, blocking=False)
    with pytest.raises(CheckpointError, match=r"FileExistsError.*\.safetensors"):
        handle.wait()
    assert checkpoint.latest(tmp_path) is None


def test_a_block_of_more_pieces_than_one_write_call_takes(tmp_path):
    """1,500 params of 8 elements: one 8 MiB block of the model file holds 1,500 pieces, more
    than a vectored write takes at once (IOV_MAX, 1,024 on Linux). The writer process writes
    it in several calls, and the checkpoint is the synchronous save's."""
    import torch
    from torch import nn

    from shardopt import DistributedOptimizer, OptimizerConfig

    torch.manual_seed(0)
    model = nn.ParameterList(nn.Parameter(torch.randn(8)) for _ in range(1500))
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-2))
    sum((p * p).sum() for p in model).backward()
    opt.step()
    sync = checkpoint.save(tmp_path / "sync", model, opt, step=1)
    asyn = checkpoint.save(tmp_path / "async", model, opt, step=1, blocking=False).wait()
    a, b = checkpoint_bytes(Path(sync)), checkpoint_bytes(Path(asyn))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], name
