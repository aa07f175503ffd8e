"""Host copies of the shard state: ``offload()`` / ``onload()``, and the first ``step()``'s
move of the moments a ``low_memory_resume`` load staged. Both replace records of
:mod:`.shard_state` and copy on one side CUDA stream between exact-size page-locked host
tensors (:mod:`.pinned`) and the device (docs/offload.md).

Offload queues the D2H copies behind the current stream's work, then resizes every device
storage to zero (views, params included, stay valid objects, as FSDP does) and hands the
memory back; grads are copied only when a backward left some pending (``no_sync``), else
freed and zeroed at onload. Onload re-allocates each storage and queues its H2D copy
(:func:`queue_h2d`); the current stream waits for them, the host does not. The host copies
are kept for the next cycle until :meth:`HostState.release`. Off CUDA nothing can be freed
safely, so offload copies the state aside and fills the live tensors with NaN.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from . import kernels
from .errors import OffloadError
from .pinned import PinnedBuffer
from .shard_state import DEVICE, FREED, HOST, KINDS, STAGED, ShardState

H2D_WAYS = ("kernel", "copy_engine")  # onload(copy=...)


@dataclass(frozen=True)
class _Unpin:
    """Page-locked memory to unlock once ``event`` (its copies to the device) is done."""

    event: torch.cuda.Event
    pins: tuple[PinnedBuffer, ...]


class HostState:
    """Offload and staged moments of one :class:`~shardopt.shard_state.ShardState`; a forward
    of ``modules`` is refused while params or grads are offloaded."""

    def __init__(self, state: ShardState, modules: list[tuple[str, torch.nn.Module]]) -> None:
        self.state = state
        self.rank = state.dp.rank
        self.cuda = state.device.type == "cuda"
        self._modules = modules
        self.offloaded: tuple[str, ...] = ()  # kinds whose values are in the host copies
        self._nbytes: dict[str, int] = {}  # storage bytes of each record freed by offload
        self._guards: list[torch.utils.hooks.RemovableHandle] = []
        self._stream: torch.cuda.Stream | None = None
        self._last_h2d: torch.cuda.Event | None = None
        self._unpin: _Unpin | None = None

    def offload(self, what: Iterable[str], pending_grads: bool) -> None:
        """Move the kinds ``what`` to the host; ``pending_grads``: a backward left gradients."""
        kinds = _check_kinds(what)
        if self.offloaded:
            raise OffloadError(f"[dp rank {self.rank}] the optimizer is already offloaded "
                               f"({', '.join(self.offloaded)}); call onload() first")
        held = self.state.held
        names = [n for k in kinds for n, h in held.items() if h.kind == k and h.where == DEVICE]
        dropped = [n for n in names if held[n].kind == "grads" and not pending_grads]
        moved = [n for n in names if n not in dropped]
        for name in moved:  # every allocation first: a failure here changes nothing
            self._host_copy(name)
        pairs = [(held[n].device, held[n].host) for n in moved]
        freed = [held[n].device for n in dropped]
        if self.cuda:
            self._nbytes = {n: held[n].device.untyped_storage().nbytes() for n in names}
            self._copy_out_and_free(pairs, freed)
        else:
            for dev, host in pairs:
                host.copy_(dev)
            for dev in [d for d, _ in pairs] + freed:
                # 8-bit codes cannot be NaN; their blocks' scales are, which poisons them too
                dev.fill_(float("nan") if dev.is_floating_point() else 0)
        for name in names:
            self.state.replace(name, where=FREED if name in dropped else HOST)
        self.offloaded = kinds
        if "params" in kinds or "grads" in kinds:
            self._guards = [m.register_forward_pre_hook(_ForwardGuard(self, name))
                            for name, m in self._modules]

    def _host_copy(self, name: str) -> None:
        """Give record ``name`` a host copy of its device tensor's size (kept from the last
        offload where it still fits)."""
        held = self.state.held[name]
        dev = held.device
        if held.host is not None and (held.host.numel(), held.host.dtype) == (dev.numel(),
                                                                              dev.dtype):
            return
        if held.pin is not None:
            held.pin.release()
        pin = PinnedBuffer(dev.numel(), dev.dtype) if self.cuda else None
        self.state.replace(name, host=torch.empty_like(dev) if pin is None else pin.tensor,
                           pin=pin)

    def _copy_out_and_free(self, moved: list[tuple[torch.Tensor, torch.Tensor]],
                           dropped: list[torch.Tensor]) -> None:
        """Copy each device tensor of ``moved`` to its host copy on the side stream, then free
        every device storage. With expandable segments (unmapping is slow but waits only for
        the current stream) each storage goes as soon as its own copy is done; otherwise
        ``cudaFree`` waits for the whole device, so everything goes after all the copies."""
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(self.state.device))
        overlap = allocator_expandable()
        done = []
        with torch.cuda.stream(stream):
            for dev, host in moved:
                host.copy_(dev, non_blocking=True)
                if overlap:
                    done.append(torch.cuda.Event())
                    done[-1].record(stream)
        if overlap:
            for dev in dropped:
                dev.untyped_storage().resize_(0)  # freed for the current stream: safe
            # The cached segments (the step's activations) are unmapped while the copies run.
            torch.cuda.empty_cache()
            # A storage is freed after the last copy that reads it (tensors may share one).
            last = {dev.untyped_storage().data_ptr(): i for i, (dev, _) in enumerate(moved)}
            for i, ((dev, _), event) in enumerate(zip(moved, done)):
                if last[dev.untyped_storage().data_ptr()] != i:
                    continue
                event.synchronize()  # no stream knows the side stream reads it: wait here
                dev.untyped_storage().resize_(0)
                torch.cuda.empty_cache()
        else:
            stream.synchronize()
            for dev in [d for d, _ in moved] + dropped:
                dev.untyped_storage().resize_(0)
            torch.cuda.empty_cache()

    def onload(self, copy: str | None = None) -> None:
        """Bring back what :meth:`offload` moved (``copy``: see ``DistributedOptimizer.onload``)."""
        if copy not in (None, *H2D_WAYS):
            raise OffloadError(f"onload(copy={copy!r}): choose from {list(H2D_WAYS)} or None")
        if not self.offloaded:
            return
        held = self.state.held
        moved = [n for n, h in held.items() if h.where == HOST]
        dropped = [n for n, h in held.items() if h.where == FREED]
        if self.cuda:
            event = queue_h2d([(held[n].device, held[n].host) for n in moved],
                              self._side_stream(), [self._nbytes[n] for n in moved],
                              None if copy is None else copy == "kernel")
            for n in dropped:  # zeroed on the current stream, beside the copies
                held[n].device.untyped_storage().resize_(self._nbytes[n])
            for n in dropped:
                held[n].device.zero_()
            torch.cuda.current_stream(self.state.device).wait_event(event)
            self._last_h2d, self._nbytes = event, {}
        else:
            for n in moved:
                held[n].device.copy_(held[n].host)
            for n in dropped:
                held[n].device.zero_()
        for name in moved + dropped:
            self.state.replace(name, where=DEVICE)
        for guard in self._guards:
            guard.remove()
        self._guards = []
        self.offloaded = ()

    def release(self) -> None:
        """Drop the host copies kept for the next offload (their pages unlocked)."""
        if self.offloaded:
            raise OffloadError(f"[dp rank {self.rank}] the host copies hold the offloaded "
                               "state; call onload() before release_host_memory()")
        if self._last_h2d is not None:
            self._last_h2d.synchronize()  # the last onload has finished reading them
            self._last_h2d = None
        for name, held in list(self.state.held.items()):
            if held.where == DEVICE and held.host is not None:
                if held.pin is not None:
                    held.pin.release()
                self.state.replace(name, host=None, pin=None)

    def check_onloaded(self, what: str, kinds: Iterable[str] = KINDS) -> None:
        """Raise :class:`OffloadError` naming ``what`` if any of ``kinds`` is offloaded."""
        out = [k for k in self.offloaded if k in kinds]
        if out:
            raise OffloadError(f"[dp rank {self.rank}] {what} needs the optimizer's "
                               f"{', '.join(out)} on the device, but they are offloaded; "
                               "call onload() first")

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.state.device)
        return self._stream

    def bring_staged(self) -> None:
        """Move staged moments to the device (inside ``step()``, after backward); their
        page-locked memory is unlocked after the step (:meth:`after_step`)."""
        held = self.state.held
        staged = [n for n, h in held.items() if h.where == STAGED]
        devs = [held[n].host for n in staged]
        if self.cuda and staged:
            pairs = [(torch.empty_like(t, device=self.state.device), t) for t in devs]
            event = queue_h2d(pairs, self._side_stream())
            torch.cuda.current_stream(self.state.device).wait_event(event)
            devs = [d for d, _ in pairs]
            pins = tuple(held[n].pin for n in staged if held[n].pin is not None)
            if pins:
                self._unpin = _Unpin(event, pins)
        for name, dev in zip(staged, devs):
            self.state.replace(name, where=DEVICE, device=dev, host=None, pin=None)

    def after_step(self) -> None:
        if self._unpin is not None:
            unpin, self._unpin = self._unpin, None
            unpin.event.synchronize()  # the staged moments have reached the device
            for pin in unpin.pins:
                pin.release()


def lost_writes(rank: int, lost: list[str]) -> OffloadError:
    """The error for params written in place while offloaded (``onload()`` undid it)."""
    return OffloadError(
        f"[dp rank {rank}] param{'s' if len(lost) > 1 else ''} "
        f"{', '.join(map(repr, lost[:5]))}{' and more' if len(lost) > 5 else ''} "
        "written in place while the params were offloaded (model.load_state_dict, "
        "p.copy_(...)): the write went to storage that onload() has replaced, so the "
        "params are back as offload() found them. Write weights after onload().")


def _check_kinds(what: Iterable[str]) -> tuple[str, ...]:
    if isinstance(what, str):
        what = (what,)
    if not isinstance(what, Iterable):
        raise OffloadError(f"offload(what={what!r}): give kinds of state from {list(KINDS)}")
    kinds = tuple(dict.fromkeys(what))
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise OffloadError(f"cannot offload {unknown or 'nothing'}; choose from {list(KINDS)}")
    return tuple(k for k in KINDS if k in kinds)


class _ForwardGuard:
    """Forward pre-hook on the model's modules while params or grads are offloaded: a forward
    raises, and so does pickling or copying the module (its params hold nothing). A copy made
    otherwise keeps the guard after ``onload()`` removed it from the original, and runs."""

    def __init__(self, host: HostState, module_name: str) -> None:
        self.host, self.name = host, module_name or "<root>"

    def _refusal(self, what: str) -> OffloadError:
        return OffloadError(
            f"[dp rank {self.host.rank}] {what} module {self.name!r} while the "
            f"optimizer's {', '.join(self.host.offloaded)} are offloaded; call "
            "optimizer.onload() first")

    def __call__(self, _module: torch.nn.Module, _args: Any) -> None:
        if self.host.offloaded:
            raise self._refusal("forward of")

    def __reduce__(self) -> Any:
        raise self._refusal("pickling or copying")


def queue_h2d(pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: torch.cuda.Stream,
              sizes: list[int] | None = None, by_kernel: bool | None = None
              ) -> torch.cuda.Event:
    """Queue ``dev.copy_(host)`` for every (contiguous device, host) pair on ``stream`` after
    the current stream's work, by kernel (``kernels.copy_from_host_``) or copy engine
    (``by_kernel``, default :func:`h2d_by_kernel`); returns an event after all of them. With
    ``sizes``, each device storage is re-allocated just before its copy, so an allocation
    overlaps the copies before it (docs/offload.md)."""
    device = pairs[0][0].device if pairs else torch.device("cuda")
    # Memory allocated for the current stream may have been freed by its earlier work, still
    # queued: the copies wait for it (nothing new is queued there meanwhile).
    stream.wait_stream(torch.cuda.current_stream(device))
    kernel = h2d_by_kernel() if by_kernel is None else by_kernel
    kernel = kernel and kernels.available(device) and all(h.is_pinned() for _, h in pairs)
    for i, (dev, host) in enumerate(pairs):
        if sizes is not None:
            dev.untyped_storage().resize_(sizes[i])
        with torch.cuda.stream(stream):
            if kernel:
                kernels.copy_from_host_(dev.view(-1), host.view(-1))
            else:
                dev.copy_(host, non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    return event


def h2d_by_kernel() -> bool:
    """Whether host-to-device copies into fresh memory go by kernel when not told: unless the
    allocator makes expandable segments (there an allocation maps its pages itself and the
    copy engine is the faster; docs/offload.md)."""
    return not allocator_expandable()


def allocator_expandable() -> bool:
    """Whether torch's CUDA allocator makes expandable segments: the last
    ``expandable_segments`` of ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``, or of
    what the process set since, where this torch can report it."""
    parts = [os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")]
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is not None:
        parts.append(get())
    found = re.findall(r"expandable_segments:(\w+)", ",".join(parts).replace(" ", "").lower())
    return bool(found) and found[-1] == "true"
