"""The steps of building a :class:`~shardopt.DistributedOptimizer` that need no optimizer
yet: checking and grouping the params, the layout's alignment, the order buckets launch in,
which update path runs, and the gradient hooks that mark which optimizer owns a param."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import kernels, muon, quant
from .config import GROUP_KEYS, INT8, OptimizerConfig, group_value
from .layout import Bucket, Layout

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ParamGroupFn = Callable[[str, torch.nn.Parameter], dict[str, Any]]
Named = list[tuple[str, torch.nn.Parameter]]  # (FQN, param) of the trainable params, in order


def trainable(model: torch.nn.Module) -> tuple[Named, torch.device]:
    """The params that require grad, by FQN, and the one device they are all on."""
    named = [(fqn, p) for fqn, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("model has no parameters that require grad")
    device = named[0][1].device
    for fqn, p in named:
        if p.device != device:
            raise ValueError(f"param {fqn!r} is on {p.device} but {named[0][0]!r} is on "
                             f"{device}; all trainable params must be on one device")
        if p.dtype not in SUPPORTED_DTYPES:
            # fp32 main params and fp32 state would silently lower float64 precision.
            raise ValueError(f"param {fqn!r} has dtype {p.dtype}; shardopt trains bf16, fp16 "
                             "and fp32 params")
    return named, device


def choose_kernel(config: OptimizerConfig, device: torch.device) -> str:
    """``"triton"`` or ``"torch"``: the update path ``config.step_kernel`` asks for on ``device``."""
    wanted = config.step_kernel
    if wanted == "torch" or (wanted == "auto" and device.type != "cuda"):
        return "torch"
    if kernels.available(device):
        return "triton"
    if wanted == "auto":
        return "torch"
    raise ValueError(
        f"step_kernel='triton' needs Triton and a CUDA device (params are on {device}"
        f"{'' if kernels.triton is not None else ', Triton is not installed'})")


def alignment(config: OptimizerConfig) -> tuple[int, int]:
    """``(align_numel, param_align)`` for the layout: 8-bit moments need every block of
    :data:`quant.QBLOCK` elements of a param whole on one rank (see :mod:`.quant`)."""
    if INT8 not in (config.exp_avg_dtype, config.exp_avg_sq_dtype):
        return config.align_numel, 1
    return math.lcm(config.align_numel, quant.QBLOCK), quant.QBLOCK


def param_groups(named: Named, defaults: dict[str, Any],
                 param_group_fn: ParamGroupFn | None) -> list[dict[str, Any]]:
    """One param group per distinct set of ``param_group_fn`` overrides, validated."""
    groups: dict[tuple, dict[str, Any]] = {}
    for fqn, p in named:
        overrides = dict(param_group_fn(fqn, p) or {}) if param_group_fn else {}
        optimizer = overrides.pop("optimizer", muon.ADAMW)
        if optimizer not in muon.OPTIMIZERS:
            raise ValueError(f"param_group_fn gave optimizer={optimizer!r} for param {fqn!r}; "
                             f"the optimizers are {list(muon.OPTIMIZERS)}")
        if optimizer == muon.MUON:
            overrides = muon.group_settings(fqn, p, overrides)
            groups.setdefault(tuple(overrides.items()), {"params": [], **overrides}
                              )["params"].append(p)
            continue
        unknown = set(overrides) - set(GROUP_KEYS)
        if unknown:
            raise ValueError(f"param_group_fn returned unknown keys {sorted(unknown)} for "
                             f"param {fqn!r}; allowed: {list(GROUP_KEYS)}")
        for key, value in overrides.items():
            overrides[key] = group_value(key, value)
            if overrides[key] is None:
                raise ValueError(f"param_group_fn gave {key}={value!r} for param {fqn!r}: "
                                 "AdamW takes finite numbers >= 0 (betas: two of them below 1)")
        group = groups.setdefault(tuple(sorted(overrides.items())), {"params": [], **overrides})
        group["params"].append(p)
    return list(groups.values())


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Map every alias FQN of a shared param to the FQN ``named_parameters`` reports."""
    canonical = {p: fqn for fqn, p in model.named_parameters()}
    return {fqn: canonical[p] for fqn, p in model.named_parameters(remove_duplicate=False)
            if canonical[p] != fqn}


def launch_order(layout: Layout, named: Named) -> list[Bucket]:
    """Buckets in the order backward completes them: by the earliest-registered param, last first."""
    position = {fqn: i for i, (fqn, _) in enumerate(named)}
    buckets = [b for buf in layout.buffers for b in buf.buckets]
    return sorted(buckets, key=lambda b: (-min(position[f] for f in b.param_fqns),
                                          b.buffer_index, b.index))


def grad_hooks(owner: Any, grad_sync: Any, host: Any, named: Named) -> list[Any]:
    """Register ``grad_sync.on_grad_ready`` on every param, refused while ``host`` has params
    or grads offloaded; removed when ``owner`` (the optimizer, :func:`owner_of`) is gone. The
    hook holds all three weakly: a tensor's hooks are invisible to the garbage collector."""
    on_grad = WeakGradHook(owner, grad_sync, host)
    handles = [p.register_post_accumulate_grad_hook(on_grad) for _, p in named]
    weakref.finalize(owner, remove_hooks, list(handles))
    return handles


class WeakGradHook:
    """``grad_sync.on_grad_ready`` through weak references (a no-op once they are gone)."""

    def __init__(self, owner: Any, grad_sync: Any, host: Any) -> None:
        self.owner = weakref.ref(owner)
        self._sync, self._host = weakref.ref(grad_sync), weakref.ref(host)

    def __call__(self, param: torch.nn.Parameter) -> None:
        sync, host = self._sync(), self._host()
        if sync is not None and host is not None:
            if host.offloaded:  # a backward of a graph built before offload()
                host.check_onloaded("a backward", ("grads", "params"))
            sync.on_grad_ready(param)


def post_accumulate_grad_hooks(p: torch.Tensor) -> Any:
    """The post-accumulate-grad hooks on ``p``, in registration order. torch has no public way
    to list a tensor's hooks (registering returns only a handle), so this reads
    ``p._post_accumulate_grad_hooks``."""
    hooks = getattr(p, "_post_accumulate_grad_hooks", None)
    return hooks.values() if hooks else ()


def owner_of(p: torch.Tensor) -> Any:
    """The live optimizer whose gradient hook is on ``p``, or None (one whose hooks were
    removed has let go)."""
    for hook in post_accumulate_grad_hooks(p):
        owner = hook.owner() if isinstance(hook, WeakGradHook) else None
        if owner is not None:
            return owner
    return None


def remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
