"""Loud errors for a model trained the wrong way around its optimizer: wrapped in
``DistributedDataParallel`` (which would reduce the gradients a second time) or deep-copied
after the optimizer was built (whose params it does not hold). No communication.

:class:`WrapGuard` puts one forward pre-hook on the model: its forward inside a DDP forward
raises :class:`WrappedModelError`, naming the framework adapters. A deep copy of the model
gets a copy of the hook that notes the copy's first param to get a gradient; ``step()``
raises if one did while none of the optimizer's own params got one. Pickling the model stores
an inert hook.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .errors import WrappedModelError

ADAPTERS = (
    "Lightning: Trainer(strategy=shardopt.recipes.integrations.lightning.ShardoptStrategy()); "
    "Accelerate: shardopt.recipes.integrations.accelerate.prepare(accelerator, model, optimizer, ...) "
    "in place of accelerator.prepare(model, optimizer, ...); Hugging Face Trainer: "
    "shardopt.recipes.integrations.transformers.ShardoptTrainer in place of Trainer; in your own "
    "loop, call the model itself")


class WrapGuard:
    """The checks of one optimizer over one model (module docstring), through the optimizer's
    gradient sync ``grad_sync`` (held weakly: the model's hook must not keep it alive)."""

    def __init__(self, grad_sync: Any, model: torch.nn.Module) -> None:
        self.sync = weakref.ref(grad_sync)
        self.model = weakref.ref(model)
        self.copy_grad: str | None = None  # a deep copy's first param to get a gradient
        self._ddp_holds: weakref.WeakKeyDictionary[torch.nn.Module, bool] = \
            weakref.WeakKeyDictionary()
        self.handle = model.register_forward_pre_hook(_ForwardCheck(weakref.ref(self)))
        weakref.finalize(grad_sync, self.handle.remove)

    def check_forward(self, module: torch.nn.Module) -> None:
        """Raise if ``module`` (the model) runs inside the forward of a DDP that reduces its
        params' gradients. Other callers (DataParallel's replicas) pass."""
        get_active = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
        ddp = get_active() if get_active is not None else None
        if ddp is None or module is not self.model():
            return
        holds = self._ddp_holds.get(ddp)
        if holds is None:
            holds = self._ddp_holds[ddp] = self._reduced_by(ddp)
        if holds:
            sync = self.sync()
            rank = sync.dp.rank if sync is not None else "?"
            raise WrappedModelError(
                f"[dp rank {rank}] the model the DistributedOptimizer was built over runs "
                f"inside {type(ddp).__name__}, which would reduce "
                "its gradients a second time, in its own buckets, over the optimizer's: the "
                "optimizer averages the gradients itself, so do not wrap the model. Frameworks "
                f"wrap it unless told not to. {ADAPTERS}")

    def _reduced_by(self, ddp: torch.nn.Module) -> bool:
        sync = self.sync()
        if sync is None:
            return False
        ours = {id(p) for p in sync.fqn_of}
        ignored = getattr(ddp, "parameters_to_ignore", ())
        return any(id(p) in ours for name, p in ddp.module.named_parameters()
                   if name not in ignored)

    def copy_got_grad(self, fqn: str) -> None:
        """A param of a deep copy of the model got a gradient (the hook of its first forward)."""
        if self.copy_grad is None:
            self.copy_grad = fqn

    def check_step(self) -> None:
        """At ``step()``: raise if a deep copy of the model got gradients since the last
        step and the optimizer's own params got none."""
        fqn, self.copy_grad = self.copy_grad, None
        sync = self.sync()
        if fqn is None or sync is None:
            return
        if sync.wait() or any(p.grad is not None for p in sync.fqn_of):
            return
        raise WrappedModelError(
            f"[dp rank {sync.dp.rank}] step(): no param of the optimizer got a gradient since "
            f"the last step, but param {fqn!r} of a deep copy of its model (copy.deepcopy "
            "after the optimizer was built) did: the optimizer holds the original model's "
            "params and would train nothing. Build the optimizer over the model you train, "
            "after copying it")


class _ForwardCheck:
    """The forward pre-hook of :class:`WrapGuard` on the model (``copy_of``: on a deep copy)."""

    def __init__(self, guard: weakref.ref[WrapGuard], copy_of: bool = False) -> None:
        self.guard, self.copy_of = guard, copy_of
        self._armed = False

    def __call__(self, module: torch.nn.Module, _args: Any) -> None:
        guard = self.guard()
        if guard is None:
            return
        if not self.copy_of:
            guard.check_forward(module)
        elif not self._armed and torch.is_grad_enabled():
            self._armed = True
            for fqn, p in module.named_parameters():
                if p.requires_grad and p.is_leaf:
                    p.register_post_accumulate_grad_hook(_CopyGradNote(self.guard, fqn))

    def __deepcopy__(self, memo: dict[int, Any]) -> _ForwardCheck:
        return _ForwardCheck(self.guard, copy_of=True)

    def __reduce__(self) -> Any:
        return (_InertHook, ())


class _CopyGradNote:
    """Post-accumulate-grad hook on a deep copy's param: tells the guard it got a gradient."""

    def __init__(self, guard: weakref.ref[WrapGuard], fqn: str) -> None:
        self.guard, self.fqn = guard, fqn

    def __call__(self, _param: torch.Tensor) -> None:
        guard = self.guard()
        if guard is not None:
            guard.copy_got_grad(self.fqn)

    def __deepcopy__(self, memo: dict[int, Any]) -> _CopyGradNote:
        return self

    def __reduce__(self) -> Any:
        return (_InertHook, ())


class _InertHook:
    """What an unpickled model holds in place of the guard's hooks: nothing to check."""

    def __call__(self, *_args: Any) -> None:
        return None
