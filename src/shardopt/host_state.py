"""Host copies of the optimizer's device state: ``offload()`` / ``onload()`` and the
moments a ``low_memory_resume`` load stages until the first ``step()``.

Both are one mechanism: exact-size page-locked host tensors (:mod:`.pinned`) that
hold state whose device memory is gone, copies between them and the device on one
side CUDA stream, and :meth:`HostState.local` to say where each piece of state is
now, so that ``state_view`` (and through it ``checkpoint.save``) reads the host
copies without bringing anything back to the GPU.

Offload (kinds ``moments``, ``main_params``, ``grads``, ``params``): the D2H copies
queue on the side stream behind the work already queued on the current stream; every
device tensor's storage is then resized to zero (views, params included, stay valid
objects that point into empty storage, as FSDP does) and ``torch.cuda.empty_cache()``
hands the memory back to the device: all at once after the host waited for every copy,
or, where the allocator makes expandable segments, each storage as soon as its own copy
is done (:meth:`HostState._copy_out_and_free`). Grads are copied
only when a backward left some pending (``no_sync`` accumulation): otherwise the buffer
is freed without a copy and zeroed at onload (its param regions are overwritten by the
next backward, its padding must be zero).

Onload: each storage is re-allocated for the current stream and its H2D copy queued on
the side stream in turn (:func:`queue_h2d`; by a kernel that reads the host memory, unless
the allocator has expandable segments: :func:`h2d_by_kernel`), the current stream zeroes
dropped grads beside the copies and then waits for them; the host does not wait. The host
copies are kept for the next cycle (the same addresses) until :meth:`HostState.release`.

Off CUDA nothing can be freed safely (a CPU kernel reading an empty storage
crashes), so offload copies the state aside and fills the live tensors with NaN,
which makes any use while offloaded visible; onload copies it back. The semantics
(refused forward and step, saves from the host copies, bitwise continuation) are
the same as on CUDA.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import kernels
from .moments import Moments
from .quant import Moment
from .pinned import PinnedBuffer
from .errors import OffloadError

# ``opt`` is the DistributedOptimizer this serves, typed ``Any``: the optimizer imports
# this module, never the reverse.

KINDS = ("moments", "main_params", "grads", "params")
# Host-to-device copies by a kernel that reads the page-locked host memory (True), by the
# copy engine (False), or chosen by the allocator's settings (None): see h2d_by_kernel.
H2D_BY_KERNEL: bool | None = None
H2D_WAYS = ("kernel", "copy_engine")  # onload(copy=...)


class HostState:
    """Where the optimizer's state lives when it is not on the device."""

    def __init__(self, opt: Any, model: torch.nn.Module,
                 on_realloc: Callable[[], None]) -> None:
        self.opt = opt
        self._on_realloc = on_realloc  # told when onload gave the params new storage
        # The params' version counters at offload(), to find writes that onload() undoes.
        self._versions: list[int] | None = None
        self.cuda = opt.device.type == "cuda"
        # The root too: its forward may use a child's weight before that child runs.
        self._modules = [(name, m) for name, m in model.named_modules() if m is model
                         or any(p in opt.fqn_of for p in m.parameters(recurse=False))]
        self.offloaded: tuple[str, ...] = ()  # kinds whose values are in the host copies
        self._copies: dict[str, list[torch.Tensor | None]] = {}  # reused across cycles
        self._pinned: dict[str, list[PinnedBuffer]] = {}
        self._moved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device, host) offloaded
        self._nbytes: list[int] = []  # storage bytes of the freed moved, then dropped, tensors
        self._dropped: list[torch.Tensor] = []  # grad buffers freed without a copy
        self._guards: list[torch.utils.hooks.RemovableHandle] = []
        self._stream: torch.cuda.Stream | None = None
        self._last_h2d: torch.cuda.Event | None = None
        # low_memory_resume: loaded moments wait here until the first step(), then their
        # pages are unlocked once the copies to the device are done.
        self.staged: Moments | None = None
        self._staged_pinned: list[PinnedBuffer] = []
        self._unpin_after: tuple[torch.cuda.Event, list[PinnedBuffer]] | None = None

    # ---------------------------------------------------------------- offload
    def offload(self, what: Iterable[str]) -> None:
        kinds = _check_kinds(what)
        if self.offloaded:
            raise OffloadError(f"[dp rank {self.opt.dp.rank}] the optimizer is already "
                               f"offloaded ({', '.join(self.offloaded)}); call onload() first")
        opt = self.opt
        opt.finish_param_sync()  # all-gathers write into the param buffers
        pending_grads = opt.wait_grad_reductions()  # reduce-scatters write into the grad buffers
        moved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device, host copy)
        dropped: list[torch.Tensor] = []
        for kind in kinds:  # every allocation first: a failure here changes nothing
            live = self._device_tensors(kind)
            if kind == "grads" and not pending_grads:
                dropped = [t for t in live if t is not None]
                continue
            copies = self._host_copies(kind, live)
            moved += [(d, h) for d, h in zip(live, copies) if d is not None]
        self._nbytes = [t.untyped_storage().nbytes() for t, _ in moved] + [
            t.untyped_storage().nbytes() for t in dropped] if self.cuda else []
        if self.cuda:
            self._copy_out_and_free(moved, dropped)
        else:
            for dev, host in moved:
                host.copy_(dev)
            for dev in [d for d, _ in moved] + dropped:
                # 8-bit codes cannot be NaN; their blocks' scales are, which poisons them too
                dev.fill_(float("nan") if dev.is_floating_point() else 0)
        self._moved, self._dropped, self.offloaded = moved, dropped, kinds
        if "params" in kinds:
            opt.buffers.host_params = self._copies["params"]
            self._versions = opt._watch.versions()
        if "params" in kinds or "grads" in kinds:
            self._guards = [m.register_forward_pre_hook(_ForwardGuard(self, name))
                            for name, m in self._modules]

    def _copy_out_and_free(self, moved: list[tuple[torch.Tensor, torch.Tensor]],
                           dropped: list[torch.Tensor]) -> None:
        """Copy each device tensor of ``moved`` to its host copy on the side stream, then
        free every device storage (``moved``'s and ``dropped``'s) and give the memory back
        to the device.

        Where the allocator makes expandable segments (:func:`allocator_expandable`), giving
        memory back unmaps its pages, which waits only for the current stream but takes long
        enough that freeing everything after the copies slows the offload (docs/offload.md):
        each storage is freed as soon as its own copy is done, while the later copies run.
        Otherwise ``cudaFree`` waits for the whole
        device, so the host waits for all the copies once and frees everything after them."""
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(self.opt.device))
        overlap = allocator_expandable()
        if overlap:
            torch.cuda.empty_cache()  # cached cudaMalloc segments now, before the copies run
            for dev in dropped:
                dev.untyped_storage().resize_(0)  # freed for the current stream: safe
        done = []
        with torch.cuda.stream(stream):
            for dev, host in moved:
                host.copy_(dev, non_blocking=True)
                if overlap:
                    done.append(torch.cuda.Event())
                    done[-1].record(stream)
        if overlap:
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
        if copy not in (None, *H2D_WAYS):
            raise OffloadError(f"onload(copy={copy!r}): choose from {list(H2D_WAYS)} or None")
        if not self.offloaded:
            return
        if self.cuda:
            self._last_h2d = self._to_device(self._moved, self._dropped, self._nbytes,
                                             None if copy is None else copy == "kernel")
            self._nbytes = []
        else:
            for dev, host in self._moved:
                dev.copy_(host)
            for grads in self._dropped:
                grads.zero_()
        self._moved, self._dropped = [], []
        for guard in self._guards:
            guard.remove()
        self._guards = []
        self.opt.buffers.host_params = None
        self._on_realloc()  # the params' storage was re-allocated: new addresses
        self.offloaded = ()
        versions, self._versions = self._versions, None
        lost = [] if versions is None else self.opt._watch.undone(versions)
        if lost:
            raise OffloadError(
                f"[dp rank {self.opt.dp.rank}] param{'s' if len(lost) > 1 else ''} "
                f"{', '.join(map(repr, lost[:5]))}{' and more' if len(lost) > 5 else ''} "
                "written in place while the params were offloaded (model.load_state_dict, "
                "p.copy_(...)): the write went to storage that onload() has replaced, so the "
                "params are back as offload() found them. Write weights after onload().")

    def release(self) -> None:
        """Drop the host copies kept for the next offload (their pages unlocked)."""
        if self.offloaded:
            raise OffloadError(f"[dp rank {self.opt.dp.rank}] the host copies hold the "
                               "offloaded state; call onload() before release_host_memory()")
        if self._last_h2d is not None:
            self._last_h2d.synchronize()  # the last onload has finished reading them
            self._last_h2d = None
        for bufs in self._pinned.values():
            for buf in bufs:
                buf.release()
        self._pinned, self._copies = {}, {}

    def check_onloaded(self, what: str, kinds: Iterable[str] = KINDS) -> None:
        held = [k for k in self.offloaded if k in kinds]
        if held:
            raise OffloadError(f"[dp rank {self.opt.dp.rank}] {what} needs the optimizer's "
                               f"{', '.join(held)} on the device, but they are offloaded; "
                               "call onload() first")

    def refuses_reseed(self, watch) -> bool:
        """Whether the main params must not be re-seeded now: the params are offloaded
        (nothing can write them; :meth:`onload` checks), or the main params are
        (``offload()`` re-seeded them first; a write since raises here)."""
        if "params" in self.offloaded:
            return True
        if "main_params" in self.offloaded:
            if watch.written(record=False):
                self.check_onloaded("re-seeding the main params from weights written since "
                                    "offload()", ("main_params",))
            return True
        return False

    def host_bytes(self) -> int:
        """Bytes of host memory kept for offloading."""
        return sum(t.numel() * t.element_size() for ts in self._copies.values()
                   for t in ts if t is not None)

    # ------------------------------------------------------------- where state is
    def local(self, name: str, buffer_index: int) -> torch.Tensor:
        """This rank's local tensor of state ``name`` (fp32 main param or a moment) of
        buffer ``buffer_index``, wherever its values are now."""
        if name != "master_param":
            return self.local_moment(name, buffer_index).values
        live = self.opt.main_params[buffer_index]
        assert live is not None
        if "main_params" in self.offloaded:
            return self._copies["main_params"][buffer_index]
        return live

    def local_moment(self, name: str, buffer_index: int) -> Moment:
        """This rank's moment ``name`` of buffer ``buffer_index`` in its storage form (values
        and scales), wherever it is now."""
        if self.staged is not None:  # a low_memory_resume load's, on the host: never offloaded
            return self.staged.of(name)[buffer_index]
        moments = self.opt.moments
        if moments is None:
            raise RuntimeError(f"optimizer state {name!r} is not allocated before the first step")
        live = moments.of(name)[buffer_index]
        if "moments" not in self.offloaded:
            return live
        copy = dict(zip(map(id, moments.tensors()), self._copies["moments"]))
        return Moment.wrap(live.kind, copy[id(live.values)],
                           None if live.scales is None else copy[id(live.scales)], live.sqrt)

    def _device_tensors(self, kind: str) -> list[torch.Tensor | None]:
        opt = self.opt
        if kind == "params":
            return list(opt.buffers.param_buffers)
        if kind == "grads":
            return list(opt.buffers.grad_tensors())
        if kind == "main_params":
            return list(opt.main_params)  # None: an fp32 buffer's main param is the param buffer
        if opt.moments is None:
            return []  # not allocated yet, or staged on the host by a load
        return list(opt.moments.tensors())

    def _host_copies(self, kind: str, live: list[torch.Tensor | None]
                     ) -> list[torch.Tensor | None]:
        copies = self._copies.get(kind)
        if copies is not None and [None if c is None else (c.numel(), c.dtype) for c in copies
                                   ] == [None if t is None else (t.numel(), t.dtype)
                                         for t in live]:
            return copies
        for buf in self._pinned.pop(kind, []):
            buf.release()
        copies, pinned = [], []
        for t in live:
            if t is None:
                copies.append(None)
            elif self.cuda:
                pinned.append(PinnedBuffer(t.numel(), t.dtype))
                copies.append(pinned[-1].tensor)
            else:
                copies.append(torch.empty_like(t))
        self._copies[kind], self._pinned[kind] = copies, pinned
        return copies

    # ------------------------------------------------------------ device copies
    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.opt.device)
        return self._stream

    def _to_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                   zero: Iterable[torch.Tensor] = (),
                   nbytes: Iterable[int] | None = None,
                   by_kernel: bool | None = None) -> torch.cuda.Event:
        """Queue ``dev.copy_(host)`` for each pair (:func:`queue_h2d`) after the current
        stream's work, and zero ``zero`` on the current stream beside them; then the current
        stream waits for the copies, the host does not. With ``nbytes``, the storage of
        each device tensor (pairs', then ``zero``'s) is first re-allocated to that many
        bytes. ``by_kernel``: see :func:`queue_h2d`. Returns the event after which the host
        tensors may be reused or unlocked."""
        current = torch.cuda.current_stream(self.opt.device)
        zero = list(zero)
        sizes = list(nbytes) if nbytes is not None else None
        if sizes is not None and len(sizes) != len(pairs) + len(zero):
            raise ValueError(f"{len(sizes)} sizes for {len(pairs) + len(zero)} tensors")
        event = queue_h2d(pairs, self._side_stream(),
                          None if sizes is None else sizes[:len(pairs)], by_kernel)
        for t, size in zip(zero, sizes[len(pairs):] if sizes is not None else []):
            t.untyped_storage().resize_(size)
        for t in zero:
            t.zero_()
        current.wait_event(event)
        return event

    # ------------------------------------------------------- low_memory_resume
    def adopt(self, moments: Moments, on_host: bool) -> Moments | None:
        """Take moments loaded by ``checkpoint.load``: on the host, they are staged (and
        None returned); otherwise they are returned for the optimizer to use."""
        for buf in self._staged_pinned:  # moments staged by an earlier load are replaced
            buf.release()
        self._staged_pinned = list(moments.pinned) if on_host else []
        self.staged = moments if on_host else None
        return None if on_host else moments

    def bring_staged(self) -> Moments | None:
        """Staged moments moved to the device (inside ``step()``, after backward), or None
        when there are none."""
        staged, opt = self.staged, self.opt
        if staged is None:
            return None
        self.staged = None
        if not self.cuda:
            return staged
        dev = staged.map(lambda t: torch.empty_like(t, device=opt.device))
        event = self._to_device(list(zip(dev.tensors(), staged.tensors())))
        if self._staged_pinned:
            self._unpin_after, self._staged_pinned = (event, self._staged_pinned), []
        return dev

    def after_step(self) -> None:
        if self._unpin_after is not None:
            event, pinned = self._unpin_after
            self._unpin_after = None
            event.synchronize()  # the staged moments have reached the device
            for buf in pinned:
                buf.release()


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
    """The forward pre-hook :meth:`HostState.offload` puts on the model's modules while
    params or grads are offloaded: a forward raises. Pickling or copying the module then
    (``torch.save(model)``, ``copy.deepcopy(model)``) raises too: its params hold nothing
    (a copy would be of freed or stale storage). A copy made otherwise, which keeps the
    guard after ``onload()`` removed it from the original, lets its forward run."""

    def __init__(self, host: HostState, module_name: str) -> None:
        self.host, self.name = host, module_name or "<root>"

    def _refusal(self, what: str) -> OffloadError:
        return OffloadError(
            f"[dp rank {self.host.opt.dp.rank}] {what} module {self.name!r} while the "
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
    """Queue ``dev.copy_(host)`` for every (contiguous device, host) pair on ``stream``, after
    the current stream's work; returns an event after all of them.

    By a kernel whose loads read the page-locked host memory (``kernels.copy_from_host_``)
    or by the copy engine (``copy_``): ``by_kernel``, by default :func:`h2d_by_kernel`. Into
    device memory that ``cudaMalloc`` returned soon after memory went back to the driver by
    ``cudaFree`` (an offload's, or an inference engine's ``empty_cache()``), copy-engine
    transfers run slower for their whole length (neither a kernel writing the memory first
    nor kernel copies first helps), while kernels run at their full rate (docs/offload.md,
    "Why onload copies by kernel"; ``benchmarks/offload.py``). With
    ``sizes``, each device storage is re-allocated to that many bytes (for the current
    stream) just before its copy is queued, so that an allocation returns while the copies
    before it run (with expandable segments an allocation maps its pages: tens of ms for
    5 GB)."""
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
    """Whether host-to-device copies into fresh memory go by kernel (:func:`queue_h2d`):
    :data:`H2D_BY_KERNEL` if set, else unless the allocator makes expandable segments
    (:func:`allocator_expandable`). There an allocation maps its pages itself, the slow part
    moves into ``resize_`` and overlaps the copies before it, and the copy engine is then the
    faster (docs/offload.md). Where the memory an onload gets was given back by unmapping (an engine
    on the CUDA virtual-memory API: torch_memory_saver, vLLM's sleep mode) rather than by
    ``cudaFree``, the copy engine reaches its full rate: ``onload(copy="copy_engine")``."""
    if H2D_BY_KERNEL is not None:
        return H2D_BY_KERNEL
    return not allocator_expandable()


def allocator_expandable() -> bool:
    """Whether torch's CUDA allocator makes expandable segments: the last
    ``expandable_segments`` of ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``, or of
    what the process set since (``torch._C._accelerator_setAllocatorSettings``, where this
    torch can report it)."""
    parts = [os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")]
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is not None:
        parts.append(get())
    found = re.findall(r"expandable_segments:(\w+)", ",".join(parts).replace(" ", "").lower())
    return bool(found) and found[-1] == "true"
