"""Misuse checks for :class:`~shardopt.DistributedOptimizer`: clear errors up front instead of
a ``TypeError`` from deep inside, a silently detached param or a collective that hangs. Only
:func:`check_same_layout` communicates."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import comm, muon
from .build import alignment, owner_of
from .config import OptimizerConfig
from .errors import UsageError
from .layout import ParamSpec

HOW = ("pass the model and an OptimizerConfig: DistributedOptimizer(model, "
       "OptimizerConfig(lr=1e-3, ...)); per-param settings come from "
       "param_group_fn=lambda fqn, param: {...}")


def check_args(model: Any, config: Any, torch_kwargs: dict[str, Any]) -> None:
    """Coordinator-free. Refuse torch.optim-style arguments with the call that works."""
    if torch_kwargs:
        raise UsageError(f"DistributedOptimizer got torch.optim-style keyword arguments "
                         f"{sorted(torch_kwargs)}; {HOW}")
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"DistributedOptimizer takes the nn.Module itself (it needs param "
                         f"names and re-lays params out in flat buffers), not a "
                         f"{type(model).__name__} of params or param groups; {HOW}")
    if config is not None and not isinstance(config, OptimizerConfig):
        raise UsageError(f"config must be an OptimizerConfig, got {config!r}; {HOW}")


def ownership_problem(named: Iterable[tuple[str, torch.nn.Parameter]]) -> str | None:
    """Coordinator-free. Why these params cannot get a new optimizer, or None."""
    for fqn, p in named:
        if owner_of(p) is not None:
            return (f"param {fqn!r} already belongs to another DistributedOptimizer: a second "
                    "one would re-lay it out and detach it from the first; build one "
                    "optimizer per model (param_group_fn gives per-param settings)")
    return None


def unowned_trainable(named: Iterable[tuple[str, torch.nn.Parameter]]) -> str | None:
    """Coordinator-free. The FQN of the first param that requires grad but belongs to no
    DistributedOptimizer (nothing would train it), or None."""
    return next((fqn for fqn, p in named if p.requires_grad and owner_of(p) is None), None)


def check_same_layout(dp: comm.DPGroup, specs: list[ParamSpec], config: OptimizerConfig,
                      local_problem: str | None) -> None:
    """Collective. Raise :class:`UsageError` on every rank if any rank has ``local_problem``
    (naming the ranks) or built a different model (naming the first differing FQN): a digest,
    then the param lists when digests differ."""
    # A Muon param (whole on one rank) is laid out otherwise: part of its dtype here.
    described = [(s.fqn, tuple(s.shape), f"{s.dtype}{', muon' if s.whole else ''}")
                 for s in specs]
    # Besides the params, what the layout and the collectives depend on.
    described.append((_SETTINGS, (config.bucket_numel, *alignment(config)), str(config.grad_dtype)))
    digest = hashlib.sha256(repr(described).encode()).hexdigest() if dp.size > 1 else None
    error = None if local_problem is None else UsageError(local_problem)
    digests, problems = comm.agree(dp, error, digest)
    if problems:
        raise UsageError(problems)
    if len(set(digests)) > 1:
        lists = comm.all_gather_objects(described, dp)
        raise UsageError("DP ranks built different models: " + _first_difference(lists))


# The row of the layout digest that holds the settings, not a param.
_SETTINGS = "(bucket_numel, align_numel, param_align), grad_dtype"


def _first_difference(lists: list[Any]) -> str:
    ref, *others = [{fqn: (shape, dtype) for fqn, shape, dtype in rows} for rows in lists]
    for r, theirs in enumerate(others, start=1):
        if theirs[_SETTINGS] != ref[_SETTINGS]:
            return (f"optimizer settings {_SETTINGS} are {ref[_SETTINGS]} on dp rank 0 but "
                    f"{theirs[_SETTINGS]} on dp rank {r}")
    for r, (other, theirs) in enumerate(zip(lists[1:], others), start=1):
        for fqn, shape, dtype in other:
            if fqn not in ref:
                return f"param {fqn!r} exists on dp rank {r} but not on dp rank 0"
            if (shape, dtype) != ref[fqn]:
                what = "shape" if shape != ref[fqn][0] else "dtype"
                mine, theirs_ = (ref[fqn][0], shape) if what == "shape" else (ref[fqn][1], dtype)
                return (f"param {fqn!r} has {what} {mine} on dp rank 0 but {theirs_} on dp "
                        f"rank {r}")
        for fqn in ref:
            if fqn not in theirs:
                return f"param {fqn!r} exists on dp rank 0 but not on dp rank {r}"
        if [f for f, _, _ in other] != [f for f, _, _ in lists[0]]:
            return f"params are registered in another order on dp rank {r} than on dp rank 0"
    return "the layouts differ"


def check_model(fqns: Mapping[torch.nn.Parameter, str], model: torch.nn.Module,
                named: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
    """Coordinator-free. Raise :class:`UsageError` unless ``model`` is the one built over the
    params of ``fqns`` (param -> FQN): all of them under the same names, and no trainable param
    not owned. ``named``: the model's ``named_parameters()`` if the caller has them."""
    # Keyed by id: a Parameter's own hash is a Python call, paid per param on every save.
    fqn_of = {id(p): fqn for p, fqn in fqns.items()}
    seen = set()
    for fqn, p in model.named_parameters() if named is None else named:
        owned = fqn_of.get(id(p))
        if owned is None and p.requires_grad:
            raise UsageError(f"param {fqn!r} of the model passed in is not one this optimizer "
                             "owns: pass the model it was built over")
        if owned is not None and owned != fqn:
            raise UsageError(f"param {fqn!r} of the model passed in is the optimizer's "
                             f"{owned!r}: pass the model it was built over")
        seen.add(id(p))
    for p, fqn in fqns.items():
        if id(p) not in seen:
            raise UsageError(f"the optimizer's param {fqn!r} is not in the model passed in: "
                             "pass the model it was built over")


# AdamW's options this optimizer lacks, with the one value it implements.
FIXED_GROUP_OPTIONS = {"amsgrad": False, "maximize": False, "decoupled_weight_decay": True}


def check_group_options(param_groups: list[dict[str, Any]],
                        fqn_of: Mapping[torch.nn.Parameter, str]) -> None:
    """Coordinator-free. Raise :class:`UsageError` naming the group and its first param if a
    param group asks for an AdamW option this optimizer lacks, or holds a Muon setting Muon
    cannot take (a scheduler's or a user's write)."""
    for gi, group in enumerate(param_groups):
        if muon.is_muon(group):
            try:
                muon.settings_of(group)
            except ValueError as e:
                raise UsageError(f"param_groups[{gi}] (group of param "
                                 f"{fqn_of[group['params'][0]]!r}): {e}") from None
            continue
        for key, value in FIXED_GROUP_OPTIONS.items():
            if key in group and group[key] != value:
                raise UsageError(
                    f"param_groups[{gi}][{key!r}]={group[key]!r} (group of param "
                    f"{fqn_of[group['params'][0]]!r}): DistributedOptimizer implements "
                    f"AdamW with {key}={value} only")
