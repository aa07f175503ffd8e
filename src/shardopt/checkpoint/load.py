"""load: collective restore of a checkpoint saved at any DP size. The schedule (collective over
the DP group; a rank that fails at any step makes every rank raise at the next exchange, so
nothing changes until step 6):

1. Coordinator-free (:func:`_propose`): DP rank 0 resolves what it was given (a root: the
   checkpoint its ``latest`` names) and parses the manifest; every other rank given a
   checkpoint directory parses that one; a rank given a root looks at nothing yet.
2. Exchange: every rank's :class:`Choice` (what it was given, what it found, the manifest's
   checksum). A root resolved by each rank on its own could put the ranks on different steps
   when another job commits into it meanwhile: rank 0 chooses for all.
3. Coordinator-free (:func:`_settle`): checkpoints given explicitly whose manifest differs from
   rank 0's are refused by every rank alike; a rank given rank 0's root parses rank 0's choice,
   one given another root resolves its own; every manifest must have rank 0's checksum.
4. Coordinator-free (:func:`_prepare`): check the manifest against the model and optimizer,
   open the files and cross-check their headers, plan the reads covering this rank's shard,
   read new tensors (Adam moments, RNG states) in one pass that checks each block's hash, and
   verify every other block it will read (:mod:`.read`).
5. Exchange: every rank found everything in order, or every rank raises.
6. Read into the existing tensors, convert moments stored otherwise (:mod:`.convert`);
   exchange; adopt the state, the hyperparameters and the RNG states.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import muon
from ..config import GROUP_KEYS, dtype_name
from ..muon import MOMENTUM
from ..moments import Moments
from ..optimizer import DistributedOptimizer
from . import background, commit, convert, state
from .agree import agree
from .config import CheckpointConfig, settings
from .format import data_file_name
from .manifest import Manifest, parse
from .read import DataFiles, Read, read_verified
from .transfer import io_threads as resolve_threads
from ..errors import CheckpointError, FormatError

log = logging.getLogger("shardopt.checkpoint")


@dataclass(frozen=True)
class Choice:
    """What one rank was given (a path; ``root``: a root, not a checkpoint directory) and
    the checkpoint it found there (DP rank 0 always, others when given one) with its
    manifest's checksum; sent to every rank."""

    given: str
    root: bool
    path: str | None
    checksum: str | None


@dataclass(frozen=True)
class LoadInfo:
    """What :func:`load` restored."""

    step: int
    extra: dict[str, Any]
    path: str
    dp_size_saved: int


@dataclass
class _Plan:
    """Everything a rank needs to finish a load, gathered before any tensor is written."""

    manifest: Manifest
    files: DataFiles
    read_in_place: Callable[[], None]
    steps: dict[str, int]  # by param FQN
    hparams: list[dict[str, Any]]
    rng: dict[str, torch.Tensor]
    moments: Moments
    pieces: list[convert.Piece]  # moments stored in another format, to convert


def load(
    root_or_path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: DistributedOptimizer,
    low_memory_resume: bool | None = None,
    *,
    config: CheckpointConfig | None = None,
) -> LoadInfo:
    """Collective. Restore ``model`` and ``optimizer`` from a checkpoint saved at any DP size.

    ``low_memory_resume`` (default: the optimizer config's) keeps the Adam moments in host
    memory until the first ``step()``; ``config`` sets the rest. On any error every rank
    raises a :class:`CheckpointError` and model and optimizer are left as they were. The
    optimizer records where it resumed from (``shard_state.loaded_from``): its saves may roll
    that root back.
    """
    background.wait_pending(optimizer)  # it may write what this reads, and read what this writes
    dp = optimizer.shard_state.dp
    optimizer.shard_state.finish_param_sync()  # no all-gather may write into loaded params
    what = f"loading {root_or_path}"
    mine, found, error = None, None, None
    try:
        optimizer.shard_state.check_model(model)
        cfg = settings(config, low_memory_resume=low_memory_resume)
        host = bool(optimizer.config.low_memory_resume if low_memory_resume is None
                    else low_memory_resume)
        threads = resolve_threads(cfg.io_threads)
        mine, found = _propose(root_or_path, dp.rank)
    except Exception as e:  # noqa: BLE001 - reported to every rank by agree
        error = e
    choices = agree(dp, error, what, mine)

    plan, error = None, None
    try:
        m = _settle(mine, found, choices)
        plan = _prepare(m, model, optimizer, cfg.verify, host, cfg.staging_bytes, threads,
                        cfg.hyperparameters == "current")
    except Exception as e:  # noqa: BLE001 - reported to every rank by agree
        error = e
    try:
        agree(dp, error, what)
    except BaseException:
        if plan is not None:
            plan.files.close()
        raise
    assert plan is not None

    # Every check passed on every rank: from here on tensors are written.
    error = None
    try:
        plan.read_in_place()
        # Inside the agreement: a rank that fails converting (out of memory, say) must not
        # leave the others in the all-gather of shard_state.adopt.
        convert.apply(optimizer, dict(plan.manifest.moments), plan.pieces, plan.moments,
                      str(plan.manifest.path))
    except Exception as e:  # noqa: BLE001 - the file changed after it was verified
        error = e
    finally:
        plan.files.close()
    agree(dp, error, f"reading {plan.manifest.path}")

    optimizer.shard_state.adopt(plan.moments, plan.steps, on_host=host)
    for group, saved in zip(optimizer.param_groups, plan.hparams):
        group.update(saved)  # as torch's load_state_dict does: lr & co. resume as saved
    if "torch_cpu" in plan.rng:
        torch.set_rng_state(plan.rng["torch_cpu"])
    if "torch_cuda" in plan.rng:
        torch.cuda.set_rng_state(plan.rng["torch_cuda"])
    m = plan.manifest
    optimizer.shard_state.loaded_from = commit.Resumed(m.path.parent.resolve(), m.step)
    return LoadInfo(m.step, dict(m.extra), str(m.path), m.dp_size)


def _propose(root_or_path: str | os.PathLike, rank: int) -> tuple[Choice, Manifest | None]:
    """Coordinator-free. Step 1: this rank's :class:`Choice` and the manifest it parsed."""
    given = Path(root_or_path)
    root = not commit.is_checkpoint_dir(given)
    if root and rank != 0:
        return Choice(str(given), True, None, None), None
    m = parse(commit.resolve(given))
    return Choice(str(given), root, str(m.path), m.checksum), m


def _settle(mine: Choice, found: Manifest | None, choices: list[Choice]) -> Manifest:
    """Coordinator-free. Step 3: the manifest this rank loads; :class:`CheckpointError`
    naming both checkpoints where it is not the one DP rank 0 chose."""
    first = choices[0]
    differ = [r for r, c in enumerate(choices) if c.checksum not in (None, first.checksum)]
    if differ:
        shown = "; ".join(f"dp rank {r}: {choices[r].path} (manifest {choices[r].checksum})"
                          for r in [0, *differ])
        raise CheckpointError(f"the ranks were given different checkpoints ({shown}); every "
                              "rank must load the same one: give every rank the same path, or "
                              "the root, whose latest checkpoint dp rank 0 then chooses for all")
    if found is None:
        same_root = first.root and _same_dir(first.given, mine.given)
        found = parse(Path(first.path) if same_root else commit.resolve(mine.given))
    if found.checksum != first.checksum:
        raise CheckpointError(
            f"dp rank 0 chose {first.path} (manifest {first.checksum}), but this rank found "
            f"{found.path} (manifest {found.checksum}): every rank must load the same checkpoint "
            "(was it replaced meanwhile, or another root given?)")
    return found


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # rank 0's path may not exist on this rank's node
        return False


def _prepare(m: Manifest, model: torch.nn.Module, opt: DistributedOptimizer, verify: bool,
             host: bool, staging_bytes: int, threads: int, keep_hyper: bool) -> _Plan:
    """Coordinator-free. Step 4: every check of a load of ``m``, and its reads before writing."""
    opt.shard_state.check_onloaded("checkpoint.load")
    _check_compatible(m, model, opt)
    steps = {fqn: m.params[fqn].step for fqn in opt.layout.slots}
    hparams = [{} for _ in opt.param_groups] if keep_hyper else _group_hyperparameters(m, opt)
    target = opt.shard_state.load_target(host)
    moments, fresh = target.moments, target.new
    dp = opt.shard_state.dp
    rng_file = data_file_name("rng", dp.rank) if m.dp_size == dp.size else None
    files = DataFiles(m, [f.name for f in m.data_files()] + ([rng_file] if rng_file else []))
    try:
        reads: list[Read] = []
        checks: list[Callable[[], None]] = []  # of the scales, before the ranks agree
        copies: list[Callable[[], None]] = []  # of scales read early into existing moments
        for d in state.destinations(model, opt, dict(m.moments)):
            out, in_place = d.resolve(moments), d.tensor is not None or not fresh
            if d.part == "scales":
                if in_place:  # existing moments: read into a host copy now, copy in later
                    early = torch.empty(out.numel(), dtype=out.dtype)
                    copies.append(functools.partial(out.copy_, early))
                    out, in_place = early, False
                checks.append(functools.partial(files.check_scales, d.key, d.want.start, out))
            reads += files.reads(d.key, d.want, out, in_place=in_place, block=d.block)
        pieces, conversion_reads = convert.plan(opt, dict(m.moments), files)
        reads += conversion_reads
        checks += [functools.partial(files.check_scales, p.scale_key, p.scale_start, p.scales)
                   for p in pieces if p.scales is not None]
        rng_reads = _rng_reads(files, rng_file) if rng_file else {}
        reads += rng_reads.values()
        files.keep_only(reads)
        read_rest = read_verified(reads, verify=verify, threads=threads,
                                  staging_bytes=staging_bytes)
        for check in checks:
            check()
        rng = {key: r.out for key, r in rng_reads.items()}
        _check_rng(rng, f"{m.path / rng_file}" if rng_file else "")
    except BaseException:
        files.close()
        raise

    def read_in_place() -> None:
        read_rest()
        for copy in copies:
            copy()
    return _Plan(m, files, read_in_place, steps, hparams, rng, moments, pieces)


def _rng_reads(files: DataFiles, name: str) -> dict[str, Read]:
    """This rank's saved RNG states (CUDA's only where CUDA is available)."""
    out = {"torch_cpu": files.rng_state(name, "torch_cpu")}
    if out["torch_cpu"] is None:
        raise FormatError(f"{files.readers[name].path}: no torch.uint8 tensor 'torch_cpu'")
    cuda = files.rng_state(name, "torch_cuda") if torch.cuda.is_available() else None
    return out | ({"torch_cuda": cuda} if cuda is not None else {})


def _check_rng(rng: dict[str, torch.Tensor], path: str) -> None:
    """Try each state now and put ours back, so that setting it after the load cannot fail."""
    for key, (get, put) in {"torch_cpu": (torch.get_rng_state, torch.set_rng_state),
                            "torch_cuda": (torch.cuda.get_rng_state, torch.cuda.set_rng_state)
                            }.items():
        if key in rng:
            current = get()
            try:
                put(rng[key])
            except (RuntimeError, ValueError) as e:
                raise CheckpointError(f"{path}: invalid {key} RNG state ({e})") from None
            finally:
                put(current)


def _group_hyperparameters(m: Manifest, opt: DistributedOptimizer) -> list[dict[str, Any]]:
    """Saved ``lr``, ``betas``, ``eps``, ``weight_decay`` (and a Muon group's settings) of
    each current param group; :class:`CheckpointError` if the params are grouped otherwise
    than when saved (one group saved with different values, or groups that differ now in more
    than ``lr``, which schedulers may have made equal, saved with equal values)."""
    out: list[dict[str, Any]] = []
    seen: dict[str, tuple[str, Any]] = {}  # saved values but lr -> first FQN, current values
    for group in opt.param_groups:
        fqns = [opt.shard_state.fqn_of[p] for p in group["params"]]
        saved = [m.params[fqn].hyper for fqn in fqns]
        odd = next((f for f, s in zip(fqns, saved) if s != saved[0]), None)
        if odd is not None:
            raise _regrouped(m, fqns[0], odd, "are in one param group but were saved "
                             f"with different hyperparameters ({dict(saved[0])} and "
                             f"{dict(m.params[odd].hyper)})")
        key = repr(sorted((k, v) for k, v in saved[0].items() if k != "lr"))
        keys = GROUP_KEYS + (muon.MUON_KEYS if muon.is_muon(group) else ())
        now = [(k, tuple(group[k]) if k == "betas" else group[k])
               for k in dict.fromkeys(keys) if k != "lr"]
        first, then = seen.setdefault(key, (fqns[0], now))
        if then != now:
            raise _regrouped(m, first, fqns[0], f"were saved with equal hyperparameters "
                             f"({dict(saved[0])}) but are in param groups with {dict(then)} "
                             f"and {dict(now)} now")
        out.append(dict(saved[0]))
    return out


def _regrouped(m: Manifest, a: str, b: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{m.path}: params {a!r} and {b!r} {what}: the param grouping changed since the save "
        "(another param_group_fn?); pass hyperparameters='current' to checkpoint.load to keep "
        "this optimizer's values for every param group, or build it as when saved")


def _optimizer_name(moments: tuple[str, ...]) -> str:
    return "Muon" if moments == (MOMENTUM,) else "AdamW"


def _check_compatible(m: Manifest, model: torch.nn.Module, opt: DistributedOptimizer) -> None:
    """Every tensor of the model is in the checkpoint with its shape, and nothing else is;
    reports every mismatching FQN (up to ten)."""
    frozen = state.frozen_tensors(model, opt)
    aliases = opt.shard_state.aliases
    current = {fqn: (tuple(shape), True)
               for fqn, shape in opt.shard_state.parallel.global_shapes.items()}
    current.update({fqn: (tuple(t.shape), False) for fqn, t in frozen.items()})
    problems = []
    for fqn, (shape, trainable) in current.items():
        saved = m.params.get(fqn)
        if saved is None and fqn in m.aliases:
            problems.append(f"param {fqn!r} of the model is tied to {m.aliases[fqn]!r}, which "
                            "the checkpoint stores it under: the model names the tied weight "
                            "first by the other name than when saved (declare the tie as "
                            "then)")
        elif saved is None:
            problems.append(f"param {fqn!r} of the model is missing from the checkpoint")
        elif saved.shape != shape:
            problems.append(f"param {fqn!r}: checkpoint shape {list(saved.shape)} != "
                            f"model shape {list(shape)}")
        elif trainable and not saved.trainable:
            problems.append(f"param {fqn!r} is trainable but the checkpoint holds no "
                            "optimizer state for it (it was frozen when saved)")
        elif trainable and saved.moment_names != opt.shard_state.moment_names[fqn]:
            problems.append(
                f"param {fqn!r} has {_optimizer_name(saved.moment_names)}'s state in the "
                f"checkpoint ({', '.join(saved.moment_names)}) but is "
                f"{_optimizer_name(opt.shard_state.moment_names[fqn])}'s here: build the "
                "optimizer with the param_group_fn it was saved with")
    problems += [f"checkpoint param {fqn!r} does not exist in the model"
                 for fqn in m.params if fqn not in current and fqn not in aliases
                 and fqn not in m.aliases.values()]
    for alias, target in m.aliases.items():  # current names were checked above
        if alias not in current and aliases.get(alias) != target:
            problems.append(f"checkpoint param {alias!r} (tied to {target!r}) "
                            + (f"is tied to {aliases[alias]!r} in the model"
                               if alias in aliases else "does not exist in the model"))
    cast = [f"{fqn} ({dtype_name(m.params[fqn].dtype)} -> {dtype_name(t.dtype)})"
            for fqn, t in frozen.items() if fqn in m.params and m.params[fqn].dtype != t.dtype]
    if cast and not problems and opt.shard_state.dp.rank == 0:  # load_state_dict casts silently
        log.warning("loading %s: %d frozen tensor(s) stored in another dtype are cast into "
                    "the model's: %s", m.path, len(cast), ", ".join(cast[:5]))
    if problems:
        more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise CheckpointError("; ".join(problems[:10]) + more)
