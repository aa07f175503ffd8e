"""Notice what happened to the model's params between two optimizer steps.

After construction every trainable param is a view of the optimizer's flat
param buffer, and bf16/fp16 params have an fp32 main copy that the update
reads. Two things a user may do to a param behind the optimizer's back:

* write it in place (``model.load_state_dict``, ``p.zero_()``, ``nn.init.*``,
  ``p.copy_(ema)``): the main copy is stale and the next update would revert
  the write. Each of those bumps the param's own version counter (a Parameter
  keeps its own counter after ``p.data = view``; writes the optimizer makes
  through the buffer never bump it), so comparing ``p._version`` with the value
  recorded after the optimizer's last write finds them. Writes through
  ``p.data`` (``p.data.copy_(x)``) and by collectives (``dist.broadcast(p, 0)``)
  bump no counter at all: before the optimizer's first write every param counts
  as written (the first step re-seeds them all, one pass), after it they need
  ``DistributedOptimizer.reload_model_params()``.
* replace its storage (``model.float()``, ``.to(dtype or device)``,
  ``.cuda()``, ``.half()``): the param no longer lives in the buffer, so
  training would silently stop reaching it. Its ``data_ptr()`` differs from the
  recorded one.

And one thing to a param the optimizer does not hold: unfreeze it
(``requires_grad_(True)``) when it was frozen at construction. The optimizer laid
out only the params trainable then, so it would never train it, where
``torch.optim.AdamW(model.parameters())`` would: ``step()`` raises instead.

Both checks are a C-level ``map`` over the params, as is recording the versions after the
step; their cost per param is measured by ``benchmarks/probes/step_bookkeeping.py``
(docs/optimizer.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

import torch

from .guards import UsageError, unowned_trainable
from .wrap_guard import ADAPTERS
from .errors import ParamMovedError

_version = attrgetter("_version")
_requires_grad = attrgetter("requires_grad")
_data_ptr = torch.Tensor.data_ptr


class ParamWatch:
    """Recorded storage address and version counter of each param, in ``fqns`` order."""

    def __init__(self, fqns: Sequence[str], params: Sequence[torch.nn.Parameter],
                 expected: Sequence[tuple[torch.dtype, torch.device, tuple[int, ...]]],
                 dp_rank: int,
                 frozen: Sequence[tuple[str, torch.nn.Parameter]] = ()) -> None:
        self.fqns = tuple(fqns)
        self.params = list(params)
        self._frozen = list(frozen)  # the model's params not trainable at construction
        self._frozen_params = [p for _, p in self._frozen]
        self._expected = list(expected)
        self._dp_rank = dp_rank
        self._ptrs = list(map(_data_ptr, self.params))
        self._versions = list(map(_version, self.params))
        # Until the optimizer first writes the params (its first step or a load: record()),
        # every param counts as written, so every re-seed before then (the first step's,
        # state_dict()'s, a save's, offload()'s) takes every main param from its param. That
        # picks up writes no counter sees made before the first step: rank 0's weights
        # broadcast with torch.distributed, writes through ``p.data``.
        self._fresh = True
        self.writes = 0  # how many times the optimizer wrote the params

    def record(self) -> None:
        """Call after every write of the optimizer to the params: they are in sync now."""
        self._versions = list(map(_version, self.params))
        self._fresh = False
        self.writes += 1

    def rebase(self, views: Sequence[torch.Tensor]) -> None:
        """Call after the optimizer itself gave the params' storage back and re-allocated it
        (``onload()``): ``views`` (in ``fqns`` order) are where the params must live now, in
        the buffer, so a param moved out of it meanwhile is still found. Versions are left
        as they were, so a write the user made before the offload is still found."""
        self._ptrs = list(map(_data_ptr, views))

    def versions(self) -> list[int]:
        """The params' version counters now, for :meth:`undone`."""
        return list(map(_version, self.params))

    def undone(self, before: list[int]) -> list[str]:
        """FQNs of the params written in place since ``before`` (:meth:`versions`), whose
        writes the optimizer has since undone (``onload()`` restored them). Those not
        written between :meth:`record` and ``before`` are in sync again, so the next
        ``step()`` does not re-seed their main params from the restored values."""
        now = self.versions()
        out = []
        for i, (fqn, a, b) in enumerate(zip(self.fqns, now, before)):
            if a != b:
                out.append(fqn)
                if self._versions[i] == b:
                    self._versions[i] = a
        return out

    replaced: Replacements | None = None  # set by the optimizer

    def written(self, record: bool = True) -> list[str]:
        """FQNs of the params written in place since :meth:`record` (with ``record``, before
        the first :meth:`record`: every param); raises
        :class:`ParamMovedError` if a param was moved out of the buffer, a
        :class:`~shardopt.guards.UsageError` if a param frozen at construction was
        unfrozen. Records the current versions unless ``record`` is False (the caller
        re-seeds from the params it gets)."""
        if list(map(_data_ptr, self.params)) != self._ptrs:
            self._raise_moved()
        if self.replaced is not None:
            self.replaced.check()
        if any(map(_requires_grad, self._frozen_params)):
            self._check_unfrozen()
        now = list(map(_version, self.params))
        if record and self._fresh:
            self._versions = now
            return list(self.fqns)
        if now == self._versions:
            return []
        out = [f for f, a, b in zip(self.fqns, now, self._versions) if a != b]
        if record:
            self._versions = now
        return out

    def _check_unfrozen(self) -> None:
        fqn = unowned_trainable(self._frozen)  # one another optimizer trains is fine
        if fqn is None:
            return
        raise UsageError(
            f"[dp rank {self._dp_rank}] param {fqn!r} was frozen (requires_grad=False) when "
            "DistributedOptimizer(model) was built, so the optimizer holds no place for it and "
            "would never train it. Build the optimizer with every param it should ever train "
            "trainable; freezing one later with requires_grad_(False) leaves it alone.")

    def _raise_moved(self) -> None:
        for fqn, p, ptr, expected in zip(self.fqns, self.params, self._ptrs, self._expected):
            if p.data_ptr() != ptr:
                raise ParamMovedError(moved_message(self._dp_rank, fqn, p, *expected))


def moved_message(dp_rank: int, fqn: str, p: torch.Tensor, dtype: torch.dtype,
                  device: torch.device, shape: tuple[int, ...]) -> str:
    """Why param ``fqn`` no longer lives in the optimizer's buffer, naming what differs: its
    dtype, device or shape when those changed, else its storage (``param.data = ...``, or
    a library that re-binds it, as ``resize_token_embeddings`` does)."""
    differs = []
    if p.dtype != dtype:
        differs.append(f"it is {p.dtype} (the optimizer holds it as {dtype})")
    if p.device != device:
        differs.append(f"it is on {p.device} (the optimizer holds it on {device})")
    if tuple(p.shape) != tuple(shape):
        differs.append(f"its shape is {tuple(p.shape)} (the optimizer holds {tuple(shape)})")
    what = "; ".join(differs) if differs else (
        f"its storage was replaced (same dtype {p.dtype}, device {p.device} and shape "
        f"{tuple(p.shape)}: param.data = ... or a library re-binding it)")
    return (f"[dp rank {dp_rank}] param {fqn!r} no longer lives in the optimizer's buffer: "
            f"{what}. The model was changed (model.float(), .half(), .to(...), .cuda(), "
            "param.data = ..., resize_token_embeddings) after DistributedOptimizer(model) was "
            "built, so training would no longer reach it. Change the model first, then build "
            "the optimizer. Frameworks move or copy the model as they prepare it (Accelerate "
            f"copies it with .to('cpu:0') on CPU) unless told not to: {ADAPTERS}.")


class Replacements:
    """Params of the model replaced by other objects after construction: ``module.weight =
    nn.Parameter(...)``, a submodule swapped for a new one (``model.head = nn.Linear(...)``).
    The optimizer holds the old params; the new ones would never be trained (as
    ``torch.optim.AdamW`` would not train them either, silently). torch's global
    registration hooks report every such assignment; this keeps the first that replaces a
    param (or a module holding params) of this model by one the optimizer does not hold, and
    :meth:`check` raises :class:`ParamMovedError` naming it. Setting the old one back undoes
    it. Holds modules by id; torch's hooks reach it through :data:`_WATCHERS`."""

    def __init__(self, model: Any, owned: Mapping[Any, str], dp_rank: int) -> None:
        self._dp_rank = dp_rank
        self._owned = owned
        # id(module) -> (the module, weakly; name -> its owned param / its child, weakly)
        self._params: dict[int, tuple[weakref.ref, dict[str, Any]]] = {}
        self._children: dict[int, tuple[weakref.ref, dict[str, weakref.ref]]] = {}
        self._fqn_of_module: dict[int, str] = {}
        for name, module in model.named_modules():
            self._fqn_of_module[id(module)] = name
            mine = {n: q for n, q in module._parameters.items() if q is not None and q in owned}
            if mine:
                self._params[id(module)] = (weakref.ref(module), mine)
            kids = {n: weakref.ref(c) for n, c in module._modules.items()
                    if c is not None and any(q in owned for q in c.parameters())}
            if kids:
                self._children[id(module)] = (weakref.ref(module), kids)
        self.problems: dict[tuple[int, str], str] = {}
        _watch_registrations(self)

    def _where(self, module: Any, name: str) -> str:
        base = self._fqn_of_module.get(id(module), "?")
        return f"{base}.{name}" if base else name

    def _on_param(self, module: Any, name: str, param: Any) -> None:
        entry = self._params.get(id(module))
        old = entry[1].get(name) if entry is not None and entry[0]() is module else None
        if old is None:
            return
        key = (id(module), name)
        if param is old or param in self._owned or param is None or not param.requires_grad:
            self.problems.pop(key, None)  # back, another param this optimizer trains, frozen
        else:
            self.problems[key] = (
                f"param {self._where(module, name)!r} was replaced by a new Parameter after "
                "DistributedOptimizer(model) was built (module.weight = nn.Parameter(...), or "
                "a library swapping it): the optimizer holds the old one and would never "
                "train the new one")

    def _on_module(self, module: Any, name: str, child: Any) -> None:
        entry = self._children.get(id(module))
        ref = entry[1].get(name) if entry is not None and entry[0]() is module else None
        old = None if ref is None else ref()
        if old is None:
            return
        key = (id(module), name)
        new = [] if child is None else [q for q in child.parameters()
                                       if q.requires_grad and q not in self._owned]
        if child is old or not new:
            self.problems.pop(key, None)
        else:
            self.problems[key] = (
                f"module {self._where(module, name)!r} was replaced after "
                "DistributedOptimizer(model) was built: the optimizer holds the old "
                "module's params and would never train the new one's")

    def check(self) -> None:
        """Raise :class:`ParamMovedError` naming the first replacement, if any."""
        if self.problems:
            what = next(iter(self.problems.values()))
            raise ParamMovedError(f"[dp rank {self._dp_rank}] {what}. Change the model "
                                  "first, then build the optimizer.")


# torch's registration hooks are process-wide, so one pair serves every optimizer's
# Replacements, held weakly here: a pair per optimizer could not be removed when its
# optimizer is collected, since the collection may run while torch iterates the hooks.
_WATCHERS: weakref.WeakSet[Replacements] = weakref.WeakSet()
_HOOKS: list[Any] = []


def _watch_registrations(watcher: Replacements) -> None:
    _WATCHERS.add(watcher)
    if _HOOKS:
        return
    import torch.nn.modules.module as nn_module

    def on_param(module: Any, name: str, param: Any) -> None:
        for w in list(_WATCHERS):
            w._on_param(module, name, param)

    def on_module(module: Any, name: str, child: Any) -> None:
        for w in list(_WATCHERS):
            w._on_module(module, name, child)

    _HOOKS.append(nn_module.register_module_parameter_registration_hook(on_param))
    _HOOKS.append(nn_module.register_module_module_registration_hook(on_module))
