"""``opt.shard_state``: the optimizer's one interface to the layers above it.

Its torch views (:mod:`.state_dict`, :mod:`.local_state`), :mod:`shardopt.checkpoint` and
:mod:`shardopt.recipes.integrations` read and change the optimizer's state through it, never through
the optimizer's private members (docs/optimizer.md, "The shard state").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from . import comm, guards, parallel, quant
from .layout import ParamShard
from .moments import Moments
from .shard_state import KINDS, Held, LoadTarget


class ShardStateAccess:
    """``opt.shard_state``: the optimizer's one interface to the layers above it (its torch
    views, :mod:`shardopt.checkpoint`, :mod:`shardopt.recipes.integrations`); docs/optimizer.md, "The
    shard state". Flat state tensors are named ``{name}.{i}`` for layout buffer ``i``; reads
    give them where their values are now (:class:`~shardopt.shard_state.ShardState`). With
    a model-parallel plan (:mod:`.parallel`) ``dp`` is the world, the ranks that save and
    load together, and ``parallel`` says what the plan means for them."""

    def __init__(self, opt: Any, aliases: dict[str, str]) -> None:
        self._opt = opt
        state = opt._state
        self.dp: comm.DPGroup = state.dp if opt._parallel is None else opt._parallel.world
        self.device: torch.device = state.device
        self.shards: tuple[ParamShard, ...] = state.shards
        self.parallel: parallel.Facts = parallel.facts(opt._parallel, state.shards, opt.layout)
        self.shard_of: Mapping[str, ParamShard] = MappingProxyType(state.shard_of)
        self.fqn_of: Mapping[torch.nn.Parameter, str] = MappingProxyType(opt._fqn_of)
        self.aliases: Mapping[str, str] = MappingProxyType(aliases)  # alias FQN -> FQN
        self.group_of: Mapping[str, int] = MappingProxyType(opt._group_of)
        self.moment_kinds: Mapping[str, torch.dtype | str] = MappingProxyType(state.kinds)
        self.moment_names: Mapping[str, tuple[str, ...]] = MappingProxyType(state.moment_names)
        self.held: Mapping[str, Held] = MappingProxyType(state.held)  # the records, by name
        # Kept for the layers above as long as the optimizer lives, never read by it: where
        # checkpoint.load says the state came from, and objects under their module's name.
        self.loaded_from: object | None = None
        self.attachments: dict[str, Any] = {}

    @property
    def has_moments(self) -> bool:
        """Whether the Adam moments exist (made by the first step or a load)."""
        return self._opt._state.has_moments

    @property
    def offloaded(self) -> tuple[str, ...]:
        """The kinds of state now offloaded (empty when none)."""
        return self._opt._host.offloaded

    @property
    def param_writes(self) -> int:
        """How many times the optimizer wrote the params (steps, loads, onloads)."""
        return self._opt._watch.writes

    @property
    def gathers_in_flight(self) -> int:
        """How many param all-gathers ``step()`` left in flight (``overlap_param_gather``)."""
        return len(self._opt._param_sync.handles)

    def sources(self) -> dict[str, torch.Tensor]:
        """The flat tensors a save reads, by name."""
        return self._opt._state.sources()

    def view(self, name: str, shard: ParamShard) -> torch.Tensor:
        """1-D view of ``params``, ``master_param`` or an fp32 moment of ``shard``."""
        return self._opt._state.view(name, shard)

    def moment(self, name: str, shard: ParamShard) -> quant.Moment:
        """Adam moment ``name`` of ``shard`` in its storage form (values, and int8 scales)."""
        return self._opt._state.moment(name, shard)

    def load_target(self, on_host: bool) -> LoadTarget:
        """Where a load reads moments into, and whether they are new."""
        return self._opt._state.load_target(on_host)

    def adopt(self, moments: Moments, param_steps: Mapping[str, int],
              on_host: bool = False) -> None:
        """Collective. Take loaded moments (``on_host``: staged until the first step) and step
        counts; rebuild the params from the main params (loaded in place) and all-gather them."""
        self._opt._adopt(moments, param_steps, on_host)

    def finish_param_sync(self) -> None:
        """:meth:`shardopt.DistributedOptimizer.finish_param_sync`."""
        self._opt.finish_param_sync()

    def reseed_written(self) -> None:
        """Re-seed the main params of weights written in place since the optimizer last wrote
        them, as ``step()`` does first."""
        self._opt._reseed_written()

    def check_model(self, model: torch.nn.Module,
                    named: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """Raise a ``ValueError`` naming a param unless ``model`` is the one built over."""
        guards.check_model(self._opt._fqn_of, model, named)

    def check_onloaded(self, what: str, kinds: Iterable[str] = KINDS) -> None:
        """Raise :class:`~shardopt.errors.OffloadError` naming ``what`` if ``kinds`` are out."""
        self._opt._host.check_onloaded(what, kinds)
