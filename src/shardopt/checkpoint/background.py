"""The background half of an asynchronous save: its thread, handle and coordination group.

One asynchronous save is in flight per process at a time: a later ``save`` (either
kind), ``checkpoint.load`` and interpreter exit wait for it first. Its error is kept
until someone sees it: :meth:`SaveHandle.wait`, the next ``save`` (which then fails on
every rank, before it starts anything) or, if neither came, a log record at exit.
How the thread and the group end, and in which order: :mod:`.shutdown`.

The save's exchanges between ranks (:func:`~.agree.agree`) run from the background
thread while training issues its own collectives on the DP group from the main
thread; on one group the two would interleave and deadlock or mix up data. They
therefore run on a separate gloo group over the same ranks, created collectively at
the first asynchronous save on that DP group, right after its first exchange, and
cached (gloo carries the small CPU objects on CPU and CUDA hosts alike; dp_size 1
needs none), held weakly (:mod:`.shutdown`). It is made with the DP group's own timeout: a
rank that dies before joining it makes the others raise after that long, as any collective of
the job would, not after gloo's default of 30 minutes.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import traceback
import weakref
from collections.abc import Callable

import torch.distributed as dist

from .. import comm
from .agree import CheckpointError


class SaveHandle:
    """An asynchronous save in flight. Not collective: each rank has its own handle."""

    def __init__(self, path: str, work: Callable[[comm.DPGroup], None],
                 group: comm.DPGroup) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._reported = False
        self._thread = threading.Thread(target=self._run, args=(work, group),
                                        name=f"shardopt-save {path}")
        self._thread.start()

    def _run(self, work: Callable[[comm.DPGroup], None], group: comm.DPGroup) -> None:
        # The group is an argument, not a closure cell of ``work``, so that a kept error whose
        # frames are cleared holds no process group (a group alive at exit: see .shutdown).
        try:
            work(group)
        except BaseException as e:  # noqa: BLE001 - kept for wait(), the next save, or exit
            _drop_locals(e)
            self._error = e
        finally:
            del work, group

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the save is committed and return its path; re-raise its error
        (:class:`CheckpointError` on every rank alike). With ``timeout`` (seconds) and the
        save still running, raise :class:`TimeoutError`."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"saving {self.path} has not finished after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.path

    def _unreported(self) -> BaseException | None:
        """Join; the error nobody has seen yet (then counted as seen)."""
        self._thread.join()
        if self._error is None or self._reported:
            return None
        self._reported = True
        return self._error


def _drop_locals(error: BaseException) -> None:
    """Clear the locals of the finished frames ``error`` and the errors it chains passed
    through: their messages and traceback lines stay, the objects they held go."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


_pending: SaveHandle | None = None  # set and read by the training thread only


def start(path: str, work: Callable[[comm.DPGroup], None], group: comm.DPGroup) -> SaveHandle:
    """Run ``work(group)`` in the background as this process's asynchronous save of ``path``."""
    global _pending
    _pending = SaveHandle(path, work, group)
    return _pending


def settle(if_busy: str = "wait") -> BaseException | None:
    """Wait for this process's asynchronous save in flight, if any, and return its error
    that nobody has seen. With ``if_busy="error"`` a save still running is not waited for:
    an error saying so is returned instead (the caller reports it on every rank)."""
    handle = _pending
    if handle is None:
        return None
    if if_busy == "error" and not handle.done():
        return CheckpointError(f"an asynchronous save of {handle.path} is still in flight "
                             "(if_busy='error'); wait() for its handle first")
    return handle._unreported()


def wait_pending() -> None:
    """Wait for the save in flight, leaving its error to be reported by wait() or the next
    save (``load`` calls this: it may read what that save writes)."""
    handle = _pending
    if handle is not None:
        handle._thread.join()


# ------------------------------------------------------------ coordination group
# ranks -> weak references to (the default group it was made under, the group), and the process
# that made it. Weak: torch's registry keeps the group while the job's groups exist, and
# destroy_process_group() then frees it with them (.shutdown); a new default group (a
# re-initialised process group) makes the cached one stale.
_groups: dict[tuple[int, ...], tuple[weakref.ref, weakref.ref, int]] = {}


def coordination_group(dp: comm.DPGroup) -> comm.DPGroup:
    """Collective over ``dp`` the first time for its ranks. A gloo group over the ranks of
    ``dp`` for the exchanges of background saves (``dp`` itself at size 1)."""
    if dp.size == 1:
        return dp
    ranks = tuple(dist.get_process_group_ranks(dp.group) if dp.group is not None
                  else range(dist.get_world_size()))
    world = dist.group.WORLD
    made_under, pg, _ = _groups.get(ranks, (None, None, 0))
    pg = pg() if pg is not None else None
    if pg is None or made_under() is not world:
        pg = dist.new_group(list(ranks), backend="gloo", timeout=_timeout(dp.group),
                            use_local_synchronization=True)
        _groups[ranks] = (weakref.ref(world), weakref.ref(pg), os.getpid())
    return comm.DPGroup(pg, dp.rank, dp.size)


def _timeout(group: dist.ProcessGroup | None) -> datetime.timedelta | None:
    """Coordinator-free. The timeout ``group`` (None: the default group) was made with;
    None (torch's default) where its backend does not say."""
    pg = group if group is not None else dist.group.WORLD
    for device in getattr(pg, "_device_types", ()):
        try:
            return pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):  # private API: torch may change it
            continue
    return None


def destroy_groups() -> None:
    """Coordinator-free. Destroy the coordination groups this process made that torch still
    has (the job did not call ``destroy_process_group``), so that their threads end now."""
    for _, pg, pid in _groups.values():
        pg = pg()
        # A forked child has the parent's groups without their threads: they are not its own.
        if pg is not None and pid == os.getpid() and dist.is_initialized():
            with contextlib.suppress(ValueError):  # torch no longer has it: nothing to end
                dist.destroy_process_group(pg)
    _groups.clear()
