"""``optimizer.state``: torch's per-param state mapping over the sharded state, computed on
access; writes reach the state or raise :class:`StateWriteError`, never vanish
(docs/optimizer.md, "opt.state")."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

from .errors import StateWriteError
from .moments import MOMENTUM
from .state_dict import names, view


def _refuse_write(opt: Any, fqn: str, what: str) -> StateWriteError:
    return StateWriteError(
        f"[dp rank {opt.shard_state.dp.rank}] {what} optimizer.state[{fqn!r}]: its entries are "
        "computed from the sharded state on each access, so the change would be lost. Write "
        "into its tensors in place (state['exp_avg'].zero_()) or assign a tensor of the same "
        f"shape and dtype (copied in); set step counts in optimizer.param_steps[{fqn!r}], on "
        "every rank")


# In-place operators, whose names do not end in "_" as torch's in-place methods' do.
_INPLACE_OPERATORS = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod",
                                               "pow", "and", "or", "xor", "lshift", "rshift",
                                               "matmul")} | {"__setitem__"}


class _StepCount(torch.Tensor):
    """``optimizer.state[param]["step"]``: a 0-dim float copy of the param's step count (kept in
    ``optimizer.param_steps``) whose in-place writes (``zero_()``, ``+=``, ``out=``) raise;
    anything else computes, copies and pickles as a plain tensor."""

    @staticmethod
    def __new__(cls, opt: Any, fqn: str) -> _StepCount:
        count = torch.Tensor._make_subclass(cls, torch.tensor(float(opt.param_steps[fqn])))
        count._opt, count._fqn = opt, fqn
        return count

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        out = kwargs.get("out")
        if ((name.endswith("_") and not name.endswith("__")) or name in _INPLACE_OPERATORS
                or out is not None):
            written = [*args[:1], *(out if isinstance(out, (tuple, list)) else [out])]
            count = next((t for t in written if isinstance(t, _StepCount)), None)
            if count is not None:
                raise _refuse_write(count._opt, count._fqn, f"{name} on the step count of")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _plain(self) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return self.detach().clone()

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return self._plain()

    def __reduce_ex__(self, proto: int) -> Any:
        return self._plain().__reduce_ex__(proto)

    def __repr__(self, **kwargs: Any) -> str:  # noqa: ARG002
        return repr(self._plain())


class _Entry(dict):
    """``optimizer.state[param]``: tensors viewing the live state; assigning a tensor of the same
    shape and dtype copies it in (as frameworks moving state do); replacing or removing an
    entry otherwise raises. Copies and pickles are dicts."""

    def __init__(self, opt: Any, fqn: str, values: dict[str, Any]) -> None:
        super().__init__(values)
        self._opt, self._fqn = opt, fqn

    def __setitem__(self, key: str, value: Any) -> None:
        current = dict.get(self, key)
        if value is current:
            return
        if (key != "step" and isinstance(current, torch.Tensor)
                and isinstance(value, torch.Tensor) and value.shape == current.shape
                and value.dtype == current.dtype):
            self._opt._before_state_write(host=True)  # a background save may be reading it
            current.copy_(value)
            return
        shown = (f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                 if isinstance(value, torch.Tensor) else type(value).__name__)
        raise _refuse_write(self._opt, self._fqn, f"setting {key!r} to {shown} in")

    def update(self, other: Any = (), **kwargs: Any) -> None:  # type: ignore[override]
        for key, value in dict(other, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> _Entry:  # type: ignore[override,misc]
        self.update(other)
        return self

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse_write(self._opt, self._fqn, "removing entries of")

    __delitem__ = pop = popitem = setdefault = clear = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> Any:
        return dict, (dict(self),)


class LocalState(defaultdict):
    """``optimizer.state``: a ``defaultdict`` keyed by param, as torch's, whose entries are
    computed on access: ``step``, and for the part of the param this rank holds ``offset``,
    ``master_param`` and the moments, as 1-D views from element ``offset`` of the flattened
    param (a Muon matrix's ``momentum_buffer`` in the param's shape). Replacing or removing an
    entry raises :class:`StateWriteError`."""

    def __init__(self, opt: Any) -> None:
        super().__init__(dict)
        self._opt = opt
        self._fqn_of = opt.shard_state.fqn_of

    def _entry(self, fqn: str) -> dict[str, Any]:
        opt = self._opt
        st = opt.shard_state
        out: dict[str, Any] = {"step": _StepCount(opt, fqn)}
        shard = st.shard_of.get(fqn)
        if shard is not None:
            out["offset"] = shard.range_param.start
            out["master_param"] = st.view("master_param", shard)
            if st.has_moments:
                out.update({name: view(st.moment(name.removesuffix(".scale"), shard), name)
                            for name in names(opt, fqn)[:-1]})
            if MOMENTUM in out:  # a Muon matrix, whole on this rank: torch's Muon's shape
                out[MOMENTUM] = out[MOMENTUM].view(opt.layout.slots[fqn].shape)
        return _Entry(opt, fqn, out)

    def __getitem__(self, param: Any) -> Any:
        fqn = self._fqn_of.get(param)
        return self._entry(fqn) if fqn is not None else super().__getitem__(param)

    def _check_not_owned(self, params: Any) -> None:
        for param in params:
            fqn = self._fqn_of.get(param)
            if fqn is not None:
                raise _refuse_write(self._opt, fqn, "replacing or removing")

    def __setitem__(self, param: Any, value: Any) -> None:
        self._check_not_owned([param])
        super().__setitem__(param, value)

    def __delitem__(self, param: Any) -> None:
        self._check_not_owned([param])
        super().__delitem__(param)

    def pop(self, param: Any, *default: Any) -> Any:  # type: ignore[override]
        self._check_not_owned([param])
        return super().pop(param, *default)

    def setdefault(self, param: Any, default: Any = None) -> Any:  # type: ignore[override]
        self._check_not_owned([param])
        return super().setdefault(param, default)

    def update(self, other: Any = (), **kwargs: Any) -> None:  # type: ignore[override]
        items = dict(other, **kwargs)
        self._check_not_owned(items)
        super().update(items)

    def clear(self) -> None:
        self._check_not_owned(self._fqn_of)  # resetting the state this way would be lost

    def get(self, param: Any, default: Any = None) -> Any:
        return self[param] if param in self else default

    def __contains__(self, param: object) -> bool:
        return param in self._fqn_of or super().__contains__(param)

    def __iter__(self) -> Iterator[Any]:
        yield from self._fqn_of
        yield from (p for p in super().__iter__() if p not in self._fqn_of)

    def __len__(self) -> int:
        return len(self._fqn_of) + sum(1 for p in super().__iter__()
                                           if p not in self._fqn_of)

    def keys(self) -> Any:  # type: ignore[override]
        return list(self)

    def values(self) -> Any:  # type: ignore[override]
        return [self[p] for p in self]

    def items(self) -> Any:  # type: ignore[override]
        return [(p, self[p]) for p in self]

    def __repr__(self) -> str:
        return f"LocalState({len(self)} params, dp rank {self._opt.shard_state.dp.rank})"
