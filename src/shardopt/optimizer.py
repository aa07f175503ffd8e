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
* Phase 2, ``step()``: launch whatever was not launched (params that got no
  gradient count as zero), wait for all reductions, all-reduce the squared
  norm of the local grad shard for clipping, run fused AdamW on the local
  shard (fp32 main params, lazily allocated moments) and copy the result
  into the rank's shard of the model-dtype param buffer.
* Phase 3, still in ``step()``: all-gather every param bucket, so each rank
  again holds the full updated params.

With ``dp_size == 1`` every collective is skipped and the same code runs.
The optimizer holds state and returns it on request; it never does file I/O
(that is :mod:`shardopt.checkpoint`'s job).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import comm, kernels, quant
from .buffers import FlatBuffers
from .config import GROUP_KEYS, OptimizerConfig
from .layout import Bucket, Layout, ParamShard, ParamSpec, Range, build_layout
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

    Construction is collective only in that every rank must build the same
    model; it does not communicate. ``param_group_fn(fqn, param)`` returns
    per-param overrides of ``lr``, ``betas``, ``eps`` and ``weight_decay``;
    params with equal overrides share one entry of ``param_groups``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: OptimizerConfig | None = None,
        process_group: Any = None,
        param_group_fn: ParamGroupFn | None = None,
    ) -> None:
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
        self.layout: Layout = build_layout(
            [ParamSpec(fqn, tuple(p.shape), p.dtype) for fqn, p in named],
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
        # Moments stored in bf16 or int8 (exp_avg_dtype / exp_avg_sq_dtype): (exp_avg, exp_avg_sq)
        # per buffer, allocated lazily like the fp32 ones, which then stay None.
        self._packed: tuple[list[quant.Moment], list[quant.Moment]] | None = None
        # low_memory_resume parks loaded moments here (host) until the first step.
        self._staged_moments: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        # Their page-locked host memory, unlocked once the copies to the device are done.
        self._staged_pinned: list[PinnedBuffer] = []
        self._unpin_after: tuple[torch.cuda.Event, list[PinnedBuffer]] | None = None
        self.step_counts = [0] * len(self.param_groups)
        self._grad_norm: torch.Tensor | None = None
        self.step_kernel = self._choose_kernel()
        self._chunk_tables: dict[tuple[int, int], kernels.ChunkTable] | None = None
        self._norm_views: list[torch.Tensor] | None = None  # each bucket's own grad shard
        self._group_shards = [
            [i for i, s in enumerate(self.shards) if self.group_of[s.fqn] == gi]
            for gi in range(len(self.param_groups))
        ]

        self._launch_order = _launch_order(self.layout, named)
        position = {(b.buffer_index, b.index): i for i, b in enumerate(self._launch_order)}
        self._launch_pos = {
            fqn: position[(slot.buffer_index, slot.bucket_index)]
            for fqn, slot in self.layout.slots.items()
        }
        self._bucket_pending: list[int] = []
        # Params whose grad-buffer region holds this iteration's gradient; the others hold stale
        # values and are overwritten by their first gradient or zeroed when their bucket launches.
        self._written: set[str] = set()
        self._next_launch = 0
        self._views: list[list[list[torch.Tensor]]] | None = None  # reset when moments move
        self._handles: list[object] = []
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
            if fqn not in self._written:  # no gradient this iteration: it counts as zero
                self.buffers.grad_views[fqn].zero_()
                self._written.add(fqn)
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
        self.finish_param_sync()  # the update writes into the param buffers
        self.finish_grad_sync()
        # Clipping needs the norm before the update; otherwise the Triton update computes
        # it from the grads it reads anyway.
        fused_norm = self.step_kernel == "triton" and not self.config.max_grad_norm
        grad_scale = None
        if not fused_norm:
            self._grad_norm, grad_scale = self._global_norm()
        self._ensure_moments()
        for gi in range(len(self.param_groups)):
            self.step_counts[gi] += 1
        if self.step_kernel == "triton":
            sq = self._update_triton(grad_scale, fused_norm)
            if sq is not None:
                self._grad_norm = self._finish_norm(sq)
        else:
            self._update_torch(grad_scale)
        self._publish_params(own_written=self.step_kernel == "triton",
                             wait=not self.config.overlap_param_gather)
        self._reset_readiness()
        self._written.clear()  # step() consumes the gradients
        if self._unpin_after is not None:
            event, pinned = self._unpin_after
            self._unpin_after = None
            event.synchronize()  # the staged moments have reached the device
            for buf in pinned:
                buf.release()
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

    def _update_triton(self, grad_scale: torch.Tensor | None,
                       sum_sq: bool) -> torch.Tensor | None:
        """Two kernel launches per (buffer, param group): update and write model-dtype
        params. With ``sum_sq``, return the local sum of squared grads (a device scalar)."""
        if self._chunk_tables is None:
            parts: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
            for s in self.shards:
                buf = self.layout.buffers[s.buffer_index]
                local_base = buf.local_offset(s.bucket_index)
                global_base = buf.buckets[s.bucket_index].shard_range_global(self.dp.rank).start
                start = s.range_local.start - local_base
                parts.setdefault((s.buffer_index, self.group_of[s.fqn]), []).append(
                    (local_base, global_base, start, start + s.range_local.size))
            self._chunk_tables = {k: kernels.chunk_table(v, self.device) for k, v in parts.items()}
        partials = None
        if sum_sq:
            partials = torch.empty(sum(t.num_blocks for t in self._chunk_tables.values()),
                                   dtype=torch.float32, device=self.device)
        first = 0
        for (bi, gi), table in self._chunk_tables.items():
            group = self.param_groups[gi]
            main = self._main[bi]
            params = self.buffers.param_buffers[bi]
            kernels.adamw_(
                table, params if main is None else main, self.buffers.grad_buffers[bi],
                *self._kernel_moments(bi), None if main is None else params,
                main_global=main is None, lr=float(group["lr"]), beta1=group["betas"][0],
                beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"],
                step=self.step_counts[gi], grad_scale=grad_scale,
                sum_sq=None if partials is None else partials[first:first + table.num_blocks],
            )
            first += table.num_blocks
        return None if partials is None else partials.sum()

    def _kernel_moments(self, bi: int) -> tuple[torch.Tensor | kernels.Packed, ...]:
        if self._packed is None:
            assert self._exp_avg is not None and self._exp_avg_sq is not None
            return self._exp_avg[bi], self._exp_avg_sq[bi]
        return tuple(kernels.Packed(m.values, m.scales) for m in
                     (self._packed[0][bi], self._packed[1][bi]))

    def _update_torch(self, grad_scale: torch.Tensor | None) -> None:
        """torch's fused AdamW on the fp32 main params of each param group. Low-precision
        moments are widened to fp32 copies first and stored back after (the reference for
        the Triton path, which does it in registers)."""
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
            if not idx:
                continue
            beta1, beta2 = group["betas"]
            step = torch.tensor(float(self.step_counts[gi]), device=self.device)
            main, exp_avg, exp_avg_sq = views[gi]
            torch._fused_adamw_(
                main,
                [grads[i] for i in idx],
                exp_avg,
                exp_avg_sq,
                [],
                [step] * len(idx),
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

    def _global_norm(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Collective. Global grad L2 norm (as ``clip_grad_norm_`` on the full model) and,
        when clipping, the divisor the update applies to the grads in the same pass.

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
        total = self._finish_norm(sq)
        max_norm = self.config.max_grad_norm
        if not max_norm:
            return total, None
        # clip_grad_norm_ multiplies by min(1, max_norm / (norm + 1e-6)); dividing by its
        # reciprocal inside the update saves a pass over the grads (no host sync either).
        return total, torch.clamp((total + 1e-6) / max_norm, min=1.0)

    def _finish_norm(self, local_sq: torch.Tensor) -> torch.Tensor:
        """Collective. sqrt of the sum over ranks of each rank's sum of squared grads."""
        return comm.all_reduce_sum_(local_sq.reshape(1), self.dp).sqrt()[0]

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
        staged = self._staged_moments
        if staged is not None:
            # low_memory_resume: moments waited on the host until now, after backward.
            self._views = None
            self._exp_avg = [t.to(self.device, non_blocking=True) for t in staged[0]]
            self._exp_avg_sq = [t.to(self.device, non_blocking=True) for t in staged[1]]
            self._staged_moments = None
            if self._staged_pinned:
                event = torch.cuda.Event()
                event.record()
                self._unpin_after, self._staged_pinned = (event, self._staged_pinned), []
            return
        if self._exp_avg is None:
            self._views = None
            self._exp_avg = [self._zeros_local(b.local_numel) for b in self.layout.buffers]
            self._exp_avg_sq = [self._zeros_local(b.local_numel) for b in self.layout.buffers]

    def _zeros_local(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=torch.float32, device=self.device)

    def _new_local_state(self, host: bool) -> tuple[list[torch.Tensor], list[PinnedBuffer]]:
        """One uninitialised fp32 local tensor per buffer whose padding is zero (params' parts
        are for the caller to fill), and the page-locked host memory behind them (``host``
        with a CUDA device; exact size, see :mod:`.pinned`)."""
        pinned: list[PinnedBuffer] = []
        if host and self.device.type == "cuda":  # registering faults every page in
            pinned = [PinnedBuffer(b.local_numel, torch.float32) for b in self.layout.buffers]
            out = [p.tensor for p in pinned]
        elif self.device.type == "cuda":
            out = [torch.empty(b.local_numel, dtype=torch.float32, device=self.device)
                   for b in self.layout.buffers]
        else:  # pageable host memory: a memset faults pages in faster than the reads would
            return [torch.zeros(b.local_numel, dtype=torch.float32)
                    for b in self.layout.buffers], pinned
        for bi, t in enumerate(out):
            covered = sorted((s.range_local for s in self.shards if s.buffer_index == bi),
                             key=lambda r: r.start)
            pos = 0
            for r in covered + [Range(t.numel(), t.numel())]:
                if r.start > pos:
                    t[pos:r.start].zero_()
                pos = max(pos, r.end)
        return out, pinned

    @property
    def has_moments(self) -> bool:
        return (self._exp_avg is not None or self._staged_moments is not None
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
        """1-D fp32 view of state ``name`` for ``shard`` (a record of this rank's)."""
        if name == "master_param":
            main = self._main[shard.buffer_index]
            if main is None:
                return self.buffers.shard_params(shard)
            return main[shard.range_local.as_slice()]
        self.require_fp32_moments(f"state_view({name!r})")  # no fp32 view of bf16/int8 state
        staged = self._staged_moments
        if staged is not None:
            moments = staged[0] if name == "exp_avg" else staged[1]
        else:
            moments = self._exp_avg if name == "exp_avg" else self._exp_avg_sq
        if moments is None:
            raise RuntimeError(f"optimizer state {name!r} is not allocated before the first step")
        return moments[shard.buffer_index][shard.range_local.as_slice()]

    def _adopt_loaded_state(self, moments: tuple[list[torch.Tensor], list[torch.Tensor]],
                            on_host: bool, step_counts: list[int],
                            pinned: list[PinnedBuffer] | None = None) -> None:
        """Collective. Take loaded moments (on the host: with their page-locked memory) and
        step counts; rebuild params from the loaded master shards and all-gather them.
        Called by ``checkpoint.load`` only."""
        for buf in self._staged_pinned:  # moments staged by an earlier load are replaced
            buf.release()
        if on_host:
            self._staged_moments, self._exp_avg, self._exp_avg_sq = moments, None, None
            self._staged_pinned = list(pinned or [])
        else:
            (self._exp_avg, self._exp_avg_sq), self._staged_moments = moments, None
            self._staged_pinned = []
        self.step_counts = list(step_counts)
        self._views = None
        self._publish_params()

    def state_dict(self) -> dict[str, Any]:  # noqa: D102
        raise TypeError(
            "DistributedOptimizer state is sharded and keyed by param name; "
            "save it with shardopt.checkpoint.save(root, model, optimizer, step=...)"
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: D102
        raise TypeError("load DistributedOptimizer state with shardopt.checkpoint.load(...)")

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
