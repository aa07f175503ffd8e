"""save / load / latest: collective orchestration of atomic, verified checkpoints.

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
3. Rank 0 writes ``manifest.json`` and commits: rename to ``step_XXXXXXXX``,
   point ``latest`` at it, apply retention. Exchange: every rank learns
   whether the commit happened.

Each phase catches any exception and reports it in its exchange, so a rank
that fails (disk full, permission denied, a bug) never leaves the others
waiting in a collective: all of them raise :class:`CheckpointError`.

Load schedule (collective): every rank reads and validates the manifest,
checks it against the model and optimizer, opens the files and cross-checks
their headers, plans the reads that cover its own shard, reads the Adam moments
into newly allocated tensors in one pass that checks each block's hash as it
reads it, verifies the hashes of every other block it will read and reads its
RNG state. Exchange: only when every rank found everything in order does any
rank write into existing model or optimizer tensors (or adopt the new moments);
otherwise every rank raises and nothing has changed.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import comm
from ..config import GROUP_KEYS
from ..optimizer import STATE_NAMES, DistributedOptimizer
from ..pinned import PinnedBuffer
from . import commit, state
from .blocks import read_blocks, verify_blocks
from .format import (DEFAULT_BLOCK_BYTES, FORMAT_NAME, FORMAT_VERSION, LATEST, MANIFEST,
                     MAX_BLOCK_BYTES, MAX_PARTS, OPTIMIZER_KIND, STEP_DIR, TORCH_DTYPE_NAMES,
                     FormatError, StoredChunk, data_file_name, manifest_checksum,
                     state_file_kind, step_dir_name)
from .manifest import check_optimizer, read_manifest, validate_manifest
from .planner import ChunkIndex
from .storage import (FILE_THREADS, FileReader, Segment, WriteEntry, entry_bytes, part_counts,
                      read_scratch, split_entries, write_file, write_scratch)
from .transfer import io_threads as resolve_threads
from .transfer import read_segments, run_parallel

# Host memory a save or load stages data through at most (pinned when the optimizer is on a GPU).
STAGING_BYTES = 128 << 20


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file, FQN or rank."""


@dataclass(frozen=True)
class LoadInfo:
    """What :func:`load` restored."""

    step: int
    extra: dict[str, Any]
    path: str
    dp_size_saved: int


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"


def _agree(dp: comm.DPGroup, error: BaseException | None, what: str,
           payload: Any = None) -> list[Any]:
    """Collective. Every rank's ``payload``; the same :class:`CheckpointError` on every
    rank if any rank brings an error (chained to the local one where there is one)."""
    gathered = comm.all_gather_objects((payload, None if error is None else _describe(error)), dp)
    failed: dict[str, list[int]] = {}
    for r, (_, e) in enumerate(gathered):
        if e is not None:
            failed.setdefault(e, []).append(r)
    if failed:
        # The same problem seen by many ranks is reported once, with its ranks.
        detail = "; ".join(f"[dp rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}] {e}"
                           for e, rs in failed.items())
        raise CheckpointError(f"{what} failed: {detail}") from error
    return [p for p, _ in gathered]


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else f"{g[0]}" for g in runs)


# --------------------------------------------------------------------------- latest
def latest(root: str | os.PathLike) -> str | None:
    """Coordinator-free. Path of the newest committed checkpoint under ``root``, or None.

    Follows the ``latest`` marker when it names a complete checkpoint, otherwise
    the highest-numbered complete ``step_*`` directory. Temporary directories of
    unfinished saves are never returned.
    """
    root = Path(root)
    try:
        with open(root / LATEST, "rb") as f:
            name = f.read(256).decode("ascii", "replace").strip()
    except OSError:
        name = ""
    if STEP_DIR.fullmatch(name) and commit.is_complete(root / name):
        return str(root / name)
    steps = commit.complete_steps(root) if root.is_dir() else []
    return str(steps[-1]) if steps else None


# ----------------------------------------------------------------------------- save
def _rng_entries() -> list[WriteEntry]:
    out = [WriteEntry("torch_cpu", torch.uint8, torch.get_rng_state().numel(), 0,
                      torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        t = torch.cuda.get_rng_state()
        out.append(WriteEntry("torch_cuda", torch.uint8, t.numel(), 0, t))
    return out


def _check_save_args(step: Any, extra: Any, keep_last: Any, block_bytes: Any) -> dict[str, Any]:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step must be an int >= 0, got {step!r}")
    if keep_last is not None and not (isinstance(keep_last, int) and keep_last >= 1):
        raise CheckpointError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
    if not (isinstance(block_bytes, int) and 1 <= block_bytes <= MAX_BLOCK_BYTES):
        raise CheckpointError(f"block_bytes must be in [1, {MAX_BLOCK_BYTES}], got {block_bytes!r}")
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
    keep_last: int | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    staging_bytes: int = STAGING_BYTES,
    io_threads: int | None = None,
) -> str:
    """Collective. Save ``model`` and ``optimizer`` as ``root/step_{step:08d}``; return its path.

    ``extra`` must be JSON-serialisable (data position, scheduler state, ...).
    ``keep_last`` deletes older committed checkpoints beyond the newest ``k``
    (never the one just saved). Committed checkpoints of steps ``>= step`` (left by a run
    this one rolled back from) are replaced when this one commits, never before (see
    :mod:`.commit`). ``io_threads`` (default: this process's share of
    the node's CPUs, 2-16) is how many files of about equal size each rank's data
    is split into and written at once. On any failure of any rank every rank
    raises :class:`CheckpointError` and nothing is committed.
    """
    dp = optimizer.dp
    optimizer.finish_param_sync()  # frozen and trainable params as the last step left them
    root = Path(root)
    what = f"saving step {step!r} to {root}"
    staged: commit.Staged | None = None
    try:
        error, extra_obj, threads = None, None, 1
        try:
            extra_obj = _check_save_args(step, extra, keep_last, block_bytes)
            threads = resolve_threads(io_threads)
            if dp.rank == 0:
                staged = commit.begin(root, step_dir_name(step))
        except Exception as e:  # noqa: BLE001 - reported to every rank by _agree
            error = e
        payloads = _agree(dp, error, what,
                          (step if error is None else None, staged.tmp.name if staged else None))
        if any(s != step for s, _ in payloads):
            raise CheckpointError(f"saving to {root} failed: ranks disagree on the step "
                                  f"({[s for s, _ in payloads]})")
        tmp = root / payloads[0][1]

        records, error = {}, None
        try:
            records = _write_rank_files(tmp, model, optimizer, block_bytes, staging_bytes,
                                        threads)
        except Exception as e:  # noqa: BLE001
            error = e
        all_records = _agree(dp, error, what, records)

        error = None
        if dp.rank == 0:
            try:
                files = {name: rec for recs in all_records for name, rec in recs.items()}
                text = _manifest_text(model, optimizer, step, files, extra_obj)
                commit.commit(staged, step_dir_name(step), text, keep_last)
            except Exception as e:  # noqa: BLE001
                error = e
        _agree(dp, error, f"committing {root / step_dir_name(step)}")
    finally:
        if staged is not None:
            commit.abort(staged)
    return str(root / step_dir_name(step))


def _write_rank_files(tmp: Path, model: torch.nn.Module, opt: DistributedOptimizer,
                      block_bytes: int, staging_bytes: int, threads: int) -> dict[str, dict]:
    """Coordinator-free. Write and fsync this rank's files, all at once; return their records.

    A file takes one writer at a time (the kernel locks it for each write), so the data is
    split into up to ``threads`` files of about equal size (a kind into parts where it is
    larger than the others), written side by side, each by ``FILE_THREADS`` thread(s)
    that copy blocks from the device, hash and write them.
    """
    r = opt.dp.rank
    contents = {"model": state.model_entries(model, opt)}
    for name in STATE_NAMES:
        kind = state_file_kind(name, FORMAT_VERSION)
        contents.setdefault(kind, []).extend(state.optim_entries(opt, name))
    counts = part_counts({k: entry_bytes(v) for k, v in contents.items()},  # parts: version 3
                         min(threads, MAX_PARTS) if FORMAT_VERSION >= 3 else 0)
    jobs = [(data_file_name("rng", r), _rng_entries())]
    for kind, entries in contents.items():
        runs = split_entries(entries, counts[kind]) or [[]]
        jobs += [(data_file_name(kind, r, p), run) for p, run in enumerate(runs)]
    jobs.sort(key=lambda job: -entry_bytes(job[1]))  # the largest files start first
    scratch = [write_scratch(block_bytes, staging_bytes // len(jobs), opt.device,
                             threads=FILE_THREADS) for _ in jobs]
    records: dict[str, dict] = {}

    def write(job, slot):
        name, entries = job
        rec = write_file(str(tmp / name), entries, block_bytes, scratch[slot], FILE_THREADS)
        if not name.startswith("rng-"):
            rec["chunks"] = [[e.key, e.offset, e.numel] for e in entries]
        records[name] = rec

    run_parallel(jobs, write, len(jobs))
    commit.fsync_dir(tmp)  # the directory entries, so the rename publishes whole files
    return {name: records[name] for name in sorted(records)}


def _manifest_text(model: torch.nn.Module, opt: DistributedOptimizer, step: int,
                   files: dict[str, dict], extra: dict[str, Any]) -> bytes:
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "step": step,
        "dp_size": opt.dp.size,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "torch_version": torch.__version__,
        "optimizer": {"kind": OPTIMIZER_KIND, "state": list(STATE_NAMES)},
        "config": opt.config.to_dict(),
        "params": state.describe(model, opt),
        "aliases": dict(opt.aliases),
        "files": files,
        "extra": extra,
    }
    manifest = json.loads(json.dumps(manifest))  # the checksum covers what a reader parses
    manifest["checksum"] = manifest_checksum(manifest)
    return json.dumps(manifest, indent=1).encode()


# ----------------------------------------------------------------------------- load
def resolve(root_or_path: str | os.PathLike) -> Path:
    """Coordinator-free. A checkpoint directory, given itself or a root holding some."""
    p = Path(root_or_path)
    if os.path.lexists(p / MANIFEST):
        return p
    if not p.exists():
        raise CheckpointError(f"no checkpoint at {p}: the path does not exist")
    found = latest(p)
    if found is None:
        raise CheckpointError(f"no committed checkpoint in {p} (no {MANIFEST} found)")
    return Path(found)


@dataclass
class _Requests:
    items: list[tuple[state.Destination, list[tuple[Any, torch.dtype]]]]
    casts: bool


@dataclass
class _Plan:
    """Everything a rank needs to load, gathered before any tensor is written."""

    path: Path
    manifest: dict[str, Any]
    readers: dict[str, FileReader]
    requests: _Requests
    steps: list[int]
    hparams: list[dict[str, Any]]
    rng: dict[str, torch.Tensor] | None
    moments: tuple[list[torch.Tensor], list[torch.Tensor]]
    pinned: list[PinnedBuffer]

    def close(self) -> None:
        for r in self.readers.values():
            r.close()


def load(
    root_or_path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: DistributedOptimizer,
    low_memory_resume: bool | None = None,
    verify: bool = True,
    staging_bytes: int = STAGING_BYTES,
    io_threads: int | None = None,
) -> LoadInfo:
    """Collective. Restore ``model`` and ``optimizer`` from a checkpoint saved at any DP size.

    ``low_memory_resume`` (default: the optimizer config's) keeps the Adam moments
    in host memory until the first ``step()``. ``verify`` checks the content hash
    of every block read. ``io_threads`` (default as for :func:`save`) is how many
    blocks a rank reads at once. On any error every rank raises a
    :class:`CheckpointError` and model and optimizer are left as they were.
    """
    dp = optimizer.dp
    optimizer.finish_param_sync()  # no all-gather may still write into params being loaded
    if low_memory_resume is None:
        low_memory_resume = optimizer.config.low_memory_resume
    host = bool(low_memory_resume)
    plan, error, threads = None, None, 1
    try:
        threads = resolve_threads(io_threads)
        plan = _prepare(root_or_path, model, optimizer, verify, host, staging_bytes, threads)
    except Exception as e:  # noqa: BLE001 - reported to every rank by _agree
        error = e
    try:
        _agree(dp, error, f"loading {root_or_path}")
    except BaseException:
        if plan is not None:
            plan.close()
        raise
    assert plan is not None

    # Every check passed on every rank: from here on tensors are written.
    error = None
    try:
        segments = [plan.readers[req.file].segment(req, dest.resolve(plan.moments), dtype)
                    for dest, reqs in plan.requests.items for req, dtype in reqs]
        read_segments(segments, read_scratch(staging_bytes, optimizer.device,
                                             plan.requests.casts, threads), threads)
    except Exception as e:  # noqa: BLE001 - the file changed after it was verified
        error = e
    finally:
        plan.close()
    _agree(dp, error, f"reading {plan.path}")

    optimizer._adopt_loaded_state(plan.moments, host, plan.steps, plan.pinned)
    for group, saved in zip(optimizer.param_groups, plan.hparams):
        group.update(saved)  # as torch's load_state_dict does: lr & co. resume as saved
    if plan.rng is not None:
        torch.set_rng_state(plan.rng["torch_cpu"])
        if "torch_cuda" in plan.rng:
            torch.cuda.set_rng_state(plan.rng["torch_cuda"])
    m = plan.manifest
    return LoadInfo(m["step"], dict(m.get("extra") or {}), str(plan.path), m["dp_size"])


def _prepare(root_or_path: str | os.PathLike, model: torch.nn.Module,
             opt: DistributedOptimizer, verify: bool, host: bool,
             staging_bytes: int, threads: int) -> _Plan:
    """Coordinator-free. Every check of a load, and everything it reads before writing."""
    path = resolve(root_or_path)
    manifest = read_manifest(path)
    validate_manifest(manifest, path)
    check_optimizer(manifest, OPTIMIZER_KIND, STATE_NAMES)
    _check_compatible(manifest["params"], model, opt)
    steps = _group_steps(manifest, opt)
    hparams = _group_hyperparameters(manifest, opt)
    moments, pinned, fresh = _moment_tensors(opt, host)
    readers, requests = _plan_reads(path, manifest, model, opt, verify,
                                    moments if fresh else None, staging_bytes, threads)
    try:
        rng = None
        if manifest["dp_size"] == opt.dp.size:
            rng = _read_rng(path, manifest, opt.dp.rank, verify)
    except BaseException:
        for r in readers.values():
            r.close()
        raise
    return _Plan(path, manifest, readers, requests, steps, hparams, rng, moments, pinned)


def _plan_reads(path: Path, manifest: dict, model: torch.nn.Module, opt: DistributedOptimizer,
                verify: bool, fresh_moments: tuple[list[torch.Tensor], list[torch.Tensor]] | None,
                staging_bytes: int, threads: int) -> tuple[dict[str, FileReader], _Requests]:
    """Coordinator-free. Open files, cross-check headers, plan and verify this rank's reads.

    With ``fresh_moments`` (new tensors nobody else sees) and ``verify``, the moments
    are read now, in one pass that checks each block's hash as it reads it; what goes
    into existing tensors is only verified here and read after every rank agreed.
    """
    params = manifest["params"]
    numels = state.stored_numels(params)
    dtypes = {k: torch.float32 for k in numels}
    for fqn, info in params.items():
        dtypes[fqn] = TORCH_DTYPE_NAMES[info["dtype"]]
    files = {n: rec for n, rec in manifest["files"].items() if not n.startswith("rng-")}
    readers: dict[str, FileReader] = {}
    try:
        # Headers are small: read every one to locate chunks, cross-checked with the manifest.
        stored: list[StoredChunk] = []
        for name, rec in files.items():
            readers[name] = FileReader(str(path / name), name, rec)
            stored.extend(readers[name].chunks(dtypes))
        index = ChunkIndex(stored, numels)
        planned = [(d, [(r, dtypes[d.key]) for r in index.plan(d.key, d.want)])
                   for d in state.destinations(model, opt)]
        casts = any(d.dtype != dtype for d, reqs in planned for _, dtype in reqs)
        for name in list(readers):
            if not any(r.file == name for _, reqs in planned for r, _ in reqs):
                readers.pop(name).close()
        checked: dict[str, set[int]] = {}
        if verify and fresh_moments is not None:
            planned, checked = _read_fresh(planned, readers, fresh_moments, staging_bytes,
                                           threads)
        if verify:
            spans: dict[str, list[tuple[int, int]]] = {}
            for _, reqs in planned:
                for r, dtype in reqs:
                    spans.setdefault(r.file, []).append(
                        (r.file_start, r.file_start + r.numel * dtype.itemsize))
            verify_blocks([readers[name].to_verify(sp, skip=checked.get(name, set()))
                           for name, sp in spans.items()], threads)
    except BaseException:
        for r in readers.values():
            r.close()
        raise
    return readers, _Requests(planned, casts)


def _read_fresh(planned: list, readers: dict[str, FileReader], moments: tuple,
                staging_bytes: int, threads: int) -> tuple[list, dict[str, set[int]]]:
    """Read the requests into new moment tensors in one verifying pass over all their files.
    Returns the requests still to be read (in place, after the agreement) and, per file,
    the blocks already hash-checked."""
    segments: dict[str, list[Segment]] = {}
    for d, reqs in planned:
        if d.tensor is None:
            t = d.resolve(moments)
            for r, dtype in reqs:
                segments.setdefault(r.file, []).append(
                    Segment(r.file_start, t.narrow(0, r.dest_start, r.numel), dtype))
    items = {name: readers[name].to_read_fresh(segs, max(8, staging_bytes // 2))
             for name, segs in segments.items()}
    items = {name: item for name, item in items.items() if item is not None}
    checked: dict[str, set[int]] = {}
    if items:
        # One block per thread is staged: at most ``staging_bytes`` in all.
        block = max(f.block_bytes for f, _ in items.values())
        done = read_blocks(list(items.values()), max(1, min(threads, staging_bytes // block)))
        checked = dict(zip(items, done))
    rest = [(d, [(r, dt) for r, dt in reqs if d.tensor is not None or r.file not in checked])
            for d, reqs in planned]
    return [(d, reqs) for d, reqs in rest if reqs], checked


def _read_rng(path: Path, manifest: dict, rank: int, verify: bool) -> dict[str, torch.Tensor]:
    """Coordinator-free. This rank's saved RNG states, checked so that setting them cannot fail."""
    name = f"rng-{rank:05d}.safetensors"
    reader = FileReader(str(path / name), name, manifest["files"][name])
    try:
        if verify:
            reader.verify()
        keys = {c.key for c in reader.header().chunks}
        out = {"torch_cpu": reader.read_tensor("torch_cpu", torch.uint8)}
        if "torch_cuda" in keys and torch.cuda.is_available():
            out["torch_cuda"] = reader.read_tensor("torch_cuda", torch.uint8)
    finally:
        reader.close()
    # Try each state now and put ours back, so that setting it after the load cannot fail.
    for key, (get, put) in {"torch_cpu": (torch.get_rng_state, torch.set_rng_state),
                            "torch_cuda": (torch.cuda.get_rng_state, torch.cuda.set_rng_state)
                            }.items():
        if key in out:
            current = get()
            try:
                put(out[key])
            except (RuntimeError, ValueError) as e:
                raise CheckpointError(f"{path / name}: invalid {key} RNG state ({e})") from None
            finally:
                put(current)
    return out


def _moment_tensors(opt: DistributedOptimizer, host: bool
                    ) -> tuple[tuple[list[torch.Tensor], list[torch.Tensor]],
                               list[PinnedBuffer], bool]:
    """Where loaded moments go, the page-locked memory behind them, and whether they are new.

    New tensors let the load read the moments in one verifying pass before the
    ranks agree (a failed load just drops them): for ``low_memory_resume``
    (host memory, page-locked at its exact size when the optimizer is on CUDA)
    and for an optimizer that has not stepped yet (a resume). Existing moments
    are reused in place (verified first, read after the agreement): a second copy
    of the optimizer state is what a resume must never hold, on the GPU least of all.
    """
    if host or opt._exp_avg is None:
        exp_avg, pinned_a = opt._new_local_state(host)
        exp_avg_sq, pinned_b = opt._new_local_state(host)
        return (exp_avg, exp_avg_sq), pinned_a + pinned_b, True
    return (opt._exp_avg, opt._exp_avg_sq), [], False


def _group_hyperparameters(manifest: dict, opt: DistributedOptimizer) -> list[dict[str, Any]]:
    """Saved ``lr``, ``betas``, ``eps``, ``weight_decay`` of each current param group.

    A group whose params were saved with different values (the grouping changed
    since the save) keeps its current values."""
    out: list[dict[str, Any]] = []
    for gi, group in enumerate(opt.param_groups):
        saved = [manifest["params"][opt.fqn_of[p]].get("group") for p in group["params"]]
        first = saved[0]
        if not isinstance(first, dict) or any(s != first for s in saved):
            out.append({})
            continue
        values: dict[str, Any] = {}
        for key in GROUP_KEYS:
            v = first.get(key)
            if key == "betas":
                ok = (isinstance(v, list) and len(v) == 2
                      and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in v))
                v = tuple(float(b) for b in v) if ok else None
            elif not (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0):
                v = None
            if v is None:
                raise FormatError(f"{MANIFEST}: param group value {key}={first.get(key)!r} "
                                  f"of {opt.fqn_of[group['params'][0]]!r} is malformed")
            values[key] = v
        out.append(values)
    return out


def _group_steps(manifest: dict, opt: DistributedOptimizer) -> list[int]:
    steps: list[int | None] = [None] * len(opt.param_groups)
    for fqn, gi in opt.group_of.items():
        s = manifest["params"][fqn]["step"]
        if steps[gi] is None:
            steps[gi] = s
        elif steps[gi] != s:
            raise CheckpointError(f"param {fqn!r} was saved at optimizer step {s} but others in "
                                  f"its param group at step {steps[gi]}")
    return [s or 0 for s in steps]


def _check_compatible(params: dict, model: torch.nn.Module, opt: DistributedOptimizer) -> None:
    """Every tensor of the model is in the checkpoint with its shape, and nothing else is.
    Reports every mismatching FQN (up to ten), not just the first."""
    frozen = state.frozen_tensors(model, opt)
    current = {fqn: (list(s.shape), True) for fqn, s in opt.layout.slots.items()}
    current.update({fqn: (list(t.shape), False) for fqn, t in frozen.items()})
    problems = []
    for fqn, (shape, trainable) in current.items():
        saved = params.get(fqn)
        if saved is None:
            problems.append(f"param {fqn!r} of the model is missing from the checkpoint")
        elif saved["shape"] != shape:
            problems.append(f"param {fqn!r}: checkpoint shape {saved['shape']} != "
                            f"model shape {shape}")
        elif trainable and not saved["trainable"]:
            problems.append(f"param {fqn!r} is trainable but the checkpoint holds no "
                            "optimizer state for it (it was frozen when saved)")
    problems += [f"checkpoint param {fqn!r} does not exist in the model"
                 for fqn in params if fqn not in current and fqn not in opt.aliases]
    if problems:
        more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise CheckpointError("; ".join(problems[:10]) + more)
