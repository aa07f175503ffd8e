"""DistributedOptimizer: AdamW whose state is sharded over the data-parallel ranks.

Communication schedule of one iteration (``dp_size`` ranks, buckets ``B_0..B_n``
in launch order, which every rank shares):

* Phase 1, during backward: each param's gradient is added into the fp32
  grad buffer by a post-accumulate-grad hook and ``param.grad`` is freed.
  When every param of the next bucket in launch order has reported, that
  bucket is divided by ``dp_size`` and its reduce-scatter starts
  asynchronously. Buckets are launched strictly in order, so ranks whose
  hooks fire in different orders (unused params, MoE experts without
  tokens) still issue identical collectives.
* Phase 2, ``step()``: re-seed the fp32 main params of params the user wrote
  since the last step (:mod:`.param_watch`), launch whatever was not launched
  (a param without a gradient on this rank counts as zero in the average),
  wait for all reductions, all-reduce the squared norm of the local grad shard
  for clipping together with one "got a gradient here" flag per param (params
  that got none on any rank are not updated and keep their step count, as in
  ``torch.optim.AdamW``: :mod:`.step_plan`), run fused AdamW on the local
  shard (fp32 main params, lazily allocated moments) and copy the result into
  the rank's shard of the model-dtype param buffer.
* Phase 3, still in ``step()``: all-gather every param bucket, so each rank
  again holds the full updated params.

With ``dp_size == 1`` every collective is skipped and the same code runs.
The optimizer holds state and returns it on request; it never does file I/O
(that is :mod:`shardopt.checkpoint`'s job).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from . import comm, guards, kernels, quant, step_plan
from . import state_dict as state_dicts
from .buffers import FlatBuffers
from .config import GROUP_KEYS, OptimizerConfig
from .host_state import KINDS, HostState, new_local_state
from .layout import Bucket, Layout, ParamShard, ParamSpec, build_layout
from .param_watch import ParamWatch
from .pinned import PinnedBuffer

STATE_NAMES = ("master_param", "exp_avg", "exp_avg_sq")
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ParamGroupFn = Callable[[str, torch.nn.Parameter], dict[str, Any]]


class GradientOrderError(RuntimeError):
    """A gradient arrived for a bucket whose reduction had already started."""


class LowPrecisionStateError(ValueError):
    """The operation does not support Adam moments stored in less than fp32 (yet)."""


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
    ``p.data`` are not, call :meth:`reload_model_params` after those. Every rank must
    write the same weights (as with DDP): each rank re-seeds only the part it owns,
    and the all-gather spreads the owners' parts. Casting or moving the model after
    construction (``model.float()``, ``.to(...)``) makes ``step()`` raise
    :class:`~shardopt.param_watch.ParamMovedError`.

    ``state_dict()`` / ``load_state_dict()`` (collective) follow torch.optim, keyed
    by FQN (:mod:`shardopt.state_dict`); ``state[param]`` shows this rank's part of a
    param's state. A param belongs to one optimizer at a time.
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
        named = [(fqn, p) for fqn, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("model has no parameters that require grad")
        self.device = named[0][1].device
        for fqn, p in named:
            if p.device != self.device:
                raise ValueError(
                    f"param {fqn!r} is on {p.device} but {named[0][0]!r} is on {self.device}; "
                    "all trainable params must be on one device"
                )
            if p.dtype not in SUPPORTED_DTYPES:
                # fp32 main params and fp32 state would silently lower float64 precision.
                raise ValueError(
                    f"param {fqn!r} has dtype {p.dtype}; shardopt trains bf16, fp16 and fp32 params"
                )
        self.aliases = _tied_aliases(model)
        specs = [ParamSpec(fqn, tuple(p.shape), p.dtype) for fqn, p in named]
        guards.check_same_layout(self.dp, specs, self.config, guards.ownership_problem(named))
        guards.claim(self, named)
        self.layout: Layout = build_layout(
            specs,
            self.dp.size,
            self.config.bucket_numel,
            *_alignment(self.config),
        )
        self.buffers = FlatBuffers(named, self.layout, self.device, self.config.grad_accum_fp32)
        self.fqn_of = {p: fqn for fqn, p in named}

        defaults = {
            "lr": self.config.lr,
            "betas": self.config.betas,
            "eps": self.config.eps,
            "weight_decay": self.config.weight_decay,
        }
        super().__init__(_param_groups(named, defaults, param_group_fn), defaults)
        self._groups_final = True
        self.state = state_dicts.LocalState(self)  # torch's defaultdict, computed on access
        self.group_of = {
            self.fqn_of[p]: gi for gi, g in enumerate(self.param_groups) for p in g["params"]
        }

        self.shards: tuple[ParamShard, ...] = self.layout.shards(self.dp.rank)
        self._main: list[torch.Tensor | None] = []
        for buf in self.layout.buffers:
            if buf.dtype == torch.float32:
                self._main.append(None)  # the param buffer shard is the main param
                continue
            main = torch.zeros(buf.local_numel, dtype=torch.float32, device=self.device)
            for bucket in buf.buckets:
                self._local_bucket(main, bucket).copy_(
                    self.buffers.bucket_params(bucket).narrow(
                        0, self.dp.rank * bucket.shard_numel, bucket.shard_numel
                    )
                )
            self._main.append(main)
        self._exp_avg: list[torch.Tensor] | None = None
        self._exp_avg_sq: list[torch.Tensor] | None = None
        # Host copies: offload()/onload() and the moments a low_memory_resume load stages.
        self._host = HostState(self, model)
        # Updates applied to each param (torch's state[p]["step"]): a param that got no
        # gradient on any rank in a step is not updated and its count stays.
        self.param_steps: dict[str, int] = {fqn: 0 for fqn, _ in named}
        self._group_fqns = [[self.fqn_of[p] for p in g["params"]] for g in self.param_groups]
        self._fqns = tuple(fqn for fqn, _ in named)  # order of the grad-presence flags
        self._all_present: torch.Tensor | None = None  # flags of a rank that has every grad
        # Moments stored in bf16 or int8 (exp_avg_dtype / exp_avg_sq_dtype): (exp_avg, exp_avg_sq)
        # per buffer, allocated lazily like the fp32 ones, which then stay None.
        self._packed: tuple[list[quant.Moment], list[quant.Moment]] | None = None
        self._grad_norm: torch.Tensor | None = None
        self.step_kernel = self._choose_kernel()
        self._chunk_tables: dict[tuple[int, int], kernels.ChunkTable] | None = None
        self._subset_tables: dict[tuple[int, ...], kernels.ChunkTable] = {}
        self._norm_views: list[torch.Tensor] | None = None  # each bucket's own grad shard
        self._group_shards = [
            [i for i, s in enumerate(self.shards) if self.group_of[s.fqn] == gi]
            for gi in range(len(self.param_groups))
        ]
        self._shards_of: dict[str, list[int]] = {}
        for i, s in enumerate(self.shards):
            self._shards_of.setdefault(s.fqn, []).append(i)

        self._launch_order = _launch_order(self.layout, named)
        position = {(b.buffer_index, b.index): i for i, b in enumerate(self._launch_order)}
        self._launch_pos = {
            fqn: position[(slot.buffer_index, slot.bucket_index)]
            for fqn, slot in self.layout.slots.items()
        }
        self._bucket_pending: list[int] = []
        # Params that got a gradient on this rank since the last step or zero_grad (their
        # grad-buffer region holds it); the others hold stale values and are overwritten by
        # their first gradient or zeroed when their bucket launches.
        self._written: set[str] = set()
        self._next_launch = 0
        self._views: list[list[list[torch.Tensor]]] | None = None  # reset when moments move
        self._handles: list[object] = []
        self._save_fence: torch.cuda.Event | None = None  # checkpoint.snapshot's copies
        self._sync_enabled = True
        self._reset_readiness()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for _, p in named
        ]
        # overlap_param_gather: all-gathers in flight, keyed (buffer index, bucket index); each
        # module's forward waits for the buckets of its own params.
        self._param_handles: dict[tuple[int, int], object] = {}
        if self.config.overlap_param_gather and self.dp.size > 1:
            for module in model.modules():
                keys = sorted({(self.layout.slots[self.fqn_of[p]].buffer_index,
                                self.layout.slots[self.fqn_of[p]].bucket_index)
                               for p in module.parameters(recurse=False) if p in self.fqn_of})
                if keys:
                    self._hooks.append(module.register_forward_pre_hook(
                        lambda _m, _args, keys=tuple(keys): self._wait_params(keys)))
            # model.load_state_dict writes the params: no gather may still be writing them.
            self._hooks.append(model.register_load_state_dict_pre_hook(
                lambda *_: self.finish_param_sync()))
        self._watch = ParamWatch(self._fqns, [p for _, p in named],
                                 [(p.dtype, p.device) for _, p in named], self.dp.rank)

    # ------------------------------------------------------------------ grads
    def _reset_readiness(self) -> None:
        self._bucket_pending = [len(b.param_fqns) for b in self._launch_order]
        self._next_launch = 0

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        fqn = self.fqn_of[param]
        pos = self._launch_pos[fqn]
        if pos < self._next_launch:
            raise GradientOrderError(
                f"[dp rank {self.dp.rank}] gradient for {fqn!r} arrived after its bucket's "
                "reduction started; run accumulation micro-batches under optimizer.no_sync() "
                "and call step() or zero_grad() between iterations"
            )
        with torch.no_grad():
            view = self.buffers.grad_views[fqn]
            if fqn in self._written:
                view.add_(param.grad)
            else:  # first gradient since the last step or zero_grad: no memset, no read
                view.copy_(param.grad)
                self._written.add(fqn)
        param.grad = None
        if not (self._sync_enabled and self.config.overlap_grad_reduce):
            return
        self._bucket_pending[pos] -= 1
        while (
            self._next_launch < len(self._launch_order)
            and self._bucket_pending[self._next_launch] <= 0
        ):
            self._launch_next()

    def _launch_next(self) -> None:
        bucket = self._launch_order[self._next_launch]
        for fqn in bucket.param_fqns:
            if fqn not in self._written:  # no gradient here this iteration: it counts as zero
                self.buffers.grad_views[fqn].zero_()
        self._handles.append(
            comm.reduce_scatter_avg_(self.buffers.bucket_grads(bucket), self.dp, async_op=True)
        )
        self._next_launch += 1

    def _wait_params(self, keys: tuple[tuple[int, int], ...]) -> None:
        if self._param_handles:
            for key in keys:
                handle = self._param_handles.pop(key, None)
                if handle is not None:
                    handle.wait()

    def finish_param_sync(self) -> None:
        """Wait for every param all-gather still in flight (only ``overlap_param_gather``
        leaves any): after it every param holds its updated value. Forward pre-hooks do
        this per module; call it before reading params any other way after ``step()``."""
        for handle in self._param_handles.values():
            handle.wait()
        self._param_handles.clear()

    def finish_grad_sync(self) -> None:
        """Collective. Reduce every bucket not yet launched (missing grads count as zero) and wait."""
        while self._next_launch < len(self._launch_order):
            self._launch_next()
        for h in self._handles:
            h.wait()
        self._handles.clear()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for micro-batches inside the block."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous
            self._reset_readiness()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for h in self._handles:
            h.wait()
        self._handles.clear()
        self._written.clear()  # the next gradient overwrites: the buffer needs no memset
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        self._reset_readiness()

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Collective. Reduce grads, clip, update the local shard, all-gather params."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._host.check_onloaded("step()")
        self.wait_for_save_copies(host=False)  # before the first write (the re-seed below)
        self.finish_param_sync()  # the update writes into the param buffers
        self._reseed(self._watch.written())  # before any collective: a moved param raises
        self.finish_grad_sync()
        # Clipping needs the norm before the update; otherwise the Triton update computes
        # it from the grads it reads anyway.
        fused_norm = self.step_kernel == "triton" and not self.config.max_grad_norm
        grad_scale = None
        if fused_norm:
            got = self._agree(None)[1]
        else:
            self._grad_norm, grad_scale, got = self._global_norm()
        self._ensure_moments()
        steps = step_plan.next_steps(self.param_steps, self._group_fqns, got)
        if self.step_kernel == "triton":
            sq = self._update_triton(grad_scale, fused_norm, steps, got)
            if sq is not None:
                self._grad_norm = self._finish_norm(sq)
        else:
            self._update_torch(grad_scale, steps, got)
        step_plan.advance(self.param_steps, self._group_fqns, got, steps)
        self._publish_params(own_written=self.step_kernel == "triton",
                             wait=not self.config.overlap_param_gather)
        self._watch.record()  # the update's own writes are not the user's
        self._reset_readiness()
        self._written.clear()  # step() consumes the gradients
        self._host.after_step()
        return loss

    def _choose_kernel(self) -> str:
        wanted = self.config.step_kernel
        if wanted == "torch" or (wanted == "auto" and self.device.type != "cuda"):
            return "torch"
        if kernels.available(self.device):
            return "triton"
        if wanted == "auto":
            return "torch"
        raise ValueError(
            f"step_kernel='triton' needs Triton and a CUDA device (params are on {self.device}"
            f"{'' if kernels.triton is not None else ', Triton is not installed'})"
        )

    def _update_triton(self, grad_scale: torch.Tensor | None, sum_sq: bool,
                       steps: list[int | None], got: frozenset[str] | None
                       ) -> torch.Tensor | None:
        """Two kernel launches per (buffer, param group), or per (buffer, param group, step
        count) for a group that is not updated whole at one count (``steps``, ``got``: see
        :mod:`.step_plan`): update and write model-dtype params. With ``sum_sq``, return
        the local sum of squared grads (a device scalar)."""
        if self._chunk_tables is None:
            ids: dict[tuple[int, int], list[int]] = {}
            for i, s in enumerate(self.shards):
                ids.setdefault((s.buffer_index, self.group_of[s.fqn]), []).append(i)
            self._chunk_tables = {k: self._chunk_table(v) for k, v in ids.items()}
        launches = [(bi, gi, steps[gi], table) for (bi, gi), table in self._chunk_tables.items()
                    if steps[gi] is not None]
        for gi, n in enumerate(steps):
            if n is None:
                parts = step_plan.split(self._group_shards[gi], self.shards, self.param_steps, got)
                launches += [(bi, gi, count, self._subset_table(tuple(ids)))
                             for (bi, count), ids in parts.items()]
        partials = None
        if sum_sq:
            partials = torch.empty(sum(t.num_blocks for *_, t in launches),
                                   dtype=torch.float32, device=self.device)
        first = 0
        for bi, gi, count, table in launches:
            group = self.param_groups[gi]
            main = self._main[bi]
            params = self.buffers.param_buffers[bi]
            kernels.adamw_(
                table, params if main is None else main, self.buffers.grad_buffers[bi],
                *self._kernel_moments(bi), None if main is None else params,
                main_global=main is None, lr=float(group["lr"]), beta1=group["betas"][0],
                beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"],
                step=count, grad_scale=grad_scale,
                sum_sq=None if partials is None else partials[first:first + table.num_blocks],
            )
            first += table.num_blocks
        return None if partials is None else partials.sum()

    def _chunk_table(self, shard_ids: tuple[int, ...] | list[int]) -> kernels.ChunkTable:
        """The Triton launch table of ``self.shards[i]`` for ``i`` in ``shard_ids`` (one buffer)."""
        parts = []
        for i in shard_ids:
            s = self.shards[i]
            buf = self.layout.buffers[s.buffer_index]
            local_base = buf.local_offset(s.bucket_index)
            global_base = buf.buckets[s.bucket_index].shard_range_global(self.dp.rank).start
            start = s.range_local.start - local_base
            parts.append((local_base, global_base, start, start + s.range_local.size))
        return kernels.chunk_table(parts, self.device)

    def _subset_table(self, shard_ids: tuple[int, ...]) -> kernels.ChunkTable:
        """Cached: once a param skipped a step its group splits in every later step too."""
        table = self._subset_tables.get(shard_ids)
        if table is None:
            if len(self._subset_tables) >= 256:  # patterns that keep changing (MoE): bounded
                self._subset_tables.clear()
            table = self._subset_tables[shard_ids] = self._chunk_table(shard_ids)
        return table

    def _kernel_moments(self, bi: int) -> tuple[torch.Tensor | kernels.Packed, ...]:
        if self._packed is None:
            assert self._exp_avg is not None and self._exp_avg_sq is not None
            return self._exp_avg[bi], self._exp_avg_sq[bi]
        return tuple(kernels.Packed(m.values, m.scales) for m in
                     (self._packed[0][bi], self._packed[1][bi]))

    def _update_torch(self, grad_scale: torch.Tensor | None, steps: list[int | None],
                      got: frozenset[str] | None) -> None:
        """torch's fused AdamW on the fp32 main params of each param group (only the params
        this step updates, each at its own step count: ``steps``, ``got``, :mod:`.step_plan`).
        Low-precision moments are widened to fp32 copies first and stored back after (the
        reference for the Triton path, which does it in registers)."""
        grads = self._grad_shards()
        work = None
        if self._packed is None:
            views = self._state_views()
        else:
            work = ([m.to_fp32() for m in self._packed[0]], [m.to_fp32() for m in self._packed[1]])
            main_views = [self.state_view("master_param", s) for s in self.shards]
            views = [[[main_views[i] for i in idx]]
                     + [[w[self.shards[i].buffer_index][self.shards[i].range_local.as_slice()]
                         for i in idx] for w in work] for idx in self._group_shards]
        for gi, group in enumerate(self.param_groups):
            idx = self._group_shards[gi]
            main, exp_avg, exp_avg_sq = views[gi]
            grad = [grads[i] for i in idx]
            if steps[gi] is not None:
                counts = [steps[gi]] * len(idx)
            else:
                keep = [k for k, i in enumerate(idx) if got is None or self.shards[i].fqn in got]
                main, exp_avg, exp_avg_sq, grad = ([t[k] for k in keep]
                                                   for t in (main, exp_avg, exp_avg_sq, grad))
                counts = [self.param_steps[self.shards[idx[k]].fqn] + 1 for k in keep]
            if not counts:
                continue
            beta1, beta2 = group["betas"]
            step_of = {n: torch.tensor(float(n), device=self.device) for n in set(counts)}
            torch._fused_adamw_(
                main,
                grad,
                exp_avg,
                exp_avg_sq,
                [],
                [step_of[n] for n in counts],
                lr=float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                amsgrad=False,
                maximize=False,
                grad_scale=grad_scale,
            )
        if work is not None:
            for packed, wide in zip(self._packed, work):
                for moment, w in zip(packed, wide):
                    moment.store_(w)

    def _state_views(self) -> list[list[list[torch.Tensor]]]:
        """Per param group: views of main params, exp_avg, exp_avg_sq (cached until moments move)."""
        if self._views is None:
            self._views = [
                [[self.state_view(name, self.shards[i]) for i in idx] for name in STATE_NAMES]
                for idx in self._group_shards
            ]
        return self._views

    def _grad_shards(self) -> list[torch.Tensor]:
        grads = [self.buffers.shard_grads(s) for s in self.shards]
        if any(g.dtype != torch.float32 for g in grads):
            grads = [g.float() for g in grads]
        return grads

    def _global_norm(self) -> tuple[torch.Tensor, torch.Tensor | None, frozenset[str] | None]:
        """Collective. Global grad L2 norm (as ``clip_grad_norm_`` on the full model), when
        clipping the divisor the update applies to the grads in the same pass, and which
        params got a gradient (see :meth:`_agree`).

        Reads each bucket's own shard whole: its padding is zero in every rank's buffer,
        so it adds nothing, and a few large tensors are faster than one per param."""
        if self._norm_views is None:
            self._norm_views = [
                self.buffers.bucket_grads(b).narrow(0, self.dp.rank * b.shard_numel, b.shard_numel)
                for buf in self.layout.buffers for b in buf.buckets]
        if self._norm_views:
            norms = torch._foreach_norm(self._norm_views, 2, dtype=torch.float32)
            sq = torch.stack(norms).square().sum()
        else:
            sq = torch.zeros((), device=self.device)
        total, got = self._agree(sq)
        assert total is not None
        max_norm = self.config.max_grad_norm
        if not max_norm:
            return total, None, got
        # clip_grad_norm_ multiplies by min(1, max_norm / (norm + 1e-6)); dividing by its
        # reciprocal inside the update saves a pass over the grads (no host sync either).
        return total, torch.clamp((total + 1e-6) / max_norm, min=1.0), got

    def _finish_norm(self, local_sq: torch.Tensor) -> torch.Tensor:
        """Collective. sqrt of the sum over ranks of each rank's sum of squared grads."""
        return comm.all_reduce_sum_(local_sq.reshape(1), self.dp).sqrt()[0]

    def _agree(self, local_sq: torch.Tensor | None
               ) -> tuple[torch.Tensor | None, frozenset[str] | None]:
        """Collective (one all-reduce; none with ``dp_size == 1``). The params that got a
        gradient on some rank in this step (None: every param) and, given this rank's sum
        of squared grads ``local_sq``, the global grad norm.

        A rank that got every gradient itself knows the answer (None) and sends ones
        without reading the result back: only a rank that misses some syncs the host."""
        missing = len(self._written) < len(self._fqns)
        local = frozenset(self._written) if missing else None
        if self.dp.size == 1:
            return (None if local_sq is None else local_sq.sqrt()), local
        if missing:
            flags = torch.tensor([f in self._written for f in self._fqns],
                                 dtype=torch.float32).to(self.device)
        else:
            if self._all_present is None:
                self._all_present = torch.ones(len(self._fqns), device=self.device)
            flags = self._all_present
        sums = torch.cat([local_sq.reshape(1), flags]) if local_sq is not None else flags.clone()
        comm.all_reduce_sum_(sums, self.dp)
        norm = None if local_sq is None else sums[0].sqrt()
        if not missing:
            return norm, None
        counts = sums[len(sums) - len(self._fqns):].tolist()
        got = frozenset(f for f, c in zip(self._fqns, counts) if c > 0)
        return norm, (None if len(got) == len(self._fqns) else got)

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm before clipping of the last ``step()`` (syncs when read)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def _publish_params(self, own_written: bool = False, wait: bool = True) -> None:
        """Collective. Copy main shards into the model-dtype buffer (unless the update wrote
        them: ``own_written``), then all-gather every bucket, in the order forward uses them.
        Without ``wait`` the all-gathers stay in flight (see :meth:`finish_param_sync`)."""
        self.finish_param_sync()
        for bucket in reversed(self._launch_order):
            full = self.buffers.bucket_params(bucket)
            main = self._main[bucket.buffer_index]
            if main is not None and not own_written:
                own = full.narrow(0, self.dp.rank * bucket.shard_numel, bucket.shard_numel)
                own.copy_(self._local_bucket(main, bucket))
            handle = comm.all_gather_(full, self.dp, async_op=True)
            if handle is not comm.DONE:
                self._param_handles[(bucket.buffer_index, bucket.index)] = handle
        if wait:
            self.finish_param_sync()

    # ------------------------------------------------------------------ state
    def _local_bucket(self, local: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        offset = self.layout.buffers[bucket.buffer_index].local_offset(bucket.index)
        return local.narrow(0, offset, bucket.shard_numel)

    def _ensure_moments(self) -> None:
        if self.config.lowprec_moments:
            if self._packed is None:
                kinds = (self.config.exp_avg_dtype, self.config.exp_avg_sq_dtype)
                self._packed = tuple(  # type: ignore[assignment]
                    [quant.Moment(kind, b.local_numel, self.device, sqrt=name == "exp_avg_sq")
                     for b in self.layout.buffers]
                    for kind, name in zip(kinds, STATE_NAMES[1:]))
            return
        if self._host.bring_staged():  # low_memory_resume: moments waited until after backward
            self._views = None
        elif self._exp_avg is None:
            self._views = None
            self._exp_avg = [self._zeros_local(b.local_numel) for b in self.layout.buffers]
            self._exp_avg_sq = [self._zeros_local(b.local_numel) for b in self.layout.buffers]

    def _zeros_local(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=torch.float32, device=self.device)

    def _new_local_state(self, host: bool) -> tuple[list[torch.Tensor], list[PinnedBuffer]]:
        return new_local_state(self, host)

    @property
    def has_moments(self) -> bool:
        return (self._exp_avg is not None or self._host.staged is not None
                or self._packed is not None)

    def require_fp32_moments(self, what: str) -> None:
        """Raise :class:`LowPrecisionStateError` unless both moments are stored in fp32
        (checkpoints of bf16/int8 moments are not written yet)."""
        cfg = self.config
        if cfg.lowprec_moments:
            raise LowPrecisionStateError(
                f"[dp rank {self.dp.rank}] {what} supports only fp32 Adam moments; this "
                f"optimizer has exp_avg_dtype={cfg.to_dict()['exp_avg_dtype']!r}, "
                f"exp_avg_sq_dtype={cfg.to_dict()['exp_avg_sq_dtype']!r}")

    def state_view(self, name: str, shard: ParamShard) -> torch.Tensor:
        """1-D fp32 view of state ``name`` for ``shard`` (a record of this rank's); while
        offloaded, of its host copy."""
        if name == "master_param" and self._main[shard.buffer_index] is None:
            return self.buffers.shard_params(shard)
        if name != "master_param":
            self.require_fp32_moments(f"state_view({name!r})")  # no fp32 view of bf16/int8 state
        return self._host.local(name, shard.buffer_index)[shard.range_local.as_slice()]

    def _adopt_loaded_state(self, moments: tuple[list[torch.Tensor], list[torch.Tensor]],
                            on_host: bool, param_steps: dict[str, int],
                            pinned: list[PinnedBuffer] | None = None) -> None:
        """Collective. Take loaded moments (on the host: with their page-locked memory) and
        per-param step counts; rebuild params from the loaded master shards and all-gather
        them. Called by ``checkpoint.load`` only."""
        self._host.adopt(moments, on_host, list(pinned or []))
        self.param_steps.update(param_steps)
        self._views = None
        self._publish_params()
        self._watch.record()  # the loaded weights replace whatever the user wrote before

    # ---------------------------------------------------------------- offload
    def offload(self, what: tuple[str, ...] | list[str] = KINDS) -> None:
        """Move ``what`` (of :data:`~shardopt.host_state.KINDS`; default all) to pinned host
        memory and give its device memory back; a forward, ``step()`` and ``checkpoint.load``
        are refused until :meth:`onload`. Not collective. See :mod:`shardopt.host_state`."""
        if "moments" in what:
            self.require_fp32_moments("offload() of the moments")
        self.wait_for_save_copies()  # offload frees (CUDA) or overwrites (CPU) the state
        self._host.offload(what)

    def onload(self) -> None:
        """Bring back what :meth:`offload` moved, bit for bit (no-op when nothing is
        offloaded). The host copies are kept for the next offload."""
        self._host.onload()

    def release_host_memory(self) -> None:
        """Free the host copies that :meth:`offload` keeps between cycles (refused while
        offloaded)."""
        self._host.release()

    @property
    def offloaded(self) -> tuple[str, ...]:
        """The kinds of state now offloaded (empty when none)."""
        return self._host.offloaded

    def iter_param_buckets(self) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
        """``(fqns, flat)`` per bucket: ``flat`` is a view (model dtype) of the bucket's
        params, in ``fqns`` order, each ``numel`` elements, back to back, without
        padding. Buckets come by buffer (one per model dtype, in ``layout.buffers``
        order), then by bucket index. Waits for param all-gathers still in flight;
        refused while params are offloaded."""
        self._host.check_onloaded("iter_param_buckets()", ("params",))
        self.finish_param_sync()
        return ((b.param_fqns, self.buffers.bucket_params(b).narrow(0, 0, b.numel_unpadded))
                for buf in self.layout.buffers for b in buf.buckets)

    def reload_model_params(self) -> None:
        """Re-seed every fp32 main param this rank holds from the model's current params.

        ``step()`` notices in-place writes to params by their version counters and
        re-seeds those params itself: ``model.load_state_dict``, ``p.zero_()``,
        ``p.copy_(x)``, ``nn.init.*`` and every other in-place op on the param or on
        ``p.detach()``. Writes that bypass the counter need this call before the next
        ``step()``: through ``p.data`` (``p.data.copy_(x)``), through another tensor
        that shares the storage, or from outside PyTorch (DLPack, CUDA kernels).
        fp32 params need neither: their main param is the param.

        Call it on every rank, after every rank set the same weights (as with DDP); each
        rank re-seeds the part it owns and the next ``step()`` all-gathers them. The
        fp32 digits below the model dtype's precision are dropped for every param.
        """
        self.finish_param_sync()  # an all-gather in flight would overwrite the user's weights
        self.wait_for_save_copies()
        self._watch.written()  # only to raise if a param was moved out of the buffer
        self._reseed(self._fqns)

    def _reseed(self, fqns: Iterable[str]) -> None:
        """Copy the model-dtype params of ``fqns`` into this rank's fp32 main params."""
        for fqn in fqns:
            for i in self._shards_of.get(fqn, ()):
                s = self.shards[i]
                if self._main[s.buffer_index] is not None:  # fp32: the param is the main
                    self.state_view("master_param", s).copy_(self.buffers.shard_params(s))

    def state_dict(self) -> dict[str, Any]:
        """This rank's state keyed by FQN, values viewing the live state
        (:mod:`shardopt.state_dict`). Resumes bitwise at the same DP size; through
        ``torch.distributed.checkpoint`` at any DP size."""
        return state_dicts.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Collective. Adopt a :meth:`state_dict` of this rank's; on any mismatch every rank
        raises :class:`~shardopt.state_dict.StateDictError` and nothing changes."""
        self.wait_for_save_copies()
        state_dicts.load_state_dict(self, state_dict)

    def set_save_fence(self, event: torch.cuda.Event | None) -> None:
        """An asynchronous ``checkpoint.save`` is copying this optimizer's state aside until
        ``event`` (None: the copies are done); see :mod:`shardopt.checkpoint.snapshot`."""
        self._save_fence = event

    def wait_for_save_copies(self, host: bool = True) -> None:
        """Before anything writes or frees the state: wait for the copies of an asynchronous
        save (the host waits, or with ``host=False`` only the current CUDA stream)."""
        event, self._save_fence = self._save_fence, None
        if event is None:
            return
        if host:
            event.synchronize()
        else:
            torch.cuda.current_stream(self.device).wait_event(event)

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise a ``ValueError`` naming the first param unless ``model`` is the one this
        optimizer was built over."""
        guards.check_model(self, model)

    def add_param_group(self, param_group: dict[str, Any]) -> None:  # noqa: D102
        if getattr(self, "_groups_final", False):
            raise NotImplementedError(
                "DistributedOptimizer lays all params out at construction; for per-param "
                "settings pass param_group_fn=lambda fqn, param: {'lr': ...} to the constructor")
        super().add_param_group(param_group)

    def _step_of(self, fqn: str) -> int:
        return self.param_steps[fqn]

    def _set_steps(self, steps: dict[str, int]) -> None:
        """Set the step counts of the params ``steps`` names (FQN -> count)."""
        self.param_steps.update(steps)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, by kind (optimizer state counts only what is allocated)."""
        out = self.buffers.num_bytes()
        state = sum(t.numel() * 4 for t in self._main if t is not None)
        if self._exp_avg is not None:
            state += 2 * sum(t.numel() * 4 for t in self._exp_avg)
        if self._packed is not None:
            state += sum(m.num_bytes() for moments in self._packed for m in moments)
        out["optimizer_state"] = state
        return out


def _alignment(config: OptimizerConfig) -> tuple[int, int]:
    """``(align_numel, param_align)`` for the layout: 8-bit moments need every block of
    :data:`quant.QBLOCK` elements of a param whole on one rank (see :mod:`.quant`)."""
    if not config.quantized_moments:
        return config.align_numel, 1
    return math.lcm(config.align_numel, quant.QBLOCK), quant.QBLOCK


def _param_groups(
    named: list[tuple[str, torch.nn.Parameter]],
    defaults: dict[str, Any],
    param_group_fn: ParamGroupFn | None,
) -> list[dict[str, Any]]:
    groups: dict[tuple, dict[str, Any]] = {}
    for fqn, p in named:
        overrides = dict(param_group_fn(fqn, p) or {}) if param_group_fn else {}
        unknown = set(overrides) - set(GROUP_KEYS)
        if unknown:
            raise ValueError(
                f"param_group_fn returned unknown keys {sorted(unknown)} for param {fqn!r}; "
                f"allowed: {list(GROUP_KEYS)}"
            )
        if "betas" in overrides:
            overrides["betas"] = tuple(float(b) for b in overrides["betas"])
        for key, value in overrides.items():
            if key != "betas" and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"param_group_fn gave {key}={value!r} for param {fqn!r}")
        key = tuple(sorted(overrides.items()))
        group = groups.setdefault(key, {"params": [], **overrides})
        group["params"].append(p)
    return list(groups.values())


def _tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Map every alias FQN of a shared param to the FQN ``named_parameters`` reports."""
    canonical = {p: fqn for fqn, p in model.named_parameters()}
    return {
        fqn: canonical[p]
        for fqn, p in model.named_parameters(remove_duplicate=False)
        if canonical[p] != fqn
    }


def _launch_order(layout: Layout, named: list[tuple[str, torch.nn.Parameter]]) -> list[Bucket]:
    """Buckets in the order backward completes them: by the earliest-registered param, last first."""
    position = {fqn: i for i, (fqn, _) in enumerate(named)}
    buckets = [b for buf in layout.buffers for b in buf.buckets]
    return sorted(
        buckets,
        key=lambda b: (-min(position[f] for f in b.param_fqns), b.buffer_index, b.index),
    )
