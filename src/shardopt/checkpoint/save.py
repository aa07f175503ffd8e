"""save: collective, atomic, verified checkpoints. The schedule (collective over the DP group):

1. Every rank checks the arguments; DP rank 0 also locks the root, cleans stale temporary
   directories and creates ``root/.tmp-step_XXXXXXXX-<id>`` (:mod:`.commit`). Exchange:
   every rank learns the directory, or every rank raises.
2. Every rank writes its chunks into its ``model``, ``optim`` (main params), ``exp_avg``,
   ``exp_avg_sq`` and ``rng`` safetensors files there (large kinds split into parts of
   about equal size, up to ``io_threads`` files in all), side by side, hashing fixed-size
   blocks as it writes, and fsyncs them and the directory. Exchange: the file records
   (sizes, block hashes, chunk lists), or every rank raises and rank 0 removes the directory.
3. Rank 0 writes ``manifest.json`` and commits: rename to ``step_XXXXXXXX`` (replacing an
   abandoned branch after a rollback), point ``latest`` at it, apply retention. Exchange:
   every rank learns whether the commit happened.

Each phase reports any exception in its exchange, so a rank that fails (disk full, a bug)
never leaves the others waiting in a collective: all of them raise :class:`CheckpointError`.
With ``blocking=False`` phases 2 and 3 run in the background (:mod:`.background`).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import comm
from ..layout import STATE_NAMES
from ..optimizer import DistributedOptimizer
from . import background, commit, state
from .agree import agree
from .background import SaveHandle
from .config import CheckpointConfig, settings
from .format import (FORMAT_NAME, FORMAT_VERSION, MAX_PARTS, OPTIMIZER_KIND, data_file_name,
                     manifest_checksum, step_dir_name)
from .snapshot import Taken
from .storage import (Job, WriteEntry, entry_bytes, part_counts, split_entries, write_file,
                      write_scratch)
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

    ``extra`` must be JSON-serialisable. ``keep_last`` deletes older committed checkpoints
    beyond the newest ``k`` (never the one just saved). Committed checkpoints of steps
    ``>= step`` (an abandoned branch) are replaced when this one commits (:mod:`.commit`); a
    run that did not resume from ``root`` at or before ``step`` is refused such a save unless
    ``config.rollback``. On any failure of any rank every rank raises
    :class:`CheckpointError` and nothing is committed.

    ``blocking=False``: return a :class:`~.background.SaveHandle` at once; the files hold
    exactly the state at the call, copied (:mod:`.snapshot`), written and committed in the
    background. A save while one of the optimizer is in flight waits for it
    (``config.if_busy="wait"``) or fails on every rank (``"error"``); an error of that
    earlier save nobody has seen fails this one.
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
                    contents = [_rng_job(optimizer), *state.contents(optimizer, frozen)]
                else:  # split into files later, in the background
                    taken = _take_snapshot(saves, optimizer, frozen, cfg)
                    contents, drain = taken.jobs, taken.drain
                if dp.rank == 0:
                    base = _manifest_base(optimizer, step, extra_obj, frozen)
                    resumed = optimizer.shard_state.loaded_from
                    staged = commit.begin(root, step_dir_name(step), 0 if cfg.rollback else
                                          commit.resumed_step(resumed, root))
        except Exception as e:  # noqa: BLE001 - reported to every rank by agree
            error = e
        mine = _Start(step if error is None else None, blocking,
                      staged.tmp.name if staged else None)
        starts = agree(dp, error, what, mine)
        # A rank that blocks and one that does not would wait in different collectives.
        if any((s.step, s.blocking) != (step, blocking) for s in starts):
            raise CheckpointError(f"saving to {root} failed: ranks disagree on the step or on "
                                  f"blocking ({[(s.step, s.blocking) for s in starts]})")
        tmp = root / starts[0].tmp
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
        through = functools.partial(saves.writer.write_files,
                                    buffers=saves.snapshot.host_buffers())

        def work(group: comm.DPGroup) -> None:
            try:
                drain.run()  # the snapshot's copies, then the state may change freely
                _write_and_commit(tmp, owned, _split(contents, rank, threads), base, group,
                                  cfg, keep_last, threads, torch.device("cpu"), step, what,
                                  through)
            finally:
                if owned is not None:
                    commit.abort(owned)
        drain.attach(optimizer)  # the state's next write waits until the copies have it
        try:
            saves.pending = SaveHandle(path, work, group)
            return saves.pending
        except BaseException:
            drain.close()
            raise
    finally:
        if staged is not None:
            commit.abort(staged)


@dataclass(frozen=True)
class _Start:
    """What each rank brings to a save's first exchange: its step (None where it failed),
    whether it blocks, and (DP rank 0) the temporary directory's name."""

    step: int | None
    blocking: bool
    tmp: str | None


# The writer process writing a rank's files (directory, jobs, block bytes): their records,
# or None where it cannot.
Through = Callable[[Path, list[Job], int], "dict[str, dict] | None"]


def _write_and_commit(tmp: Path, staged: commit.Staged | None, jobs: list[Job],
                      base: Callable[[], dict[str, Any]], dp: comm.DPGroup,
                      cfg: CheckpointConfig, keep_last: int | None,
                      threads: int, device: torch.device, step: int, what: str,
                      through: Through | None = None) -> None:
    """Collective over ``dp``. Phases 2 and 3: write this rank's files (``through`` the
    writer process where it can), then (rank 0) the manifest and the commit."""
    records, error = {}, None
    try:
        records = write_rank_files(tmp, jobs, cfg.block_bytes, cfg.staging_bytes, device,
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


def _take_snapshot(saves: background.Saves, opt: DistributedOptimizer,
                   frozen: dict[str, torch.Tensor], cfg: CheckpointConfig) -> Taken:
    """Coordinator-free. The RNG state and :func:`.state.contents` in the optimizer's
    snapshot, and its drain: the previous save's copies repeated where they fit
    (:meth:`.Snapshot.retake`), else planned anew."""
    snap, sources = saves.snapshot, state.sources(opt, frozen)
    # Buffers (not params) are what a forward may update in place while the copies run.
    hot = {t.untyped_storage().data_ptr() for t in frozen.values()
           if not isinstance(t, torch.nn.Parameter)} if opt.shard_state.dp.rank == 0 else set()
    taken = snap.retake(sources, cfg, hot) or snap.take(state.contents(opt, frozen), cfg,
                                                         sources, hot)
    return Taken([_rng_job(opt), *taken.jobs], taken.drain)


def _split(contents: list[Job], rank: int, threads: int) -> list[Job]:
    """Coordinator-free. The files this rank writes, the largest first: up to ``threads``
    files of about equal size (a file takes one writer at a time), a kind split into parts
    where it is larger than the others."""
    rng, *kinds = contents
    counts = part_counts({k.name: entry_bytes(k.entries) for k in kinds},
                         min(threads, MAX_PARTS))
    jobs = [rng]
    for kind in kinds:
        runs = split_entries(kind.entries, counts[kind.name]) or [[]]
        jobs += [Job(data_file_name(kind.name, rank, p), run) for p, run in enumerate(runs)]
    jobs.sort(key=lambda job: -entry_bytes(job.entries))  # the largest files start first
    return jobs


def write_rank_files(tmp: Path, jobs: list[Job], block_bytes: int, staging_bytes: int,
                     device: torch.device, through: Through | None = None) -> dict[str, dict]:
    """Coordinator-free. Write and fsync this rank's files, side by side; return their
    records. ``through`` the writer process where it can (:mod:`.writer_process`), else one
    thread per file copies blocks from ``device``, hashes and writes them."""
    records = None if through is None else through(tmp, jobs, block_bytes)
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
    """Everything the manifest holds but the file records, as at the call: what can change
    is copied now; the returned function builds the params table from the copies (in an
    asynchronous save's background thread, not the training loop's)."""
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
    """The manifest, one line per top-level field and per param and file record, by
    ``json``'s C encoder (``indent=`` selects the pure-Python one, whose GIL time an
    asynchronous commit would take from training). The checksum covers what a reader parses."""
    manifest = json.loads(json.dumps({**base, "files": files}))
    manifest["checksum"] = manifest_checksum(manifest)

    def field(key: str, value: Any) -> str:
        if key in ("params", "files") and isinstance(value, dict) and value:
            rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            return f" {json.dumps(key)}: {{\n{rows}\n }}"
        return f" {json.dumps(key)}: {json.dumps(value)}"
    return ("{\n" + ",\n".join(field(k, v) for k, v in manifest.items()) + "\n}\n").encode()
