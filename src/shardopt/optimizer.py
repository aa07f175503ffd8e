"""DistributedOptimizer: AdamW whose state is sharded over the data-parallel ranks.

Communication schedule of one iteration (buckets in a launch order every rank shares; at
``dp_size == 1`` the collectives are skipped):

* Phase 1, in backward and at the start of ``step()``: when every param of the next bucket
  has its gradient, that bucket's reduction (average) starts asynchronously, in launch order:
  all-reduces with ``grad_mode="torch"`` (:mod:`.param_grads`), reduce-scatters with
  ``"buffer"`` (:mod:`.sync`). ``step()`` re-seeds the main params of weights the user wrote
  (:mod:`.param_watch`), waits, and all-reduces the squared norm of the local grad shard with
  one "got a gradient" flag per param (:mod:`.grad_norm`).
* Phase 2, ``step()``: fused AdamW on the local shard (:mod:`.update`), Muon on the whole
  matrices this rank owns (:mod:`.muon_update`); a param with no gradient on any rank is left
  alone, as in ``torch.optim.AdamW``.
* Phase 3, ``step()`` (:mod:`.sync`): all-gather every param bucket.

The state and where it is: :mod:`.shard_state`; offload: :mod:`.host_state`. No file I/O
here (:mod:`shardopt.checkpoint`).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from . import build, comm, guards, host_state, muon, parallel
from . import state_dict as state_dicts
from .build import ParamGroupFn
from .buffers import FlatBuffers
from .config import OptimizerConfig
from .grad_norm import Agreed, GradNorm
from .host_state import HostState
from .layout import STATE_NAMES, Layout, ParamSpec, build_layout
from .local_state import LocalState
from .model_state import StateDictCopies
from .moments import Moments
from .muon_update import MuonUpdate, split_shards
from .param_grads import ParamGrads
from .parallel_norm import ParallelGradNorm
from .param_watch import ParamWatch, Replacements
from .shard_access import ShardStateAccess
from .shard_state import DEVICE, KINDS, STAGED, ShardState
from .sync import GradSync, ParamSync
from .update import KeptGrads, Update, advance, next_steps
from .wrap_guard import WrapGuard

__all__ = ["STATE_NAMES", "DistributedOptimizer", "ParamGroupFn", "ShardStateAccess"]


class DistributedOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2 AdamW over the DP group ``process_group`` (default group if None).

    Construction is collective (ranks that built different models raise, naming the first
    differing FQN). ``param_group_fn(fqn, param)`` returns per-param overrides of ``lr``,
    ``betas``, ``eps`` and ``weight_decay``, or ``{"optimizer": "muon", ...}`` with Muon's
    settings for a 2-D param (:mod:`.muon`). Params may be DTensors (``parallelize_module``);
    ``dp_group_fn(fqn, param)`` returns the DP group of a param whose group is not
    ``process_group`` (experts), or None (:mod:`.parallel`). Semantics: docs/optimizer.md; the
    layers above the optimizer use :attr:`shard_state` (:class:`ShardStateAccess`).
    """

    def __init__(self, model: torch.nn.Module, config: OptimizerConfig | None = None,
                 process_group: Any = None, param_group_fn: ParamGroupFn | None = None,
                 dp_group_fn: parallel.DPGroupFn | None = None, **torch_kwargs: Any) -> None:
        guards.check_args(model, config, torch_kwargs)
        self.config = config if config is not None else OptimizerConfig()
        dp = comm.DPGroup.resolve(process_group)
        named, device = build.trainable(model)
        self._parallel = par = parallel.plan(named, dp, dp_group_fn)  # None: data parallel
        defaults = {"lr": self.config.lr, "betas": self.config.betas, "eps": self.config.eps,
                    "weight_decay": self.config.weight_decay}
        groups, problem = [], guards.ownership_problem(named)
        try:
            groups = build.param_groups(named, defaults, param_group_fn)
        except ValueError as e:  # raised on every rank by the agreement below
            problem = problem or str(e)
        whole = {id(p) for g in groups if muon.is_muon(g) for p in g["params"]}  # laid out whole
        if par is None:
            specs = [ParamSpec(fqn, tuple(p.shape), p.dtype, id(p) in whole) for fqn, p in named]
        else:
            specs = par.specs(named)
            problem = problem or parallel.muon_problem(named, whole)
        guards.check_same_layout(dp, specs, self.config, problem)
        if par is None:
            self.layout: Layout = muon.plan_layout(specs, dp.size, self.config.bucket_numel,
                                                   *build.alignment(self.config))
        else:
            self.layout = build_layout(specs, dp.size, self.config.bucket_numel,
                                       *build.alignment(self.config), par.group_sizes())
        self._buffers = FlatBuffers(named, self.layout, device, self.config.grad_dtype,
                                    [dp] if par is None else par.groups, self.config.param_grads)
        self._state = ShardState(self.layout, self._buffers, dp, self.config, device)
        self._fqn_of = {p: fqn for fqn, p in named}
        self._fqns = tuple(fqn for fqn, _ in named)
        self._init_groups(groups, defaults)
        self._init_sync(model, named)
        self.shard_state = ShardStateAccess(self, build.tied_aliases(model))
        self.state = LocalState(self)  # torch's defaultdict, computed on access
        self._hooks += StateDictCopies(self, model).register()  # model.state_dict(): copies

    def _init_groups(self, groups: list[dict[str, Any]], defaults: dict[str, Any]) -> None:
        super().__init__(groups, defaults)
        self._groups_final = True
        self._group_of = {self._fqn_of[p]: gi for gi, g in enumerate(self.param_groups)
                          for p in g["params"]}
        self._group_fqns = [[self._fqn_of[p] for p in g["params"]] for g in self.param_groups]
        group_shards = [[i for i, s in enumerate(self._state.shards) if self._group_of[s.fqn] == gi]
                        for gi in range(len(self.param_groups))]
        adamw_shards, muon_shards = split_shards(group_shards, self.param_groups)
        # Updates applied to each param (torch's state[p]["step"]; :mod:`.update`).
        self.param_steps: dict[str, int] = {fqn: 0 for fqn in self._fqns}
        kernel = build.choose_kernel(self.config, self._state.device)
        self._update = Update(self._state, kernel, self.param_groups, adamw_shards,
                              self._group_of, self.param_steps)
        self._muon = MuonUpdate(self._state, self.param_groups, muon_shards,
                                self._update.writes_params)

    def _init_sync(self, model: torch.nn.Module, named: build.Named) -> None:
        """Phases 1 and 3 of the schedule, the norm between them, and the checks around them."""
        dp = self._state.dp
        replaced = Replacements(model, self._fqn_of, dp.rank)
        frozen = [(f, p) for f, p in model.named_parameters() if not p.requires_grad]
        self._watch = ParamWatch(named, dp.rank, frozen, replaced)
        grads = ParamGrads if self.config.param_grads else GradSync
        self._grad_sync = grads(dp, self._buffers, self.layout, self.config, named,
                                self._fqn_of, replaced)
        self._host = HostState(self._state, [  # the root too: it may use a child's weight
            (name, m) for name, m in model.named_modules() if m is model
            or any(p in self._fqn_of for p in m.parameters(recurse=False))])
        self._offload_versions: list[int] | None = None  # the params' versions at offload()
        self._hooks = build.grad_hooks(self, self._grad_sync, self._host, named)
        if self._parallel is None:
            self._norm = GradNorm(dp, self._buffers, self.layout, self.config, self._fqns,
                                  self._grad_sync.written)
        else:  # the fused kernel's sum of squares would count every copy of a param
            self._update.fuses_norm = False
            self._norm = ParallelGradNorm(self._parallel, self._buffers, self.layout,
                                          self.config, self._fqns, self._grad_sync.written,
                                          self._state.shards)
        self._param_sync = ParamSync(self._state, self._grad_sync.launch_order)
        self._hooks += self._param_sync.register_hooks(model, self.config, self._fqn_of)
        self._wrap_guard = WrapGuard(self._grad_sync, model)  # wrapped in DDP or copied after
        self._state_write_hooks: OrderedDict[int, Callable[[bool], None]] = OrderedDict()
        self._grad_norm: torch.Tensor | None = None
        self._kept_grads = KeptGrads()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Collective. Run ``closure`` if given (its loss is returned), then the schedule's
        three phases:

        1. gradients: check the optimizer may step, re-seed written weights, wait for the
           reductions, agree on the global norm and on who got a gradient;
        2. update: the state-write hooks run, then AdamW on the local shard and the copy into
           this rank's shard of the model-dtype param buffer;
        3. params: all-gather every param bucket.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        agreed = self._reduce_grads()
        self._update_shard(agreed)
        self._publish_params()
        return loss

    def _reduce_grads(self) -> Agreed:
        self._wrap_guard.check_step()
        self._host.check_onloaded("step()")
        guards.check_group_options(self.param_groups, self._fqn_of)
        self._param_sync.finish()  # the update writes into the param buffers
        self._reseed_written()  # before any collective: a moved param raises
        self._grad_sync.before_step()
        if self._update.fuses_norm:  # the Triton kernel sums the squares as it reads the grads
            return self._norm.agree(None)
        agreed = self._norm.global_norm()
        self._grad_norm = agreed.total
        return agreed

    def _update_shard(self, agreed: Agreed) -> None:
        # Staged moments' page-locked memory is released after the step: the host waits.
        self._before_state_write(host=self._state.has_staged)
        self._host.bring_staged()  # low_memory_resume: the loaded moments waited until now
        self._state.ensure_moments()
        got = self._kept_grads.step(agreed.got, self._fqns)
        steps = next_steps(self.param_steps, self._group_fqns, got)
        sq = self._update.run(agreed.grad_scale, steps, got)
        self._muon.run(agreed.grad_scale, got)
        if sq is not None:
            self._grad_norm = self._norm.finish(sq)
        advance(self.param_steps, self._group_fqns, got, steps)

    def _publish_params(self) -> None:
        self._param_sync.publish(own_written=self._update.writes_params,
                                 wait=not self.config.overlap_param_gather)
        self._watch.record()  # the update's own writes are not the user's
        self._grad_sync.after_step()
        self._host.after_step()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (no communication) for micro-batches inside the block."""
        return self._grad_sync.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's (``grad_mode="buffer"``: drops every gradient since the last step;
        ``set_to_none=False``: params that had one are stepped with a zero gradient)."""
        if not self.config.param_grads:
            self._kept_grads.zero_grad(set_to_none)
        self._grad_sync.zero_grad(set_to_none)

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm before clipping of the last ``step()`` (syncs when read)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def finish_param_sync(self) -> None:
        """Wait for the param all-gathers ``overlap_param_gather`` leaves in flight: call it
        before reading params outside a forward (each module's forward waits for its own)."""
        self._param_sync.finish()

    def offload(self, what: tuple[str, ...] | list[str] = KINDS) -> None:
        """Move ``what`` (of :data:`~shardopt.shard_state.KINDS`; default all) to pinned host
        memory and free its device memory; forward, ``step()`` and loads are refused until
        :meth:`onload`. Not collective (docs/offload.md)."""
        self._before_state_write(host=True)  # offload frees (CUDA) or overwrites (CPU) it
        if not self._host.offloaded:  # the host copies hold the weights written since the step
            self._reseed_written()
        self._param_sync.finish()  # all-gathers write into the param buffers
        pending = self._grad_sync.wait()  # reductions write into the grad buffers
        self._host.offload(what, pending)
        if "params" in self._host.offloaded:
            self._offload_versions = self._watch.versions()

    def onload(self, copy: str | None = None) -> None:
        """Bring back what :meth:`offload` moved, bit for bit; the host copies stay for the next
        offload. ``copy`` (CUDA): ``"kernel"`` or ``"copy_engine"``, default
        :func:`~shardopt.host_state.h2d_by_kernel` (docs/offload.md)."""
        offloaded = self._host.offloaded
        self._host.onload(copy)
        if not offloaded:
            return
        # The params' storage was re-allocated: new addresses.
        self._watch.rebase([self._buffers.param_views[fqn] for fqn in self._fqns])
        versions, self._offload_versions = self._offload_versions, None
        lost = [] if versions is None else self._watch.undone(versions)
        if lost:
            raise host_state.lost_writes(self._state.dp.rank, lost)

    def release_host_memory(self) -> None:
        """Free the host copies :meth:`offload` keeps between cycles (refused while offloaded)."""
        self._before_state_write(host=True)  # a background save may be reading them
        self._host.release()

    def iter_param_buckets(self, with_placements: bool = False) -> Iterator[tuple[Any, ...]]:
        """``(fqns, flat)`` per bucket: ``flat`` (model dtype) holds its params back to back in
        ``fqns`` order (a DTensor param's local tensor). ``with_placements``: ``(fqns, flat,
        placed)``, ``placed`` the :class:`~shardopt.parallel.ParamParallel` of each param
        (global shape, placements, this rank's box), None for a model of plain params.
        Waits for all-gathers in flight; refused while params are offloaded."""
        self._host.check_onloaded("iter_param_buckets()", ("params",))
        self._param_sync.finish()
        return self._param_buckets(with_placements)

    def _param_buckets(self, with_placements: bool) -> Iterator[tuple[Any, ...]]:
        par = self._parallel
        for buf in self.layout.buffers:
            for b in buf.buckets:
                self._host.check_onloaded("iter_param_buckets()", ("params",))
                flat = self._buffers.packed_params(b)
                if not with_placements:
                    yield b.param_fqns, flat
                    continue
                yield b.param_fqns, flat, None if par is None else tuple(
                    par.params[f] for f in b.param_fqns)

    def reload_model_params(self) -> None:
        """Re-seed every fp32 main param this rank holds from the model's params: after writes
        that bypass the version counter (``p.data``, collectives, DLPack), on every rank."""
        self._host.check_onloaded("reload_model_params()", ("params",))  # not the writes
        self._param_sync.finish()  # an all-gather in flight would overwrite the weights
        self._before_state_write(host=True)
        self._watch.written()  # only to raise if a param was moved out of the buffer
        self._state.reseed(self._fqns)

    def _reseed_written(self) -> None:
        offloaded = self._host.offloaded
        if "params" in offloaded:  # nothing can write them: onload() checks
            return
        if "main_params" in offloaded:  # offload() re-seeded them first; a write since raises
            if self._watch.written(record=False):
                self._host.check_onloaded("re-seeding the main params from weights written "
                                          "since offload()", ("main_params",))
            return
        written = self._watch.written()
        if written:
            self._before_state_write(host=False)
        self._state.reseed(written)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state keyed by FQN, viewing the live state (:mod:`.state_dict`): resumes
        bitwise at the same DP size, through ``torch.distributed.checkpoint`` at any."""
        return state_dicts.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Collective. Adopt a :meth:`state_dict` of this rank's; on any mismatch every rank
        raises :class:`~shardopt.errors.StateDictError` and nothing changes."""
        self._host.check_onloaded("load_state_dict()")  # it would write into freed storage
        self._before_state_write(host=True)
        state_dicts.load_state_dict(self, state_dict)

    def register_state_write_hook(self, hook: Callable[[bool], None]) -> RemovableHandle:
        """Register ``hook(host)``, run before anything changes or frees this rank's state
        (``step()``, loads, offload, re-seeding, ``opt.state`` writes); it returns once the
        state may be overwritten (``host``: the host waited for its readers, else the current
        CUDA stream waits). A background save registers one (docs/optimizer.md)."""
        handle = RemovableHandle(self._state_write_hooks)
        self._state_write_hooks[handle.id] = hook
        return handle

    def _before_state_write(self, host: bool) -> None:
        for hook in list(self._state_write_hooks.values()):  # a hook may remove itself
            hook(host)

    def _adopt(self, moments: Moments, param_steps: Mapping[str, int],
               on_host: bool = False) -> None:
        self._state.set_moments(moments, STAGED if on_host else DEVICE)
        self.param_steps.update(param_steps)
        self._param_sync.publish()
        self._watch.record()  # the loaded weights replace whatever the user wrote before

    def add_param_group(self, param_group: dict[str, Any]) -> None:  # noqa: D102
        if getattr(self, "_groups_final", False):
            raise NotImplementedError(
                "DistributedOptimizer lays all params out at construction; for per-param "
                "settings pass param_group_fn=lambda fqn, param: {'lr': ...} to the constructor")
        super().add_param_group(param_group)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, by kind (optimizer state counts only what is allocated)."""
        return self._state.memory_bytes()

