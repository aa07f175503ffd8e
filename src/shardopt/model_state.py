"""``model.state_dict()`` of a model the optimizer holds: each weight its own tensor.

The params are views of one flat buffer per dtype, and savers treat shared storage as tied
weights (``safetensors`` refuses them, ``torch.save`` of a submodule's state dict writes the
whole buffer). So a post-hook on every module owning such params replaces their entries with
copies; a param under two names (tied weights) gets one copy for both within one call.
``state_dict(keep_vars=True)`` returns the live Parameters uncopied (docs/optimizer.md,
"What the model hands out").
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class _Made:
    """A copy made for the state dict in progress (held weakly: the state dict owns it), and
    the optimizer's write count and the param's version it was made at."""

    copy: weakref.ref
    writes: int
    version: int


class StateDictCopies:
    """The post-hooks of one optimizer, and the copies made in the ``state_dict()`` call in
    progress."""

    def __init__(self, opt: Any, model: torch.nn.Module) -> None:
        self._opt = weakref.ref(opt)
        owned: Mapping[torch.nn.Parameter, str] = opt.shard_state.fqn_of
        self._own = {}  # module -> names of its params the optimizer holds
        for module in model.modules():
            mine = tuple(n for n, p in module._parameters.items() if p is not None and p in owned)
            if mine:
                self._own[module] = mine
        self._dest: weakref.ref | None = None
        self._made: dict[int, _Made] = {}  # by id(param)

    def register(self) -> list[Any]:
        return [m.register_state_dict_post_hook(CopyOwnParams(names, self))
                for m, names in self._own.items()]

    def copy(self, p: torch.nn.Parameter, value: torch.Tensor, state_dict: dict) -> torch.Tensor:
        """A copy of ``value`` (``p.detach()``), the one made already in this call for a
        name of the same param if there is one."""
        opt = self._opt()
        if opt is None:
            return value.clone()
        opt.shard_state.check_onloaded("model.state_dict() (it copies the params)", ("params",))
        if self._dest is None or self._dest() is not state_dict:
            self._dest, self._made = weakref.ref(state_dict), {}
        writes = opt.shard_state.param_writes
        made = self._made.get(id(p))
        if made is not None and (made.writes, made.version) == (writes, p._version):
            copy = made.copy()
            if copy is not None:  # the same param under another name: one copy for both
                return copy
        copy = value.clone()
        self._made[id(p)] = _Made(weakref.ref(copy), writes, p._version)
        return copy


class CopyOwnParams:
    """A module's state-dict post-hook: its entries of ``names`` that view a larger storage
    (the flat buffer) become copies. Pickled with the module (``torch.save(model)``,
    ``copy.deepcopy``), it keeps working without the optimizer: a copied model's params
    still share one storage."""

    def __init__(self, names: tuple[str, ...], copies: StateDictCopies | None = None) -> None:
        self.names, self.copies = names, copies

    def __call__(self, module: torch.nn.Module, state_dict: dict, prefix: str,
                 local_metadata: Any) -> None:
        for name in self.names:
            key = prefix + name
            value = state_dict.get(key)
            p = module._parameters.get(name)
            if value is None or value is p or p is None:  # keep_vars=True: as asked
                continue
            if value.untyped_storage().nbytes() <= value.numel() * value.element_size():
                continue  # its own storage already (a param moved out, a copied model's)
            state_dict[key] = (value.clone() if self.copies is None
                               else self.copies.copy(p, value, state_dict))

    def __reduce__(self) -> Any:
        return CopyOwnParams, (self.names,)
