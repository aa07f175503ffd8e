"""save: collective, atomic, verified checkpoints.

Save schedule (collective over the optimizer's DP group):

1. Every rank checks the arguments; DP rank 0 also locks the root, cleans
   stale temporary directories and creates ``root/.tmp-step_XXXXXXXX-<id>``
   (:mod:`.commit`). Exchange: every rank learns the directory, or every
   rank raises.
2. Every rank writes its own chunks into its ``model``, ``optim`` (main
   params), ``exp_avg``, ``exp_avg_sq`` and ``rng`` safetensors files there
   (large kinds split into parts of about equal size, up to ``io_threads``
   files in all), all at once (hashing fixed-size blocks as it writes), fsyncs
   them and the directory. Exchange: file records (sizes, block hashes, chunk lists), or
   every rank raises and rank 0 removes the temporary directory.
3. Rank 0 writes ``manifest.json`` and commits: rename to ``step_XXXXXXXX``
   (replacing an abandoned branch after a rollback), point ``latest`` at it,
   apply retention. Exchange: every rank learns whether the commit happened.

Each phase catches any exception and reports it in its exchange, so a rank
that fails (disk full, permission denied, a bug) never leaves the others
waiting in a collective: all of them raise :class:`CheckpointError`.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from .. import comm
from ..layout import STATE_NAMES
from ..muon import MOMENTUM
from ..optimizer import DistributedOptimizer
from . import background, commit, state, writer_process
from .background import SaveHandle
from .agree import agree
from .config import CheckpointConfig, settings
from .format import (FORMAT_NAME, FORMAT_VERSION, MAX_PARTS, OPTIMIZER_KIND, data_file_name,
                     manifest_checksum, state_file_kind, step_dir_name)
from .storage import (WriteEntry, entry_bytes, part_counts, split_entries, write_file,
                      write_scratch)
from .drain import Drain
from .snapshot import Job
from .transfer import io_threads as resolve_threads
from .transfer import run_parallel
from ..errors import CheckpointError


def _rng_entries() -> list[WriteEntry]:
    t = torch.get_rng_state()
    out = [WriteEntry("torch_cpu", torch.uint8, t.numel(), 0, t)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        t = torch.cuda.get_rng_state()
        out.append(WriteEntry("torch_cuda", torch.uint8, t.numel(), 0, t))
    return out


def _non_str_key(obj: Any, where: str = "extra") -> str | None:
    """Where ``obj`` has a dict key JSON would turn into a string (``{0: 5}`` comes back as
    ``{"0": 5}``), or None."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, str):
                return f"{where} has key {key!r} ({type(key).__name__})"
            found = _non_str_key(value, f"{where}[{key!r}]")
            if found:
                return found
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            found = _non_str_key(value, f"{where}[{i}]")
            if found:
                return found
    return None


def _check_save_args(step: Any, extra: Any) -> dict[str, Any]:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step must be an int >= 0, got {step!r}")
    bad_key = _non_str_key(extra)
    if bad_key:
        raise CheckpointError(f"extra is stored as JSON, whose keys are strings: {bad_key}, "
                              "which would come back as a string; use string keys")
    try:
        extra = json.loads(json.dumps(extra if extra is not None else {}))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra must be JSON-serialisable: {e}") from None
    if not isinstance(extra, dict):
        raise CheckpointError(f"extra must be a dict, got {type(extra).__name__}")
    return extra


def save(
    root: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: DistributedOptimizer,
    step: int,
    extra: dict[str, Any] | None = None,
    *,
    blocking: bool = True,
    keep_last: int | None = None,
    config: CheckpointConfig | None = None,
) -> str | SaveHandle:
    """Collective. Save ``model`` and ``optimizer`` as ``root/step_{step:08d}``; return its path.

    ``extra`` must be JSON-serialisable (data position, scheduler state, ...).
    ``keep_last`` deletes older committed checkpoints beyond the newest ``k``
    (never the one just saved). Committed checkpoints of steps ``>= step`` (left by a run
    this one rolled back from) are replaced when this one commits, never before (see
    :mod:`.commit`); a run that did not resume from ``root`` (``checkpoint.load``) at or
    before ``step`` is refused such a save unless ``config.rollback``. ``config`` sets the
    rest (threads, block size, staging, snapshot: :class:`~.config.CheckpointConfig`). On
    any failure of any rank every rank raises :class:`CheckpointError` and nothing is
    committed.

    ``blocking=False``: return a :class:`~.background.SaveHandle` at once; the state is
    copied (:mod:`.snapshot`), written and committed in the background (:mod:`.background`)
    and the files hold exactly the state at the call. A save while an asynchronous one of
    the optimizer is in flight waits for it (``config.if_busy="wait"``) or fails on every
    rank (``"error"``); an error of that earlier save nobody has seen fails this one.
    ``config.snapshot`` (GPU only): where the copy goes, ``"host"`` or ``"device_staged"``;
    :func:`~.prepare.prepare` allocates it ahead of the first such save.
    """
    dp = optimizer.shard_state.dp
    optimizer.shard_state.finish_param_sync()  # the params as the last step left them
    root = Path(root)
    what = f"saving step {step!r} to {root}"
    staged: commit.Staged | None = None
    saves = background.of(optimizer)
    try:
        error, extra_obj, threads, cfg = None, None, 1, CheckpointConfig()
        contents, drain = [], None
        base: Callable[[], dict[str, Any]] = dict
        try:
            cfg = settings(config, blocking=blocking, keep_last=keep_last)
            error = saves.settle(cfg.if_busy)
            if error is None:
                frozen = state.frozen_tensors(model, optimizer, check_model=True)
                optimizer.shard_state.reseed_written()  # main params: the weights written since
                extra_obj = _check_save_args(step, extra)
                threads = resolve_threads(cfg.io_threads)
                if blocking:
                    contents = [_rng_job(optimizer), *_state_contents(optimizer, frozen)]
                else:  # split into files later, in the background
                    contents, drain = _take_snapshot(saves, optimizer, frozen,
                                                     cfg.snapshot == "device_staged")
                if dp.rank == 0:
                    base = _manifest_base(optimizer, step, extra_obj, frozen)
                    resumed = optimizer.shard_state.loaded_from
                    staged = commit.begin(root, step_dir_name(step), 0 if cfg.rollback else
                                          commit.resumed_step(resumed, root))
        except Exception as e:  # noqa: BLE001 - reported to every rank by agree
            error = e
        payloads = agree(dp, error, what, (step if error is None else None, blocking,
                                           staged.tmp.name if staged else None))
        # A rank that blocks and one that does not would wait in different collectives.
        if any((s, b) != (step, blocking) for s, b, _ in payloads):
            raise CheckpointError(f"saving to {root} failed: ranks disagree on the step or on "
                                  f"blocking ({[(s, b) for s, b, _ in payloads]})")
        tmp = root / payloads[0][2]
        path = str(root / step_dir_name(step))
        rank = dp.rank
        if blocking:
            _write_and_commit(tmp, staged, _split(contents, rank, threads), base, dp, cfg,
                              keep_last, threads, optimizer.shard_state.device, step, what)
            return path
        try:
            group = saves.coordination_group(dp)
        except Exception as e:  # noqa: BLE001 - a peer died or hung: no exchange can say so
            raise CheckpointError(f"{what} failed: [dp rank {dp.rank}] creating the process "
                                  "group of background saves failed (did another rank die?): "
                                  f"{type(e).__name__}: {e}") from e
        owned, staged = staged, None  # the background thread removes it if it fails

        # A staged device snapshot goes out through pinned staging, on a stream of its own:
        # the background thread's current stream would be training's default stream.
        staged_out = (cfg.snapshot == "device_staged"
                      and optimizer.shard_state.device.type == "cuda")
        device = optimizer.shard_state.device if staged_out else torch.device("cpu")
        stream = torch.cuda.Stream(device) if staged_out else None
        snap = saves.snapshot

        def work(group: comm.DPGroup) -> None:
            try:
                drain.run()  # the snapshot's copies, then the state may change freely
                if staged_out:  # through one small page-locked buffer
                    nbytes, slot_bytes = _staging_layout(cfg)
                    through = functools.partial(saves.writer.stream_files,
                                                staging=snap.staging(nbytes),
                                                slot_bytes=slot_bytes)
                else:  # from the host copy
                    through = functools.partial(saves.writer.write_files,
                                                buffers=snap.host_buffers())
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    _write_and_commit(tmp, owned, _split(contents, rank, threads), base,
                                      group, cfg, keep_last, threads, device, step, what,
                                      through)
            finally:
                if owned is not None:
                    commit.abort(owned)
        drain.attach(optimizer)  # the state's next write waits until the copies have it
        try:
            return saves.start(path, work, group)
        except BaseException:
            drain.close()
            raise
    finally:
        if staged is not None:
            commit.abort(staged)


def _staging_layout(cfg: CheckpointConfig) -> tuple[int, int]:
    """Bytes of the staging buffer a ``device_staged`` save streams through, and of its
    slots."""
    slot_bytes, slots = writer_process.stream_slots(cfg.staging_bytes, cfg.block_bytes)
    return slot_bytes * slots, slot_bytes


# Writes a rank's files (file name, entries) into a directory in blocks of the given size by
# the writer process, returning their records, or None where that process cannot.
Through = Callable[[Path, list[tuple[str, list[WriteEntry]]], int], "dict[str, dict] | None"]


def _write_and_commit(tmp: Path, staged: commit.Staged | None, jobs: list[Job],
                      base: Callable[[], dict[str, Any]], dp: comm.DPGroup,
                      cfg: CheckpointConfig, keep_last: int | None,
                      threads: int, device: torch.device, step: int, what: str,
                      through: Through | None = None) -> None:
    """Collective over ``dp``. Phases 2 and 3: write this rank's files (``through`` the
    writer process where it can), then (rank 0) the manifest and the commit."""
    records, error = {}, None
    try:
        records = _write_rank_files(tmp, jobs, cfg.block_bytes, cfg.staging_bytes, device,
                                    through)
    except Exception as e:  # noqa: BLE001
        error = e
    all_records = agree(dp, error, what, records)

    error = None
    if dp.rank == 0:
        try:
            files = {name: rec for recs in all_records for name, rec in recs.items()}
            commit.commit(staged, step_dir_name(step), _manifest_text(base(), files),
                          keep_last)
        except Exception as e:  # noqa: BLE001
            error = e
    agree(dp, error, f"committing {tmp.parent / step_dir_name(step)}")


def _rng_job(opt: DistributedOptimizer) -> Job:
    rank = opt.shard_state.dp.rank
    return Job(data_file_name("rng", rank), _rng_entries())  # new tensors: no snapshot


def _state_contents(opt: DistributedOptimizer, frozen: dict[str, torch.Tensor]) -> list[Job]:
    """Coordinator-free. What this rank writes of the state, by file kind."""
    contents = {"model": state.model_entries(opt, frozen)}
    for name in (*STATE_NAMES, MOMENTUM):
        contents.setdefault(state_file_kind(name), []).extend(state.optim_entries(opt, name))
    return [Job(kind, entries) for kind, entries in contents.items()]


def _take_snapshot(saves: background.Saves, opt: DistributedOptimizer,
                   frozen: dict[str, torch.Tensor], on_device: bool) -> tuple[list[Job], Drain]:
    """Coordinator-free. The RNG state and :func:`_state_contents` in the optimizer's
    snapshot, and the drain that copies it there: a repeat of the previous save's copies
    where the state lives in tensors of the same sizes (:meth:`.Snapshot.retake`), else
    planned anew."""
    snap, sources = saves.snapshot, state.sources(opt, frozen)
    # Buffers (not params) are what a forward may update in place while the copies run.
    hot = {t.untyped_storage().data_ptr() for t in frozen.values()
           if not isinstance(t, torch.nn.Parameter)} if opt.shard_state.dp.rank == 0 else set()
    again = snap.retake(sources, on_device, hot)
    jobs, drain = again if again is not None else \
        snap.take(_state_contents(opt, frozen), on_device, sources, hot)
    return [_rng_job(opt), *jobs], drain


def _split(contents: list[Job], rank: int, threads: int) -> list[Job]:
    """Coordinator-free. The files this rank writes and their entries, the largest first.

    A file takes one writer at a time (the kernel locks it for each write), so the data is
    split into up to ``threads`` files of about equal size (a kind into parts where it is
    larger than the others).
    """
    rng, *kinds = contents
    counts = part_counts({k.name: entry_bytes(k.entries) for k in kinds},
                         min(threads, MAX_PARTS))
    jobs = [rng]
    for kind in kinds:
        runs = split_entries(kind.entries, counts[kind.name]) or [[]]
        jobs += [Job(data_file_name(kind.name, rank, p), run) for p, run in enumerate(runs)]
    jobs.sort(key=lambda job: -entry_bytes(job.entries))  # the largest files start first
    return jobs


def _write_rank_files(tmp: Path, jobs: list[Job], block_bytes: int, staging_bytes: int,
                      device: torch.device, through: Through | None = None) -> dict[str, dict]:
    """Coordinator-free. Write and fsync this rank's files, all at once; return their records.

    The files are written side by side: ``through`` the writer process
    (:mod:`.writer_process`: it returns None where it cannot), else each by
    one thread each that copies blocks from ``device``, hashes and writes them.
    """
    records = None if through is None else \
        through(tmp, [(job.name, job.entries) for job in jobs], block_bytes)
    if records is None:
        scratch = [write_scratch(block_bytes, staging_bytes // len(jobs), device) for _ in jobs]
        records = {}

        def write(job: Job, slot: int) -> None:
            records[job.name] = write_file(str(tmp / job.name), job.entries, block_bytes,
                                           scratch[slot])

        run_parallel(jobs, write, len(jobs))
    for job in jobs:
        if not job.name.startswith("rng-"):
            records[job.name]["chunks"] = [[e.key, e.offset, e.numel] for e in job.entries]
    commit.fsync_dir(tmp)  # the directory entries, so the rename publishes whole files
    return {name: records[name] for name in sorted(records)}


def _manifest_base(opt: DistributedOptimizer, step: int, extra: dict[str, Any],
                   frozen: dict[str, torch.Tensor]) -> Callable[[], dict[str, Any]]:
    """Everything the manifest holds but the file records, as it is at the call: what can
    change later is copied now (new objects throughout: nothing the caller changes later
    reaches it); the returned function builds the params table from those copies, in an
    asynchronous save's background thread rather than in the training loop's."""
    head = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "step": step,
        "dp_size": opt.shard_state.dp.size,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "torch_version": torch.__version__,
        "optimizer": {"kind": OPTIMIZER_KIND, "state": list(STATE_NAMES),
                      "moments": {k: e.to_json() for k, e in state.encodings(opt).items()}},
        "config": opt.config.to_dict(),
    }
    facts = state.ParamFacts.capture(opt, frozen)
    tail = {"aliases": dict(opt.shard_state.aliases), "extra": extra}
    return lambda: {**head, "params": state.describe(opt, facts), **tail}


def _manifest_text(base: dict[str, Any], files: dict[str, dict]) -> bytes:
    """The manifest, one line per top-level field and per param and file record, every piece
    by ``json``'s C encoder (``indent=`` selects the pure-Python one, whose GIL time an
    asynchronous save's commit would take from the training thread)."""
    # The checksum covers what a reader parses.
    manifest = json.loads(json.dumps({**base, "files": files}))
    manifest["checksum"] = manifest_checksum(manifest)

    def field(key: str, value: Any) -> str:
        if key in ("params", "files") and isinstance(value, dict) and value:
            rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            return f" {json.dumps(key)}: {{\n{rows}\n }}"
        return f" {json.dumps(key)}: {json.dumps(value)}"
    return ("{\n" + ",\n".join(field(k, v) for k, v in manifest.items()) + "\n}\n").encode()
