"""DistributedOptimizer: AdamW whose state is sharded over the data-parallel ranks.

Communication schedule of one iteration (``dp_size`` ranks, buckets ``B_0..B_n``
in launch order, which every rank shares):

* Phase 1, during backward: each param's gradient reaches the grad buffer; when
  every param of the next bucket in launch order has reported, that bucket's
  reduction (average) starts asynchronously. Buckets launch strictly in order, so
  every rank issues identical collectives whatever order its hooks fire in. With
  ``grad_mode="torch"`` (default, :mod:`.param_grads`) the reduction is an
  all-reduce, the autograd engine's final callback launches and waits for the
  rest, and ``param.grad`` views the averaged gradient when backward returns; with
  ``grad_mode="buffer"`` (:mod:`.sync`) it is a reduce-scatter, ``param.grad`` is
  freed, and what is left is launched in phase 2.
* Phase 2, ``step()``: re-seed the fp32 main params of params the user wrote
  since the last step (:mod:`.param_watch`), take what ``param.grad`` holds
  (``grad_mode="torch"``) or launch whatever was not launched (a param without
  a gradient on this rank counts as zero in the average), wait for all
  reductions, all-reduce the squared norm of the local grad shard for clipping
  together with one "got a gradient here" flag per param (params
  that got none on any rank are not updated and keep their step count, as in
  ``torch.optim.AdamW``: :mod:`.step_plan`), run fused AdamW on the local
  shard (fp32 main params, lazily allocated moments) and copy the result into
  the rank's shard of the model-dtype param buffer.
* Phase 3, still in ``step()`` (:mod:`.sync`): all-gather every param
  bucket, so each rank again holds the full updated params.

At ``dp_size == 1`` the collectives are skipped. No file I/O here (:mod:`shardopt.checkpoint`).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from . import build, comm, guards, quant, step_plan
from . import moments as moments_
from . import state_dict as state_dicts
from .build import SUPPORTED_DTYPES, Named, ParamGroupFn
from .buffers import FlatBuffers
from .local_state import LocalState
from .config import OptimizerConfig
from .grad_norm import GradNorm
from .host_state import KINDS, HostState
from .layout import STATE_NAMES, Layout, ParamShard, ParamSpec, build_layout
from .model_state import StateDictCopies
from .moments import Moments
from .param_grads import ParamGrads
from .param_watch import ParamWatch, Replacements
from .sync import GradientOrderError, GradSync, ParamSync
from .update import Update
from .wrap_guard import WrapGuard
from .errors import LowPrecisionStateError

__all__ = ["SUPPORTED_DTYPES", "STATE_NAMES", "DistributedOptimizer", "GradientOrderError",
           "LowPrecisionStateError", "ParamGroupFn"]


@dataclass(frozen=True)
class StepGrads:
    """What phase 1 of ``step()`` hands the update: the params that got a gradient on some
    rank (None: all), the clipping scale (None: none), and whether the update computes the
    norm itself (the Triton kernel without clipping)."""

    got: frozenset[str] | None
    grad_scale: torch.Tensor | None
    fused_norm: bool


class DistributedOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2 AdamW over the DP group ``process_group`` (default group if None).

    Construction is collective: the ranks exchange a digest of their params (FQN,
    shape, dtype) and bucket settings, and every rank raises naming the first
    differing FQN if they built different models. ``param_group_fn(fqn, param)``
    returns per-param overrides of ``lr``, ``betas``, ``eps`` and ``weight_decay``;
    params with equal overrides share one entry of ``param_groups``.

    Weights the user writes in place after construction (``model.load_state_dict``,
    ``p.zero_()``, ``nn.init.*``, ``p.copy_(ema)``) are noticed by the next ``step()``,
    which re-seeds their fp32 main params from them before updating; writes through
    ``p.data`` or by collectives (``dist.broadcast``) are not, call
    :meth:`reload_model_params` after those (the first ``step()`` re-seeds every main param
    anyway, so such writes before it need no call). Every rank must
    write the same weights (as with DDP): each rank re-seeds only the part it owns,
    and the all-gather spreads the owners' parts. Casting or moving the model after
    construction (``model.float()``, ``.to(...)``) makes ``step()`` raise
    :class:`~shardopt.param_watch.ParamMovedError`.

    ``state_dict()`` / ``load_state_dict()`` (collective) follow torch.optim, keyed
    by FQN (:mod:`shardopt.state_dict`); ``state[param]`` shows this rank's part of a
    param's state. A param belongs to one optimizer at a time.

    Gradients (``config.grad_mode``, docs/optimizer.md): ``"torch"`` (default) leaves
    each param's averaged gradient in ``param.grad`` when backward returns, as DDP does,
    and ``step()`` uses what ``param.grad`` holds; ``"buffer"`` keeps them only in the
    grad buffer. ``model.state_dict()`` hands out copies of the params
    (:mod:`shardopt.model_state`), so savers see each weight at its own size.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: OptimizerConfig | None = None,
        process_group: Any = None,
        param_group_fn: ParamGroupFn | None = None,
        **torch_kwargs: Any,
    ) -> None:
        guards.check_args(model, config, torch_kwargs)
        self.config = config if config is not None else OptimizerConfig()
        self.dp = comm.DPGroup.resolve(process_group)
        named, self.device = build.trainable(model)
        self._init_layout(model, named)
        self._init_groups(named, param_group_fn)
        self._init_state(model, named)
        self._init_sync(model, named)
        # Where the layer above that loaded this optimizer's state (checkpoint.load) says
        # it came from; held here so it lives as long as the optimizer, never read here.
        self.loaded_from: object | None = None

    def _init_layout(self, model: torch.nn.Module, named: Named) -> None:
        """Collective: the ranks agree on params and settings, then lay the params out."""
        self.aliases = build.tied_aliases(model)
        specs = [ParamSpec(fqn, tuple(p.shape), p.dtype) for fqn, p in named]
        guards.check_same_layout(self.dp, specs, self.config, guards.ownership_problem(named))
        guards.claim(self, named)
        self.layout: Layout = build_layout(specs, self.dp.size, self.config.bucket_numel,
                                           *build.alignment(self.config))
        self.buffers = FlatBuffers(named, self.layout, self.device, self.config.grad_dtype,
                                   self.config.param_grads)
        self.fqn_of = {p: fqn for fqn, p in named}
        self._fqns = tuple(fqn for fqn, _ in named)
        self.shards: tuple[ParamShard, ...] = self.layout.shards(self.dp.rank)
        # A param lies in one bucket, so this rank holds at most one shard of it.
        self.shard_of: dict[str, ParamShard] = {s.fqn: s for s in self.shards}

    def _init_groups(self, named: Named, param_group_fn: ParamGroupFn | None) -> None:
        defaults = {"lr": self.config.lr, "betas": self.config.betas, "eps": self.config.eps,
                    "weight_decay": self.config.weight_decay}
        super().__init__(build.param_groups(named, defaults, param_group_fn), defaults)
        self._groups_final = True
        self.state = LocalState(self)  # torch's defaultdict, computed on access
        self.group_of = {
            self.fqn_of[p]: gi for gi, g in enumerate(self.param_groups) for p in g["params"]
        }
        self._group_fqns = [[self.fqn_of[p] for p in g["params"]] for g in self.param_groups]
        # Per param group, the indices into ``shards`` of its params' shards.
        self.group_shards = [
            [i for i, s in enumerate(self.shards) if self.group_of[s.fqn] == gi]
            for gi in range(len(self.param_groups))]

    def _init_state(self, model: torch.nn.Module, named: Named) -> None:
        # Per layout buffer, this rank's fp32 main params (None for fp32: the params are).
        self.main_params = build.main_params(self.layout, self.buffers, self.dp, self.device)
        self._moments: Moments | None = None  # allocated lazily (first step or a load)
        # Host copies: offload()/onload() and the moments a low_memory_resume load stages.
        self._host = HostState(self, model, lambda: self._watch.rebase(
            [self.buffers.param_views[fqn] for fqn in self._watch.fqns]))
        # Updates applied to each param (torch's state[p]["step"]): a param that got no
        # gradient on any rank in a step is not updated and its count stays.
        self.param_steps: dict[str, int] = {fqn: 0 for fqn, _ in named}
        # register_state_write_hook: what must run before the state is written or freed.
        self._state_write_hooks: OrderedDict[int, Callable[[bool], None]] = OrderedDict()
        # Objects the layers above keep for as long as this optimizer lives, each under its
        # module's name (the checkpoint layer's background saves).
        self.attachments: dict[str, Any] = {}
        self._grad_norm: torch.Tensor | None = None
        self._kept_grads = step_plan.KeptGrads()
        self.step_kernel = build.choose_kernel(self.config, self.device)
        self._update = Update(self)
        self._watch = ParamWatch(self._fqns, [p for _, p in named],
                                 [(p.dtype, p.device, tuple(p.shape)) for _, p in named], self.dp.rank,
                                 [(f, p) for f, p in model.named_parameters()
                                  if not p.requires_grad])
        self._watch.replaced = Replacements(model, self.fqn_of, self.dp.rank)

    def _init_sync(self, model: torch.nn.Module, named: Named) -> None:
        """Phases 1 and 3 of the schedule (module docstring) and the norm between them."""
        grads = ParamGrads if self.config.param_grads else GradSync
        self.grad_sync = grads(self.dp, self.buffers, self.layout, self.config, named,
                               self.fqn_of)
        self.grad_sync.replaced = self._watch.replaced
        self._hooks = build.grad_hooks(self, named)
        self._norm = GradNorm(self.dp, self.buffers, self.layout, self.config, self._fqns,
                              self.grad_sync.written)
        self.param_sync = ParamSync(self.dp, self.buffers, self.layout, self.main_params,
                                    self.grad_sync.launch_order)
        self._hooks += self.param_sync.register_hooks(model, self.config, self.fqn_of)
        self._state_copies = StateDictCopies(self, model)  # model.state_dict(): own storages
        self._hooks += self._state_copies.register()
        self._wrap_guard = WrapGuard(self, model)  # wrapped in DDP or copied after this

    # ------------------------------------------------------------------- sync
    def finish_param_sync(self) -> None:
        """Wait for the param all-gathers in flight (``overlap_param_gather``); forward
        pre-hooks do it per module: call it before reading params otherwise after ``step()``."""
        self.param_sync.finish()

    def finish_grad_sync(self) -> None:
        """Collective. Reduce every bucket not yet launched (missing grads count as zero) and wait."""
        self.grad_sync.finish()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (no communication) for micro-batches inside the block."""
        return self.grad_sync.no_sync()

    def wait_grad_reductions(self) -> bool:
        """Wait for the gradient reductions in flight (starts none). Returns whether a backward
        since the last ``step()`` or ``zero_grad()`` left gradients in the grad buffers."""
        return self.grad_sync.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: ``p.grad = None`` (or zeroed in place with ``set_to_none=False``) for
        every param. With ``grad_mode="buffer"``, drops every gradient since the last step
        (``set_to_none=False``: params that had one are stepped with a zero gradient)."""
        if not self.config.param_grads:
            self._kept_grads.zero_grad(set_to_none)
        self.grad_sync.zero_grad(set_to_none)

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Collective. Reduce grads, clip, update the local shard, all-gather params: the
        module docstring's phases 2 and 3, in three steps:

        1. gradients: take or launch what backward left, wait for every reduction, and the
           global norm for clipping (or, with the Triton kernel and no clipping, the update
           computes the norm from the grads it reads);
        2. update: the state-write hooks run, then AdamW on the local shard and the copy into
           this rank's shard of the model-dtype param buffer;
        3. params: all-gather every param bucket.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_step()
        grads = self._reduce_grads()
        self._update_shard(grads)
        self._publish_params()
        return loss

    def _check_step(self) -> None:
        self._wrap_guard.check_step()
        self._host.check_onloaded("step()")
        guards.check_group_options(self)
        self.finish_param_sync()  # the update writes into the param buffers
        self.reseed_written()  # before any collective: a moved param raises

    def _reduce_grads(self) -> StepGrads:
        self.grad_sync.before_step()
        # Clipping needs the norm before the update; otherwise the Triton update computes
        # it from the grads it reads anyway.
        fused_norm = self.step_kernel == "triton" and not self.config.max_grad_norm
        grad_scale = None
        if fused_norm:
            got = self._norm.agree(None)[1]
        else:
            self._grad_norm, grad_scale, got = self._norm.global_norm()
        return StepGrads(got, grad_scale, fused_norm)

    def _update_shard(self, grads: StepGrads) -> None:
        # Staged moments' page-locked memory is released after the step: the host waits.
        self._before_state_write(host=self._host.staged is not None)
        self._ensure_moments()
        got = self._kept_grads.step(grads.got, self._fqns)
        steps = step_plan.next_steps(self.param_steps, self._group_fqns, got)
        if self.step_kernel == "triton":
            sq = self._update.triton(grads.grad_scale, grads.fused_norm, steps, got)
            if sq is not None:
                self._grad_norm = self._norm.finish(sq)
        else:
            self._update.torch(grads.grad_scale, steps, got)
        step_plan.advance(self.param_steps, self._group_fqns, got, steps)

    def _publish_params(self) -> None:
        self.param_sync.publish(own_written=self.step_kernel == "triton",
                                wait=not self.config.overlap_param_gather)
        self._watch.record()  # the update's own writes are not the user's
        self.grad_sync.after_step()
        self._host.after_step()

    @property
    def param_writes(self) -> int:
        """How many times the optimizer has written the params (steps, loads, onloads)."""
        return self._watch.writes

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm before clipping of the last ``step()`` (syncs when read)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    # ------------------------------------------------------------------ state
    def _ensure_moments(self) -> None:
        staged = self._host.bring_staged()  # low_memory_resume: moments waited until now
        if staged is not None or self._moments is None:
            self._moments = staged if staged is not None else moments_.zeros(self)
            self._update.views = None

    @property
    def moments(self) -> Moments | None:
        """This rank's Adam moments on the device in their storage format (None before the
        first step, and while a ``low_memory_resume`` load keeps them on the host)."""
        return self._moments

    @property
    def has_moments(self) -> bool:
        """Whether the moments exist (on the device or staged on the host by a load)."""
        return self._moments is not None or self._host.staged is not None

    def allocate_moments(self, on_host: bool = False) -> Moments:
        """New moments in this optimizer's storage format for a load to fill: params' parts
        uninitialised, padding and scales zero; ``on_host``: in (page-locked) host memory."""
        return moments_.allocate(self, on_host)

    def state_view(self, name: str, shard: ParamShard) -> torch.Tensor:
        """1-D fp32 view of state ``name`` for ``shard`` (a record of this rank's); while
        offloaded, of its host copy."""
        if name == "master_param" and self.main_params[shard.buffer_index] is None:
            return self.buffers.shard_params(shard)
        if name != "master_param" and self.config.lowprec_moments:
            raise LowPrecisionStateError(moments_.no_fp32_view(self, name))
        return self._host.local(name, shard.buffer_index)[shard.range_local.as_slice()]

    def moment_view(self, name: str, shard: ParamShard) -> quant.Moment:
        """Moment ``name`` (``"exp_avg"``/``"exp_avg_sq"``) of ``shard`` (a record of this
        rank's) in its storage form: views of its values and, for int8, of the scales of
        its blocks (the shard starts on a block boundary); while offloaded, of the host copy."""
        return moments_.piece(self._host.local_moment(name, shard.buffer_index),
                              shard.range_local)

    def state_sources(self) -> dict[str, torch.Tensor]:
        """The flat tensors this rank's state is read from now, named alike across offload,
        load and onload: ``params.i``, ``master_param.i`` (not for fp32 params) and, once
        the moments exist, ``exp_avg.i``, ``exp_avg_sq.i`` and int8 ``{name}.scale.i`` for
        buffer ``i``. The views :meth:`state_view`, :meth:`moment_view` and
        ``buffers.shard_params`` return are views of them."""
        params = self.buffers.host_params or self.buffers.param_buffers
        out: dict[str, torch.Tensor] = {}
        for i in range(len(self.layout.buffers)):
            out[f"params.{i}"] = params[i]
            if self.main_params[i] is not None:
                out[f"master_param.{i}"] = self._host.local("master_param", i)
            for name in moments_.NAMES if self.has_moments else ():
                m = self._host.local_moment(name, i)
                out[f"{name}.{i}"] = m.values
                if m.scales is not None:
                    out[f"{name}.scale.{i}"] = m.scales
        return out

    def adopt_state(self, moments: Moments, param_steps: dict[str, int],
                    on_host: bool = False) -> None:
        """Collective. Take loaded moments (``on_host``: kept there until the first step,
        with the page-locked memory they carry) and per-param step counts; rebuild params
        from the master params (loaded in place) and all-gather them."""
        self._moments = self._host.adopt(moments, on_host)
        self.param_steps.update(param_steps)
        self._update.views = None
        self.param_sync.publish()
        self._watch.record()  # the loaded weights replace whatever the user wrote before

    # ---------------------------------------------------------------- offload
    def offload(self, what: tuple[str, ...] | list[str] = KINDS) -> None:
        """Move ``what`` (of :data:`~shardopt.host_state.KINDS`; default all) to pinned host
        memory and give its device memory back; a forward, ``step()`` and ``checkpoint.load``
        are refused until :meth:`onload`. Not collective. See :mod:`shardopt.host_state`."""
        self._before_state_write(host=True)  # offload frees (CUDA) or overwrites (CPU) it
        if not self.offloaded:  # the host copies hold the weights written since the last step
            self.reseed_written()
        self._host.offload(what)

    def onload(self, copy: str | None = None) -> None:
        """Bring back what :meth:`offload` moved, bit for bit (no-op when nothing is
        offloaded). The host copies are kept for the next offload. ``copy`` (CUDA): how the
        bytes reach the device, ``"kernel"`` (a kernel reading the pinned host memory, ~90%
        of the copy engine's rate whatever happened before) or ``"copy_engine"`` (full rate,
        but ~15% slower into memory that ``cudaFree`` gave back just before, as an engine's
        ``empty_cache()`` does; use it when the engine gives memory back by unmapping, as
        torch_memory_saver and vLLM's sleep mode do); default
        :func:`~shardopt.host_state.h2d_by_kernel`."""
        self._host.onload(copy)

    def release_host_memory(self) -> None:
        """Free the host copies :meth:`offload` keeps between cycles (refused while offloaded)."""
        self._host.release()

    def check_onloaded(self, what: str, kinds: Iterable[str] = KINDS) -> None:
        """Raise :class:`~shardopt.host_state.OffloadError` naming ``what`` if ``kinds`` are out."""
        self._host.check_onloaded(what, kinds)

    @property
    def offloaded(self) -> tuple[str, ...]:
        """The kinds of state now offloaded (empty when none)."""
        return self._host.offloaded

    def iter_param_buckets(self) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
        """``(fqns, flat)`` per bucket (by buffer, then bucket index): ``flat`` (model dtype)
        holds its params back to back in ``fqns`` order (:meth:`FlatBuffers.packed_params`).
        Waits for param all-gathers in flight; refused while params are offloaded, at the
        call and at every bucket (the iterator is lazy, and its views hold nothing then)."""
        self._host.check_onloaded("iter_param_buckets()", ("params",))
        self.finish_param_sync()
        return self._param_buckets()

    def _param_buckets(self) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
        for buf in self.layout.buffers:
            for b in buf.buckets:
                self._host.check_onloaded("iter_param_buckets()", ("params",))
                yield b.param_fqns, self.buffers.packed_params(b)

    def reload_model_params(self) -> None:
        """Re-seed every fp32 main param this rank holds from the model's current params.

        In-place writes (``load_state_dict``, ``p.copy_``, ``nn.init.*``, ...) bump the
        params' version counters and are re-seeded by ``step()`` itself; writes that bypass
        the counter (``p.data``, collectives, a tensor sharing the storage, DLPack, CUDA
        kernels) need this call, on every rank after every rank set the same weights, before
        the next ``step()`` (but the first, which re-seeds every main param). fp32 params
        need neither: their main param is the param."""
        self._host.check_onloaded("reload_model_params()", ("params",))  # not the writes
        self.finish_param_sync()  # an all-gather in flight would overwrite the user's weights
        self._before_state_write(host=True)
        self._watch.written()  # only to raise if a param was moved out of the buffer
        self._reseed(self._fqns)

    def reseed_written(self) -> None:
        """Re-seed the main params of params written in place since the optimizer last wrote
        them, as ``step()``, ``state_dict()`` and ``checkpoint.save`` do first."""
        if not self._host.refuses_reseed(self._watch):
            written = self._watch.written()
            if written:
                self._before_state_write(host=False)
            self._reseed(written)

    def _reseed(self, fqns: Iterable[str]) -> None:
        """Copy the params of ``fqns`` into this rank's fp32 main params where they differ
        from them rounded: an element written back unchanged keeps its fp32 digits."""
        for fqn in fqns:
            s = self.shard_of.get(fqn)
            if s is not None and self.main_params[s.buffer_index] is not None:  # fp32: no copy
                main, param = self.state_view("master_param", s), self.buffers.shard_params(s)
                main.copy_(torch.where(param != main.to(param.dtype), param.float(), main))

    def state_dict(self) -> dict[str, Any]:
        """This rank's state keyed by FQN, values viewing the live state
        (:mod:`shardopt.state_dict`). Resumes bitwise at the same DP size; through
        ``torch.distributed.checkpoint`` at any DP size."""
        return state_dicts.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Collective. Adopt a :meth:`state_dict` of this rank's; on any mismatch every rank
        raises :class:`~shardopt.state_dict.StateDictError` and nothing changes."""
        self._host.check_onloaded("load_state_dict()")  # it would write into freed storage
        self._before_state_write(host=True)
        state_dicts.load_state_dict(self, state_dict)

    def register_state_write_hook(self, hook: Callable[[bool], None]) -> RemovableHandle:
        """Register ``hook(host)``, run before anything writes or frees this rank's state
        (params, main params, moments): ``step()``, ``load_state_dict()``, ``offload()``,
        ``reload_model_params()`` and re-seeding written params. It returns once what reads
        the state may be overwritten: the host has waited for those readers where ``host``
        is true (memory is freed, or written from the host), else the current CUDA stream
        waits for them. An asynchronous ``checkpoint.save`` registers one while it copies the
        state (:mod:`shardopt.checkpoint.snapshot`). ``handle.remove()`` unregisters it."""
        handle = RemovableHandle(self._state_write_hooks)
        self._state_write_hooks[handle.id] = hook
        return handle

    def _before_state_write(self, host: bool) -> None:
        for hook in list(self._state_write_hooks.values()):  # a hook may remove itself
            hook(host)

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise a ``ValueError`` naming a param unless ``model`` is the one built over."""
        guards.check_model(self, model)

    def add_param_group(self, param_group: dict[str, Any]) -> None:  # noqa: D102
        if getattr(self, "_groups_final", False):
            raise NotImplementedError(
                "DistributedOptimizer lays all params out at construction; for per-param "
                "settings pass param_group_fn=lambda fqn, param: {'lr': ...} to the constructor")
        super().add_param_group(param_group)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, by kind (optimizer state counts only what is allocated)."""
        return moments_.memory_bytes(self)
