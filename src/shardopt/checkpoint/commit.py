"""Directory transactions under a checkpoint root: lock, stage, commit, retain.

Every function here runs on one process (DP rank 0 of the saving job); none communicates.
The protocol, and why each step is safe to crash at:

1. ``begin``: under ``root/.lock`` (``flock``), move stale temporary directories of dead saves
   to ``.trash-*``, record the committed checkpoints (name and inode: what this save may later
   remove), then create ``.tmp-step_XXXXXXXX-<id>`` and ``flock`` it for the whole save. A
   temporary directory whose lock can be taken belongs to nobody alive, so it is stale; one
   that is locked belongs to a concurrent job and is left alone.
2. The ranks write their files into it (:mod:`.save`). Nothing outside ``.tmp-*`` changes,
   so a crash here costs nothing but the temporary directory.
3. ``commit``: write ``manifest.json`` (fsynced, atomic), then under the root lock rename the
   directory to ``step_XXXXXXXX`` (the commit point: a directory is a checkpoint exactly when
   it has a manifest) and fsync the root.
4. Still under the lock: point ``latest`` (replaced atomically) at the highest-numbered
   checkpoint that stays, then move to ``.trash-*`` what this save replaces (below) and the
   checkpoints beyond ``keep_last`` (never the one just committed). Only checkpoints recorded
   in step 1, with the same inode, are ever removed: one another job committed meanwhile
   stays, and if its step is higher, ``latest`` names it. Trash is deleted after the lock is
   released; a crash leaves it for the next save to delete.

Rollback: a job that resumed from an older checkpoint and saves step ``k`` while committed
checkpoints of steps ``>= k`` exist (the abandoned branch) replaces them. Nothing of that
branch changes before the commit point, which is then an atomic exchange of the temporary
directory with ``step_k`` (``renameat2`` ``RENAME_EXCHANGE``; where the file system lacks it,
two renames with a crash window in which ``step_k`` is missing). After it, ``latest`` names
``step_k`` (or a higher step another job committed meanwhile), then the branch's steps ``> k``
and the old ``step_k`` go to trash, so neither the marker nor ``latest()``'s fallback can
return them (a crash between the exchange and the marker update leaves the marker on the old
branch's head, whose checkpoints are then still whole). Only a ``step_k`` that existed when
the save began is replaced: one another job committed during the save is refused.

Without ``flock`` (some network file systems) saving still works and commits still replace
only what a rollback abandons, but stale temporary directories are not cleaned, since nothing
can tell them from live ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .format import LATEST, MANIFEST, STEP_DIR
from .storage import open_regular
from ..errors import CheckpointError, FormatError, LockTimeout

LOCK = ".lock"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
LOCK_TIMEOUT_S = 600.0
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
log = logging.getLogger("shardopt.checkpoint")


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves either the old or the new file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def is_complete(path: Path) -> bool:
    return STEP_DIR.fullmatch(path.name) is not None and (path / MANIFEST).is_file()


def step_of(path: Path) -> int:
    return int(STEP_DIR.fullmatch(path.name).group(1))


def complete_steps(root: Path) -> list[Path]:
    """Committed checkpoints under ``root``, oldest step first."""
    return sorted((p for p in root.glob("step_*") if is_complete(p)), key=step_of)


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None


def exchange(a: Path, b: Path) -> bool:
    """Swap directories ``a`` and ``b`` atomically; False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot exchange {a} with {b}: {os.strerror(err)}")


def _try_flock(fd: int) -> bool | None:
    """True if locked, False if someone else holds it, None if the file system cannot lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return None
        raise


class RootLock:
    """``flock`` on ``root/.lock``: one committer per root at a time, across jobs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fd: int | None = None
        self.supported = True

    def __enter__(self) -> RootLock:
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        try:
            while (got := _try_flock(fd)) is False:
                if time.monotonic() > deadline:
                    raise LockTimeout(f"{self.root / LOCK} has been held by another process for "
                                      f"{LOCK_TIMEOUT_S:.0f} s (another job committing here?)")
                time.sleep(0.05)
        except BaseException:
            os.close(fd)
            raise
        if got is None:
            self.supported = False
            warnings.warn(f"{self.root}: the file system does not support flock; saving "
                          "without a lock (stale temporary directories are not cleaned)",
                          stacklevel=3)
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None


def latest(root: str | os.PathLike) -> str | None:
    """Coordinator-free. The newest committed checkpoint under ``root`` (None if none): the
    one the ``latest`` marker names if complete, else the highest-numbered complete one."""
    root = Path(root)
    name = _marker(root)
    if STEP_DIR.fullmatch(name) and is_complete(root / name):
        return str(root / name)
    steps = complete_steps(root) if root.is_dir() else []
    return str(steps[-1]) if steps else None


def _marker(root: Path) -> str:
    """What ``root/latest`` names; "" when it is missing, unreadable, a symlink or not a
    regular file (a FIFO would block a plain ``open`` forever)."""
    try:
        fd = open_regular(root / LATEST)
    except FormatError:
        return ""
    try:
        return os.pread(fd, 256, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    finally:
        os.close(fd)


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    """Coordinator-free. Whether ``path`` is a checkpoint directory (True) or a root that
    may hold some (False); :class:`CheckpointError` for a missing path and for a save's
    temporary or removed directory (it may hold a manifest before its commit)."""
    p = Path(path)
    if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
        raise CheckpointError(f"{p} is not a committed checkpoint: a save's temporary or "
                              "removed directory (a committed one is named step_XXXXXXXX)")
    if os.path.lexists(p / MANIFEST):
        return True
    if not p.exists():
        raise CheckpointError(f"no checkpoint at {p}: the path does not exist")
    return False


def resolve(root_or_path: str | os.PathLike) -> Path:
    """Coordinator-free. A checkpoint directory, given itself or a root holding some
    (:class:`CheckpointError` when there is none)."""
    p = Path(root_or_path)
    if is_checkpoint_dir(p):
        return p
    found = latest(p)
    if found is None:
        raise CheckpointError(f"no committed checkpoint in {p} (no {MANIFEST} found)")
    return Path(found)


@dataclass
class Staged:
    """A save in progress: its temporary directory, the fd whose flock marks it live, and
    the committed checkpoints when it began (by name): only these are ever replaced or
    removed by it (the same device and inode)."""

    root: Path
    tmp: Path
    fd: int | None
    committed: bool = False
    existing: dict[str, os.stat_result] = field(default_factory=dict)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def began_with(self, path: Path) -> bool:
        """Whether ``path`` is the checkpoint of its name recorded when the save began."""
        now, then = _stat(path), self.existing.get(path.name)
        return now is not None and then is not None and os.path.samestat(now, then)


def _trash(root: Path, path: Path) -> Path:
    dest = root / f"{TRASH_PREFIX}{path.name.lstrip('.')}-{uuid.uuid4().hex[:8]}"
    os.rename(path, dest)
    return dest


def _collect_stale(root: Path) -> list[Path]:
    """Under the root lock: move dead saves' temporary dirs to trash (best effort); list all
    trash."""
    for p in root.glob(f"{TMP_PREFIX}*"):
        if not p.is_dir() or p.is_symlink():
            continue
        with contextlib.suppress(OSError):
            fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                if _try_flock(fd):
                    _trash(root, p)
            finally:
                os.close(fd)
    for p in root.glob(f".{LATEST}.*.tmp"):
        with contextlib.suppress(OSError):
            p.unlink()
    return [p for p in root.glob(f"{TRASH_PREFIX}*") if not p.is_symlink()]


def _delete(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


@dataclass(frozen=True)
class Resumed:
    """A checkpoint a run resumed from (``shard_state.loaded_from``): its saves may roll
    the root (resolved) back."""

    root: Path
    step: int


def resumed_step(resumed: object, root: Path) -> int | None:
    """The step ``resumed`` (a :class:`Resumed` or None) names in ``root``, else None."""
    if isinstance(resumed, Resumed) and resumed.root == root.resolve():
        return resumed.step
    return None


def begin(root: Path, final_name: str, rollback_from: int | None = None) -> Staged:
    """Step 1: create and lock a temporary directory for ``root/final_name``. A save that
    would replace committed steps ``>= k`` (a rollback) is refused unless ``rollback_from``
    (the step this run resumed from in ``root``; 0 for an explicit rollback) is at most ``k``:
    a run started afresh into a longer run's root would otherwise replace all of it."""
    root.mkdir(parents=True, exist_ok=True)
    with RootLock(root) as lock:
        trash = _collect_stale(root) if lock.supported else []
        final = root / final_name
        step = step_of(final)
        later = [step_of(p) for p in complete_steps(root) if step_of(p) >= step]
        if later and (rollback_from is None or rollback_from > step):
            shown = ", ".join(map(str, later[:5])) + (" and more" if len(later) > 5 else "")
            resumed = ("this run did not resume from it" if rollback_from is None
                       else f"this run resumed from step {rollback_from} of it")
            raise CheckpointError(
                f"{root} holds committed checkpoints of steps {shown} >= {step}: saving step "
                f"{step} would replace them (a rollback), but {resumed}. Save into another "
                "root, resume from the checkpoint to roll back to (checkpoint.load), or pass "
                "config=CheckpointConfig(rollback=True) to replace them")
        if os.path.lexists(final) and not is_complete(final):
            raise FileExistsError(f"{final} exists and is not a committed checkpoint")
        existing = {p.name: st for p in complete_steps(root) if (st := _stat(p)) is not None}
        tmp = root / f"{TMP_PREFIX}{final_name}-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        if lock.supported:
            _try_flock(fd)
    _delete(trash)
    return Staged(root, tmp, fd, existing=existing)


def abort(staged: Staged) -> None:
    """Remove an uncommitted save's temporary directory (idempotent)."""
    if not staged.committed:
        shutil.rmtree(staged.tmp, ignore_errors=True)
    staged.release()


def commit(staged: Staged, final_name: str, manifest: bytes, keep_last: int | None) -> Path:
    """Steps 3 and 4. ``OSError`` if the checkpoint could not be committed; after the rename
    it is complete: a failed ``latest`` update still raises (``latest()`` then falls back to
    the marker's older checkpoint), a failed removal of old checkpoints warns."""
    root = staged.root
    final = root / final_name
    write_atomic(staged.tmp / MANIFEST, manifest)
    trash: list[Path] = []
    with RootLock(root):
        old = _publish(staged, final)
        fsync_dir(root)
        steps = complete_steps(root)
        abandoned = [p for p in steps if step_of(p) > step_of(final) and staged.began_with(p)]
        kept = [p for p in steps if p not in abandoned]
        try:
            write_atomic(root / LATEST, (kept[-1].name + "\n").encode())
        except OSError as e:
            raise OSError(e.errno, f"checkpoint {final} is complete, but {root / LATEST} could "
                                   f"not be updated: {e.strerror or e}") from e
        try:
            trash = ([old] if old is not None else []) + [_trash(root, p) for p in abandoned]
            if trash:
                replaced = f"replaced {final.name}" if old is not None else ""
                removed = (f"removed {', '.join(p.name for p in abandoned)}" if abandoned
                           else "")
                log.warning("%s: committed after a rollback; %s of the abandoned branch",
                            final, " and ".join(w for w in (replaced, removed) if w))
            if keep_last is not None:
                trash += [_trash(root, p) for p in kept[:-keep_last] if staged.began_with(p)]
        except OSError as e:
            warnings.warn(f"removing old checkpoints in {root} failed: {e}", stacklevel=3)
    staged.release()
    _delete(trash)
    return final


def _publish(staged: Staged, final: Path) -> Path | None:
    """The commit point, under the root lock: ``staged.tmp`` becomes ``final``; returns the
    replaced checkpoint, moved to trash, if ``final`` existed when the save began."""
    if _stat(final) is None:
        os.rename(staged.tmp, final)
        staged.committed = True
        return None
    if not staged.began_with(final) or not is_complete(final):
        raise FileExistsError(f"checkpoint {final} already exists (saved by another job?)")
    if exchange(staged.tmp, final):
        staged.committed = True
        return _trash(staged.root, staged.tmp)  # the tmp name now holds the old checkpoint
    old = _trash(staged.root, final)  # no atomic exchange: a crash now leaves no step_k
    os.rename(staged.tmp, final)
    staged.committed = True
    return old
