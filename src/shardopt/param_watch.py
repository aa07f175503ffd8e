"""Notice what happened to the model's params between two optimizer steps.

* Written in place (``load_state_dict``, ``p.zero_()``, ``nn.init.*``): the fp32 main copy is
  stale. Such writes bump the param's own version counter (the optimizer's writes through the
  buffer do not). Writes through ``p.data`` or collectives bump none: before the optimizer's
  first write every param counts as written, after it they need ``reload_model_params()``.
* Storage replaced (``model.float()``, ``.to(...)``, ``param.data = ...``): ``data_ptr()``
  differs, and training would no longer reach the param.
* The param or its module replaced by another object (:class:`Replacements`), or a param
  frozen at construction unfrozen: the optimizer holds no place for it.

Each check is a C-level ``map`` over the params (docs/optimizer.md).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch

from .errors import ParamMovedError, UsageError
from .guards import unowned_trainable
from .wrap_guard import ADAPTERS

_version = attrgetter("_version")
_requires_grad = attrgetter("requires_grad")
_data_ptr = torch.Tensor.data_ptr


@dataclass(frozen=True)
class Placement:
    """Where the optimizer holds a param: its dtype, device and shape."""

    dtype: torch.dtype
    device: torch.device
    shape: tuple[int, ...]


class ParamWatch:
    """Recorded storage address and version counter of each param, in ``named`` order."""

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]], dp_rank: int,
                 frozen: Sequence[tuple[str, torch.nn.Parameter]],
                 replaced: Replacements) -> None:
        self.fqns = tuple(fqn for fqn, _ in named)
        self.params = [p for _, p in named]
        self.replaced = replaced
        self._frozen = list(frozen)  # the model's params not trainable at construction
        self._frozen_params = [p for _, p in self._frozen]
        self._placed = [Placement(p.dtype, p.device, tuple(p.shape)) for p in self.params]
        self._dp_rank = dp_rank
        self._ptrs = list(map(_data_ptr, self.params))
        self._versions = list(map(_version, self.params))
        # Until the optimizer first writes the params (record()), every param counts as
        # written: writes no counter sees before the first step (a broadcast, p.data) count.
        self._fresh = True
        self.writes = 0  # how many times the optimizer wrote the params

    def record(self) -> None:
        """Call after every write of the optimizer to the params: they are in sync now."""
        self._versions = list(map(_version, self.params))
        self._fresh = False
        self.writes += 1

    def rebase(self, views: Sequence[torch.Tensor]) -> None:
        """The params' storage was re-allocated (``onload()``): ``views`` (in ``fqns`` order)
        are where they live now. Versions stay: a write made before the offload still counts."""
        self._ptrs = list(map(_data_ptr, views))

    def versions(self) -> list[int]:
        """The params' version counters now, for :meth:`undone`."""
        return list(map(_version, self.params))

    def undone(self, before: list[int]) -> list[str]:
        """FQNs of the params written since ``before`` (:meth:`versions`), which ``onload()``
        undid; those in sync at ``before`` are in sync again."""
        out = []
        for i, (fqn, a, b) in enumerate(zip(self.fqns, self.versions(), before)):
            if a != b:
                out.append(fqn)
                if self._versions[i] == b:
                    self._versions[i] = a
        return out

    def written(self, record: bool = True) -> list[str]:
        """FQNs of the params written in place since :meth:`record` (before the first: every
        param, with ``record``), recording the current versions unless ``record`` is False.
        Raises :class:`ParamMovedError` if a param left the buffer or was replaced, a
        :class:`UsageError` if a param frozen at construction was unfrozen."""
        if list(map(_data_ptr, self.params)) != self._ptrs:
            self._raise_moved()
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
        for fqn, p, ptr, placed in zip(self.fqns, self.params, self._ptrs, self._placed):
            if p.data_ptr() != ptr:
                raise ParamMovedError(moved_message(self._dp_rank, fqn, p, placed))


def moved_message(dp_rank: int, fqn: str, p: torch.Tensor, placed: Placement) -> str:
    """Why param ``fqn`` no longer lives in the optimizer's buffer, naming what differs: its
    dtype, device or shape, else its storage (``param.data = ...``, a library re-binding it)."""
    differs = []
    if p.dtype != placed.dtype:
        differs.append(f"it is {p.dtype} (the optimizer holds it as {placed.dtype})")
    if p.device != placed.device:
        differs.append(f"it is on {p.device} (the optimizer holds it on {placed.device})")
    if tuple(p.shape) != placed.shape:
        differs.append(f"its shape is {tuple(p.shape)} (the optimizer holds {placed.shape})")
    what = "; ".join(differs) if differs else (
        f"its storage was replaced (same dtype {p.dtype}, device {p.device} and shape "
        f"{tuple(p.shape)}: param.data = ... or a library re-binding it)")
    return (f"[dp rank {dp_rank}] param {fqn!r} no longer lives in the optimizer's buffer: "
            f"{what}. The model was changed (model.float(), .half(), .to(...), .cuda(), "
            "param.data = ..., resize_token_embeddings) after DistributedOptimizer(model) was "
            "built, so training would no longer reach it. Change the model first, then build "
            "the optimizer. Frameworks move or copy the model as they prepare it (Accelerate "
            f"copies it with .to('cpu:0') on CPU) unless told not to: {ADAPTERS}.")


class _Places:
    """Entries of modules' ``_parameters`` or ``_modules`` dicts and what each held when the
    optimizer was built, as parallel lists a C-level ``map`` compares."""

    def __init__(self) -> None:
        self.tables: list[dict] = []
        self.names: list[str] = []
        self.held: list[Any] = []
        self.fqns: list[str] = []

    def add(self, table: dict, name: str, held: Any, fqn: str) -> None:
        for column, value in zip((self.tables, self.names, self.held, self.fqns),
                                 (table, name, held, fqn)):
            column.append(value)

    def unchanged(self) -> bool:
        return all(map(operator.is_, map(dict.get, self.tables, self.names), self.held))

    def changed(self) -> Iterator[tuple[str, Any, Any]]:
        """``(fqn, held, now)`` of each entry that holds another object now."""
        for table, name, held, fqn in zip(self.tables, self.names, self.held, self.fqns):
            now = table.get(name)
            if now is not held:
                yield fqn, held, now


class Replacements:
    """Params of the model replaced by other objects after construction (``module.weight =
    nn.Parameter(...)``, ``model.head = nn.Linear(...)``): the optimizer would never train the
    new ones (nor would ``torch.optim.AdamW``, silently). :meth:`check` raises
    :class:`ParamMovedError` naming the first place where a trainable param the optimizer does
    not hold came in; setting the old one back undoes it."""

    def __init__(self, model: torch.nn.Module, owned: Mapping[Any, str], dp_rank: int) -> None:
        self._dp_rank = dp_rank
        self._owned = owned
        self._params, self._children = _Places(), _Places()
        for name, module in model.named_modules():
            for n, q in module._parameters.items():
                if q is not None and q in owned:
                    self._params.add(module._parameters, n, q, _join(name, n))
            for n, c in module._modules.items():
                if c is not None and any(q in owned for q in c.parameters()):
                    self._children.add(module._modules, n, c, _join(name, n))
        self._task: int | None = None

    def check(self) -> None:
        """Raise :class:`ParamMovedError` naming the first replacement, if any (nothing is
        called per param unless a place changed)."""
        if not (self._params.unchanged() and self._children.unchanged()):
            self._raise_first()

    def check_in_backward(self) -> None:
        """:meth:`check` once per backward (the gradient hooks of its params call this);
        outside a backward ``step()`` checks first."""
        task = torch._C._current_graph_task_id()
        if task >= 0 and task != self._task:
            self._task = task
            self.check()

    def _raise_first(self) -> None:
        for fqn, _, new in self._params.changed():
            if not (new is None or new in self._owned or not new.requires_grad):
                self._raise(f"param {fqn!r} was replaced by a new Parameter after "
                            "DistributedOptimizer(model) was built (module.weight = "
                            "nn.Parameter(...), or a library swapping it): the optimizer holds "
                            "the old one and would never train the new one")
        for fqn, _, new in self._children.changed():
            if new is not None and any(q.requires_grad and q not in self._owned
                                       for q in new.parameters()):
                self._raise(f"module {fqn!r} was replaced after DistributedOptimizer("
                            "model) was built: the optimizer holds the old module's params "
                            "and would never train the new one's")

    def _raise(self, what: str) -> None:
        raise ParamMovedError(f"[dp rank {self._dp_rank}] {what}. Change the model first, then "
                              "build the optimizer.")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
