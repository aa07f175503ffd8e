"""This rank's shard state: every flat state tensor, and where its values are.

One record (:class:`Held`) per flat tensor, named ``{name}.{i}`` for layout buffer ``i``:
``params`` and ``grads`` (``param_grads``: the param-dtype copy ``p.grad`` views, where it
is another tensor); ``master_param``, the fp32 main params of a bf16/fp16 buffer (an fp32
buffer's are its params); ``exp_avg``, ``exp_avg_sq`` and for int8 ``{moment}.scale``, once
the moments exist. A record says where the values are: on the device, in its host copy
(offloaded), staged on the host until the first step (``low_memory_resume``), or nowhere
(freed gradients, zeros at onload). Muon's buffers (``whole``) hold ``momentum_buffer``
instead of the Adam moments. Offload, onload, loads and the first step replace
records; the update, ``state_dict`` and checkpoints read them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from . import comm, quant
from .buffers import FlatBuffers
from .config import INT8, OptimizerConfig, dtype_name
from .errors import LowPrecisionStateError
from .layout import Layout, ParamShard, Range
from .moments import ALL_NAMES, MOMENTUM, NAMES, Moments, piece
from .pinned import PinnedBuffer

DEVICE, HOST, STAGED, FREED = "device", "host", "staged", "freed"
KINDS = ("moments", "main_params", "grads", "params")  # what offload() moves


@dataclass(frozen=True)
class Held:
    """One flat state tensor: its kind (of :data:`KINDS`), where its values are, the device
    tensor (storage freed while offloaded on CUDA; None while staged) and the host copy with
    its page-locked memory (kept between offloads)."""

    kind: str
    where: str
    device: torch.Tensor | None
    host: torch.Tensor | None = None
    pin: PinnedBuffer | None = None

    @property
    def tensor(self) -> torch.Tensor:
        """The tensor holding the values now."""
        t = self.device if self.where == DEVICE else self.host
        if t is None:
            raise RuntimeError(f"a {self.kind} tensor whose values were dropped ({self.where})")
        return t

    @property
    def dtype(self) -> torch.dtype:
        return (self.device if self.device is not None else self.tensor).dtype


@dataclass(frozen=True)
class LoadTarget:
    """Where a load reads moments into, and whether they are ``new`` (else the live ones)."""

    moments: Moments
    new: bool


class ShardState:
    """The records of one rank (module docstring), and the facts of its layout."""

    def __init__(self, layout: Layout, buffers: FlatBuffers, dp: comm.DPGroup,
                 config: OptimizerConfig, device: torch.device) -> None:
        self.layout, self.buffers, self.dp, self.config = layout, buffers, dp, config
        self.device = device
        self.shards: tuple[ParamShard, ...] = layout.shards(
            dp.rank, {b.dp_group: g.rank for b, g in zip(layout.buffers, buffers.dp)})
        # A param lies in one bucket, so this rank holds at most one shard of it.
        self.shard_of = {s.fqn: s for s in self.shards}
        self.kinds = {"exp_avg": config.exp_avg_dtype, "exp_avg_sq": config.exp_avg_sq_dtype}
        # Per param FQN, its moments: Adam's, or Muon's momentum buffer (fp32).
        self.moment_names = {fqn: (MOMENTUM,) if layout.buffers[slot.buffer_index].whole
                             else NAMES for fqn, slot in layout.slots.items()}
        self.held: dict[str, Held] = {}
        self.generation = 0  # bumped whenever a record's device tensor is another one
        for i, buf in enumerate(layout.buffers):
            self.held[f"params.{i}"] = Held("params", DEVICE, buffers.param_buffers[i])
            self.held[f"grads.{i}"] = Held("grads", DEVICE, buffers.grad_buffers[i])
            if buffers.mirrored(i):
                self.held[f"param_grads.{i}"] = Held("grads", DEVICE,
                                                     buffers.param_grad_buffers[i])
            if buf.dtype != torch.float32:
                main = torch.zeros(buf.local_numel, dtype=torch.float32, device=device)
                for b in buf.buckets:  # seeded from this rank's shard of the params
                    main.narrow(0, buf.local_offset(b.index), b.shard_numel).copy_(
                        buffers.bucket_params(b).narrow(0, buffers.dp[i].rank * b.shard_numel,
                                                        b.shard_numel))
                self.held[f"master_param.{i}"] = Held("main_params", DEVICE, main)

    # ------------------------------------------------------------------ reads
    def main(self, i: int) -> torch.Tensor | None:
        """Buffer ``i``'s fp32 main params on the device (None for an fp32 buffer)."""
        held = self.held.get(f"master_param.{i}")
        return None if held is None else held.device

    @property
    def has_moments(self) -> bool:
        """Whether the moments exist (on the device, offloaded, or staged by a load)."""
        return self._first_moment() is not None

    @property
    def has_staged(self) -> bool:
        """Whether a ``low_memory_resume`` load's moments wait on the host for the first step."""
        first = self._first_moment()
        return first is not None and first.where == STAGED

    def _first_moment(self) -> Held | None:
        return next((h for h in self.held.values() if h.kind == "moments"), None)

    def moment_numel(self, name: str, i: int) -> int:
        """Elements of moment ``name`` in buffer ``i``: Muon's buffers hold only the momentum
        buffer, the others only the Adam moments."""
        buf = self.layout.buffers[i]
        return buf.local_numel if buf.whole == (name == MOMENTUM) else 0

    def kind(self, name: str) -> torch.dtype | str:
        """How moment ``name`` is stored (Muon's momentum buffer: fp32)."""
        return self.kinds.get(name, torch.float32)

    def device_moments(self) -> Moments | None:
        """The moments on the device, as the update reads them (None when there are none)."""
        if not self.has_moments or self.has_staged:
            return None
        exp_avg, exp_avg_sq, momentum = (
            tuple(self._moment(name, i, device=True) for i in range(len(self.layout.buffers)))
            for name in ALL_NAMES)
        return Moments(exp_avg, exp_avg_sq, momentum_buffer=momentum)

    def _moment(self, name: str, i: int, device: bool = False) -> quant.Moment:
        if name not in ALL_NAMES:
            raise KeyError(f"no moment {name!r}; the moments are {list(ALL_NAMES)}")
        held = self.held.get(f"{name}.{i}")
        if held is None and self.has_moments and not self.moment_numel(name, i):
            return quant.Moment(self.kind(name), 0, self.device, sqrt=name == NAMES[1])
        if held is None:
            raise RuntimeError(f"optimizer state {name!r} is not allocated before the first step")
        scales = self.held.get(f"{name}.scale.{i}")
        pick = (lambda h: h.device) if device else (lambda h: h.tensor)
        return quant.Moment.wrap(self.kind(name), pick(held),
                                 None if scales is None else pick(scales), name == NAMES[1])

    def sources(self) -> dict[str, torch.Tensor]:
        """The flat tensors of the state a save reads (every record but the gradients), by
        name, where their values are now."""
        return {name: h.tensor for name, h in self.held.items() if h.kind != "grads"}

    def view(self, name: str, shard: ParamShard) -> torch.Tensor:
        """1-D view of state ``name`` (``params``, ``master_param`` or an fp32 moment) of
        ``shard`` (a record of this rank's), where its values are now."""
        i = shard.buffer_index
        if name == "params" or (name == "master_param" and f"master_param.{i}" not in self.held):
            return self.held[f"params.{i}"].tensor[shard.range_global.as_slice()]
        if name == "master_param":
            return self.held[f"master_param.{i}"].tensor[shard.range_local.as_slice()]
        if name not in ALL_NAMES:
            raise KeyError(f"no optimizer state {name!r}; the state is "
                           f"{['params', 'master_param', *ALL_NAMES]}")
        if self.config.lowprec_moments and name != MOMENTUM:
            raise LowPrecisionStateError(
                f"[dp rank {self.dp.rank}] shard_state.view({name!r}) is an fp32 view; this "
                f"optimizer stores its moments as {_shown(self.kinds['exp_avg'])!r} / "
                f"{_shown(self.kinds['exp_avg_sq'])!r}: use shard_state.moment()")
        return self._moment(name, i).values[shard.range_local.as_slice()]

    def moment(self, name: str, shard: ParamShard) -> quant.Moment:
        """Moment ``name`` of ``shard`` in its storage form: views of its values and, for
        int8, of the scales of its blocks (the shard starts on a block boundary)."""
        return piece(self._moment(name, shard.buffer_index), shard.range_local)

    def memory_bytes(self) -> dict[str, int]:
        """Params, grads and the optimizer state allocated now (staged moments not counted)."""
        out = self.buffers.num_bytes()
        out["optimizer_state"] = sum(
            h.device.numel() * h.device.element_size() for h in self.held.values()
            if h.kind in ("main_params", "moments") and h.where != STAGED)
        return out

    # ---------------------------------------------------------------- changes
    def reseed(self, fqns: Iterable[str]) -> None:
        """Copy the params of ``fqns`` into the fp32 main params where they differ from them
        rounded: an element written back unchanged keeps its fp32 digits."""
        for fqn in fqns:
            s = self.shard_of.get(fqn)
            if s is not None and self.main(s.buffer_index) is not None:  # fp32: no copy
                main, param = self.view("master_param", s), self.view("params", s)
                main.copy_(torch.where(param != main.to(param.dtype), param.float(), main))

    def replace(self, name: str, **changes: object) -> None:
        """Change record ``name`` (where it is, its tensors)."""
        if "device" in changes:
            self.generation += 1
        self.held[name] = dataclasses.replace(self.held[name], **changes)

    def load_target(self, on_host: bool) -> LoadTarget:
        """Where loaded moments go: new ones on the host (``on_host``) or before the moments
        are on the device (a load reads into them before the ranks agree); else the moments
        in place, so a resume never holds a second copy of the state. Padding and scales of
        new moments are zero, the rest is for the load to fill."""
        moments = None if on_host else self.device_moments()
        if moments is not None:
            return LoadTarget(moments, False)
        cuda = self.device.type == "cuda"
        pinned: list[PinnedBuffer] = []

        def tensor(dtype: torch.dtype, numel: int, bi: int | None) -> torch.Tensor:
            if not numel:  # a moment this buffer has not
                return torch.empty(0, dtype=dtype, device="cpu" if on_host else self.device)
            if on_host and cuda:  # page-locked; registering faults every page in
                pinned.append(PinnedBuffer(numel, dtype))
                t = pinned[-1].tensor
            elif cuda:
                t = torch.empty(numel, dtype=dtype, device=self.device)
            else:  # pageable host memory: a memset faults pages in faster than the reads would
                return torch.zeros(numel, dtype=dtype)
            if bi is None:
                return t.zero_()
            self._zero_padding(t, bi)
            return t

        out = []
        for name in ALL_NAMES:
            kind, sqrt = self.kind(name), name == NAMES[1]
            numels = [self.moment_numel(name, bi) for bi in range(len(self.layout.buffers))]
            out.append(tuple(
                quant.Moment.wrap(kind, tensor(quant.storage_dtype(kind, sqrt), n, bi),
                                  tensor(torch.float32, quant.num_scales(n), None)
                                  if kind == INT8 else None, sqrt)
                for bi, n in enumerate(numels)))
        return LoadTarget(Moments(out[0], out[1], tuple(pinned), out[2]), True)

    def _zero_padding(self, t: torch.Tensor, bi: int) -> None:
        """Zero what no param shard of buffer ``bi`` covers in local tensor ``t``."""
        covered = sorted((s.range_local for s in self.shards if s.buffer_index == bi),
                         key=lambda r: r.start)
        pos = 0
        for r in covered + [Range(t.numel(), t.numel())]:
            if r.start > pos:
                t[pos:r.start].zero_()
            pos = max(pos, r.end)

    def set_moments(self, moments: Moments, where: str) -> None:
        """Take ``moments`` (a load's, or zeros) on the device or ``STAGED`` on the host, with
        their page-locked memory; an offload copy that still fits is kept, replaced staged
        memory unlocked."""
        pin_of = {p.tensor.data_ptr(): p for p in moments.pinned}
        for name, t in moments.named().items():
            old = self.held.get(name)
            if old is not None and old.where == STAGED and old.pin is not None:
                old.pin.release()
            elif (where == DEVICE and old is not None and old.host is not None
                  and (old.host.numel(), old.host.dtype) == (t.numel(), t.dtype)):
                self.held[name] = Held("moments", DEVICE, t, old.host, old.pin)
                continue
            elif old is not None and old.pin is not None:
                old.pin.release()
            if where == STAGED:
                self.held[name] = Held("moments", STAGED, None, t, pin_of.get(t.data_ptr()))
            else:
                self.held[name] = Held("moments", DEVICE, t)
        self.generation += 1

    def ensure_moments(self) -> None:
        """Zero moments on the device if there are none yet: what the first step starts from."""
        if not self.has_moments:
            exp_avg, exp_avg_sq, momentum = (tuple(
                quant.Moment(self.kind(name), self.moment_numel(name, bi), self.device,
                             sqrt=name == NAMES[1])
                for bi in range(len(self.layout.buffers))) for name in ALL_NAMES)
            self.set_moments(Moments(exp_avg, exp_avg_sq, momentum_buffer=momentum), DEVICE)


def _shown(kind: torch.dtype | str) -> str:
    return kind if isinstance(kind, str) else dtype_name(kind)
