"""The background half of asynchronous saves: one optimizer's saves (:class:`Saves`, in
``opt.shard_state.attachments``), the handle of the save in flight, and the gloo group their
exchanges run on (why: docs/async_save.md, Collectives from the background).

One save of an optimizer is in flight at a time; its next ``save``, a ``checkpoint.load``
into it and the interpreter's exit wait for it. Its error is kept until someone sees it:
:meth:`SaveHandle.wait`, the next ``save`` (which fails on every rank) or a log record at
:meth:`Saves.close`. What ends in which order: docs/reliability.md, Shutdown.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import comm
from ..optimizer import DistributedOptimizer
from . import writer_process
from .snapshot import Snapshot
from ..errors import CheckpointError

_KEY = "shardopt.checkpoint.background"  # this module's entry in shard_state.attachments
log = logging.getLogger("shardopt.checkpoint")


class SaveHandle:
    """An asynchronous save in flight. Not collective: each rank has its own handle."""

    def __init__(self, path: str, work: Callable[[comm.DPGroup], None],
                 group: comm.DPGroup) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._reported = False
        # Thread.start() returns once the thread runs; a thread that then ran Python at once
        # would hold the GIL from the caller for up to the switch interval (5 ms). It waits
        # on ``go`` first (releasing the GIL), so the call returns without that wait.
        go = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(work, group, go),
                                        name=f"shardopt-save {path}")
        self._thread.start()
        go.set()

    def _run(self, work: Callable[[comm.DPGroup], None], group: comm.DPGroup,
             go: threading.Event) -> None:
        # The group is an argument, not a closure cell of ``work``, so that a kept error whose
        # frames are cleared holds no process group (a group alive at exit aborts the job).
        go.wait()
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

    def unreported(self) -> BaseException | None:
        """Join (unless on the save's own thread); the error nobody has seen yet, now seen."""
        if self._thread is not threading.current_thread():
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


@dataclass(frozen=True)
class _Group:
    """A coordination group, the default group it was made under (both weakly: torch's
    registry keeps them while the job's groups exist, and ``destroy_process_group()`` frees
    them), and the process that made it."""

    made_under: weakref.ref
    group: weakref.ref
    pid: int


class Saves:
    """One optimizer's asynchronous saves (module docstring). Used by the training thread."""

    def __init__(self, device: torch.device) -> None:
        self.writer = writer_process.WriterProcess()
        self.snapshot = Snapshot(device, self.writer.available, self.writer.forget)
        self.pending: SaveHandle | None = None
        self._groups: dict[tuple[int, ...], _Group] = {}  # by ranks

    def settle(self, if_busy: str = "wait") -> BaseException | None:
        """Wait for the save in flight, if any, and return its error nobody has seen; with
        ``if_busy="error"``, for a save still running, an error saying so instead."""
        handle = self.pending
        if handle is None:
            return None
        if if_busy == "error" and not handle.done():
            return CheckpointError(f"an asynchronous save of {handle.path} is still in "
                                   "flight (if_busy='error'); wait() for its handle first")
        return handle.unreported()

    def coordination_group(self, dp: comm.DPGroup) -> comm.DPGroup:
        """Collective over ``dp`` the first time for its ranks. A gloo group over the ranks
        of ``dp`` for the exchanges of background saves (``dp`` itself at size 1); made
        anew under a new default group (a re-initialised process group)."""
        if dp.size == 1:
            return dp
        ranks = tuple(dist.get_process_group_ranks(dp.group) if dp.group is not None
                      else range(dist.get_world_size()))
        world = dist.group.WORLD
        kept = self._groups.get(ranks)
        pg = kept.group() if kept is not None else None
        if pg is None or kept.made_under() is not world:
            pg = dist.new_group(list(ranks), backend="gloo", timeout=_timeout(dp.group),
                                use_local_synchronization=True)
            self._groups[ranks] = _Group(weakref.ref(world), weakref.ref(pg), os.getpid())
        return comm.DPGroup(pg, dp.rank, dp.size)

    def close(self) -> None:
        """Wait for the save in flight and log its error if nobody saw it, end the writer
        process, destroy the coordination groups torch still has (so that their threads end
        now where the job did not call ``destroy_process_group``)."""
        error = self.settle()
        if error is not None:
            log.error("an asynchronous checkpoint save failed and nobody waited for it: %s",
                      error)
        self.writer.close()
        for kept in self._groups.values():
            pg = kept.group()
            # A forked child has the parent's groups without their threads: not its own.
            if pg is not None and kept.pid == os.getpid() and dist.is_initialized():
                with contextlib.suppress(ValueError):  # torch no longer has it: nothing to end
                    dist.destroy_process_group(pg)
        self._groups.clear()


def of(opt: DistributedOptimizer) -> Saves:
    """``opt``'s :class:`Saves`, made when first asked for and closed when ``opt`` is
    collected or at interpreter exit (after the non-daemon threads, a save's among them)."""
    attachments = opt.shard_state.attachments
    saves = attachments.get(_KEY)
    if saves is None:
        saves = attachments[_KEY] = Saves(opt.shard_state.device)
        weakref.finalize(opt, saves.close)
    return saves


def wait_pending(opt: DistributedOptimizer) -> None:
    """Wait for ``opt``'s save in flight, leaving its error for wait() or the next save."""
    saves = opt.shard_state.attachments.get(_KEY)
    if saves is not None and saves.pending is not None:
        saves.pending._thread.join()


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
