"""torch.optim's state-dict contract for :class:`~shardopt.DistributedOptimizer`.

A rank's ``state_dict()`` follows ``torch.distributed.checkpoint.state_dict``'s layout, keyed
by param FQN, never by position::

    {"state": {fqn: {"step": tensor(7.), "exp_avg": FlatShard, "exp_avg_sq": FlatShard,
                     "master_param": FlatShard, "param_dtype": "bfloat16", ...}, ...},
     "param_groups": [{"lr": ..., ..., "params": [fqn, ...]}, ...]}

Every trainable param has an entry on every rank; each state tensor is a
:class:`~shardopt.flat_shard.FlatShard` of this rank's range of the param's flattened state
(possibly empty) viewing the live state, so DCP saves and loads it at any DP size; before the
first step the moments' FlatShards make host zeros on demand. A Muon param has
``"momentum_buffer"`` (fp32) in place of the Adam moments. bf16/int8 moments appear as
stored (int8 with ``"{moment}.scale"`` entries), with ``"{moment}_dtype"`` naming how they
were kept. ``load_state_dict`` is collective: every rank validates its dict, the ranks agree,
and only then is anything written; on any mismatch every rank raises
:class:`StateDictError` naming the FQN (docs/optimizer.md, docs/lowprec.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import comm, muon, quant
from .config import GROUP_KEYS, INT8, dtype_name, group_value
from .box_shard import box_value, state_block
from .errors import StateDictError
from .flat_shard import FlatShard
from .layout import ParamShard, Range
from .moments import NAMES as MOMENTS
from .moments import piece

# ``opt`` is the DistributedOptimizer this serves, typed ``Any``: the optimizer imports
# this module, never the reverse.

log = logging.getLogger("shardopt.state_dict")


def _numel(opt: Any, fqn: str) -> int:
    return math.prod(opt.layout.slots[fqn].shape)


def names(opt: Any, fqn: str) -> list[str]:
    """The state entries of param ``fqn``: its moments (Adam's, with ``".scale"`` entries
    for 8-bit ones, or Muon's ``momentum_buffer``), then the master param."""
    out = []
    for name in opt.shard_state.moment_names[fqn]:
        kind = opt.shard_state.moment_kinds.get(name)
        out += [name, f"{name}.scale"] if kind == INT8 else [name]
    return out + ["master_param"]


@dataclass(frozen=True)
class _Expected:
    """Entry ``name`` of a param on this rank: dtype, the param's global numel of it, and
    this rank's offset and local numel."""

    dtype: torch.dtype
    numel: int
    offset: int
    size: int


def _expected(opt: Any, name: str, fqn: str, shard: ParamShard | None) -> _Expected:
    numel = math.prod(opt.layout.slots[fqn].shape)
    r = shard.range_param if shard else Range(0, 0)
    if name.endswith(".scale"):  # a piece starts on a block boundary (the layout's param_align)
        r = r.blocks(quant.QBLOCK)
        return _Expected(torch.float32, quant.num_scales(numel), r.start, r.size)
    if name == "master_param":
        return _Expected(torch.float32, numel, r.start, r.size)
    kind = opt.shard_state.moment_kinds.get(name, torch.float32)  # Muon's: fp32
    return _Expected(quant.storage_dtype(kind, sqrt=name == MOMENTS[1]), numel, r.start, r.size)


def _check_kinds(opt: Any, fqn: str, entry: Mapping, cast: set[str]) -> None:
    """Refuse moments kept in another format where one of them is 8-bit (a load that cast
    codes into values, or values into codes); collect float-to-float casts in ``cast``.
    Entries without the dtypes (older state dicts) are taken as they are."""
    for name, kind in opt.shard_state.moment_kinds.items():
        saved, mine = entry.get(f"{name}_dtype"), dtype_name(kind)
        if saved is None or saved == mine:
            continue
        if INT8 in (saved, mine):
            raise StateDictError(
                f"param {fqn!r}: {name} was kept as {saved} in the state dict but this "
                f"optimizer keeps it as {mine}; an 8-bit moment is codes and scales, which a "
                "torch.distributed.checkpoint load casts into other tensors as if they were "
                "values (if dcp.load filled this optimizer's state_dict(), its moments now "
                "hold them). Load with matching exp_avg_dtype / exp_avg_sq_dtype, or convert "
                "with shardopt.checkpoint.load")
        cast.add(f"{name} {saved} -> {mine}")


def view(m: quant.Moment, name: str) -> torch.Tensor:
    """The tensor of moment ``m`` that state entry ``name`` holds: its scales or values."""
    return m.scales if name.endswith(".scale") else m.values  # type: ignore[return-value]


def _value(opt: Any, name: str, fqn: str, shard: ParamShard | None) -> FlatShard:
    e = _expected(opt, name, fqn, shard)
    st = opt.shard_state
    block = state_block(st, name, fqn)
    if block is not None:  # a model-parallel plan: a BoxShard of the global tensor
        return box_value(st, name, fqn, shard, e.offset, e.size, e.dtype, block)
    if shard is None:
        return FlatShard(torch.empty(0, dtype=e.dtype, device=st.device), 0, e.numel)
    if name == "master_param":
        return FlatShard(st.view(name, shard), e.offset, e.numel)
    if st.has_moments:
        return FlatShard(view(st.moment(name.removesuffix(".scale"), shard), name), e.offset,
                         e.numel)
    return FlatShard.lazy(lambda: torch.zeros(e.size, dtype=e.dtype), e.offset, e.numel, e.size,
                          e.dtype, torch.device("cpu"))


def state_dict(opt: Any) -> dict[str, Any]:
    """Coordinator-free. This rank's state, keyed by FQN (see the module docstring); runs the
    hooks of ``register_state_dict_pre_hook`` / ``register_state_dict_post_hook`` as torch."""
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    st = opt.shard_state
    st.finish_param_sync()
    st.reseed_written()  # weights written since the last step are what the dict holds
    kinds = {f"{name}_dtype": dtype_name(kind) for name, kind in st.moment_kinds.items()}
    state: dict[str, dict[str, Any]] = {}
    for fqn in st.fqn_of.values():
        entry: dict[str, Any] = {"step": torch.tensor(float(opt.param_steps[fqn]))}
        for name in names(opt, fqn):
            entry[name] = _value(opt, name, fqn, st.shard_of.get(fqn))
        entry["param_dtype"] = dtype_name(opt.layout.buffers[
            opt.layout.slots[fqn].buffer_index].dtype)
        state[fqn] = {**entry, **kinds} if st.moment_names[fqn] == MOMENTS else entry
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [st.fqn_of[p] for p in g["params"]]} for g in opt.param_groups]
    sd = {"state": state, "param_groups": groups}
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        sd = post_hook(opt, sd) or sd
    return sd


@dataclass(frozen=True)
class _Copy:
    """One tensor of a validated state dict and the state of ``shard`` it goes into."""

    shard: ParamShard
    name: str
    source: torch.Tensor


@dataclass(frozen=True)
class _Plan:
    """What a validated state dict writes."""

    copies: list[_Copy]
    steps: dict[str, int]
    groups: list[dict[str, Any]]
    cast: set[str]  # moments a DCP load cast from another float dtype


def load_state_dict(opt: Any, sd: Any) -> None:
    """Collective. Validate ``sd`` on every rank, agree, then adopt it (module docstring);
    runs the hooks of ``register_load_state_dict_pre_hook`` / ``..._post_hook`` as torch."""
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        sd = pre_hook(opt, sd) or sd
    st = opt.shard_state
    st.finish_param_sync()
    plan, error = None, None
    try:
        plan = _check(opt, sd)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = e
    problems = comm.agree(st.dp, error)[1]
    if problems:
        raise StateDictError(f"load_state_dict failed: {problems}") from error
    assert plan is not None
    if plan.cast:  # the tensors already hold this optimizer's dtypes: a DCP load cast them
        log.info("load_state_dict: Adam moments kept in another float dtype, cast on "
                 "loading: %s", ", ".join(sorted(plan.cast)))
    for c in plan.copies:
        if c.name == "master_param":
            st.view(c.name, c.shard).copy_(c.source)
    host = opt.config.low_memory_resume
    moments = st.load_target(host).moments
    for c in plan.copies:
        if c.name != "master_param":
            m = moments.of(c.name.removesuffix(".scale"))[c.shard.buffer_index]
            view(piece(m, c.shard.range_local), c.name).copy_(c.source)
    st.adopt(moments, plan.steps, on_host=host)
    for group, saved in zip(opt.param_groups, plan.groups):
        group.update(saved)  # as torch's load_state_dict: lr & co. resume as saved
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def _check(opt: Any, sd: Any) -> _Plan:
    """Coordinator-free. Everything a load needs, or :class:`StateDictError` naming the FQN."""
    if not isinstance(sd, Mapping) or not {"state", "param_groups"} <= set(sd):
        got = sorted(map(str, sd)) if isinstance(sd, Mapping) else type(sd).__name__
        raise StateDictError("an optimizer state dict has 'state' and 'param_groups' (as "
                             f"DistributedOptimizer.state_dict() returns); got {got}")
    state, groups = sd["state"], sd["param_groups"]
    if not isinstance(state, Mapping) or not isinstance(groups, list):
        raise StateDictError("'state' must be a dict keyed by param FQN and 'param_groups' a list")
    positional = [k for k in state if not isinstance(k, str)]
    if positional:
        raise StateDictError(f"state is keyed by {positional[0]!r}: this is a positional "
                             "torch.optim state dict; DistributedOptimizer keys state by FQN")
    foreign = next((fqn for fqn, entry in state.items() if isinstance(entry, Mapping)
                    and entry and not {"master_param", "param_dtype"} & set(entry)), None)
    if foreign is not None:
        raise StateDictError(
            f"param {foreign!r}: its state in the state dict has "
            f"{sorted(map(str, state[foreign]))} but no master_param: it is not a "
            "DistributedOptimizer.state_dict() (a torch.optim optimizer's, as "
            "get_optimizer_state_dict returns, holds full tensors and no fp32 main params); "
            "load shardopt's own state dicts or checkpoints")
    hparams = _check_groups(opt, groups)  # which params first, then their state
    cast: set[str] = set()
    return _Plan(_check_state(opt, state, cast), _check_steps(opt, state), hparams, cast)


def _check_groups(opt: Any, groups: list) -> list[dict[str, Any]]:
    here = opt.shard_state.group_of
    there: dict[str, int] = {}
    for gi, g in enumerate(groups):
        params = g.get("params") if isinstance(g, Mapping) else None
        if not isinstance(params, list):
            raise StateDictError(f"param group {gi} of the state dict has no 'params' list")
        there.update((fqn, gi) for fqn in params)
    for fqn in there:
        if fqn not in here:
            raise StateDictError(f"param {fqn!r} of the state dict is not a trainable param "
                                 "of this optimizer's model")
    for fqn, gi in here.items():
        if fqn not in there:
            raise StateDictError(f"param {fqn!r} of the model is missing from the state dict")
        if there[fqn] != gi or len(groups) != len(opt.param_groups):
            raise StateDictError(f"param {fqn!r} is in param group {there[fqn]} of "
                                 f"{len(groups)} in the state dict but in group {gi} of "
                                 f"{len(opt.param_groups)} here (another param_group_fn?)")
    out = []
    for gi, g in enumerate(groups):
        values = {k: v for k, v in g.items() if k != "params"}
        first = opt.shard_state.fqn_of[opt.param_groups[gi]["params"][0]]
        for key in GROUP_KEYS:
            v = values[key] = group_value(key, g.get(key))
            if v is None:
                raise StateDictError(f"param group {gi} (with {first!r}) has {key}={g.get(key)!r}")
        if muon.is_muon(g) != muon.is_muon(opt.param_groups[gi]):
            def kind(group: Mapping) -> str:
                return "Muon" if muon.is_muon(group) else "AdamW"
            raise StateDictError(f"param group {gi} (with {first!r}) is {kind(g)}'s in the "
                                 f"state dict but {kind(opt.param_groups[gi])}'s here (another "
                                 "param_group_fn?)")
        if muon.is_muon(g):
            try:
                values.update(muon.settings_of(g).group())
            except ValueError as e:
                raise StateDictError(f"param group {gi} (with {first!r}): {e}") from None
        out.append(values)
    return out


def _check_steps(opt: Any, state: Mapping) -> dict[str, int]:
    steps = {}
    for fqn in opt.shard_state.fqn_of.values():
        step = state[fqn].get("step")
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            step = step.item()
        if not (isinstance(step, (int, float)) and not isinstance(step, bool)
                and step >= 0 and float(step).is_integer()):
            raise StateDictError(f"param {fqn!r}: step {step!r} is not a count")
        steps[fqn] = int(step)
    return steps


def _check_state(opt: Any, state: Mapping, cast: set[str]) -> list[_Copy]:
    for fqn in state:
        if fqn not in opt.layout.slots:
            raise StateDictError(f"state of param {fqn!r} in the state dict: no trainable "
                                 "param of this optimizer's model has that name")
    st = opt.shard_state
    copies = []
    for fqn in st.fqn_of.values():
        entry = state.get(fqn)
        if not isinstance(entry, Mapping):
            raise StateDictError(f"param {fqn!r} of the model has no state in the state dict")
        _check_kinds(opt, fqn, entry, cast)
        dtype = dtype_name(opt.layout.buffers[opt.layout.slots[fqn].buffer_index].dtype)
        if entry.get("param_dtype") != dtype:
            raise StateDictError(f"param {fqn!r} is {dtype} here but was "
                                 f"{entry.get('param_dtype')!r} in the state dict")
        shard = st.shard_of.get(fqn)
        for name in names(opt, fqn):
            e = _expected(opt, name, fqn, shard)
            v = entry.get(name)
            where = f"param {fqn!r}: {name} of the state dict"
            if not isinstance(v, FlatShard):
                raise StateDictError(f"{where} is a {type(v).__name__}, not a FlatShard as "
                                     "DistributedOptimizer.state_dict() returns")
            block = state_block(st, name, fqn)
            shape = (e.numel,) if block is None else st.parallel.global_shapes[fqn]
            if tuple(v.shape) != tuple(shape) or v.dtype != e.dtype:
                raise StateDictError(f"{where} is {v.dtype} of shape {tuple(v.shape)}; this "
                                     f"optimizer keeps {e.dtype} of shape {tuple(shape)} "
                                     "(moments: exp_avg_dtype / exp_avg_sq_dtype)")
            if (v.offset, v.local_numel, getattr(v, "block", None)) != (e.offset, e.size, block):
                raise StateDictError(
                    f"{where} holds elements [{v.offset}, {v.offset + v.local_numel}) on dp "
                    f"rank {st.dp.rank}, which holds [{e.offset}, {e.offset + e.size}) here "
                    f"(dp size {st.dp.size}): it was saved at another DP size or bucket "
                    "layout; reshard with shardopt.checkpoint or torch.distributed.checkpoint")
            local = v.local
            if local.dim() != 1 or local.numel() != e.size or local.dtype != e.dtype:
                raise StateDictError(f"{where}: its local tensor is {local.dtype} of shape "
                                     f"{tuple(local.shape)}, expected ({e.size},) {e.dtype}")
            if shard is not None:
                copies.append(_Copy(shard, name, local))
    return copies
