"""shardopt's per-rank 1-D chunks through ``torch.distributed.checkpoint``'s planner interface.

DCP's default planner writes whole tensors, or shards of a DTensor / ShardedTensor. shardopt's
state is neither: each rank holds a contiguous run ``[offset, offset + numel)`` of each
flattened tensor, at offsets that follow the bucket layout, not any tensor dimension.
:class:`ChunkSavePlanner` turns those runs (``shardopt.checkpoint.state``'s ``WriteEntry`` records, what a shardopt save
writes) into ``SHARD`` write items of 1-D tensors with their global size, so DCP's metadata and
a Hugging Face writer's ``DCP_SHARDING_INFO`` (``saved_offsets``) describe them exactly as
shardopt's own files do.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)


def rank_entries(model: torch.nn.Module, opt) -> list:
    """This rank's chunks as a shardopt save writes them: model weights, then the three
    optimizer states (``WriteEntry`` records; empty chunks left out)."""
    from shardopt.checkpoint.state import frozen_tensors, model_entries, optim_entries
    from shardopt.optimizer import STATE_NAMES

    entries = model_entries(opt, frozen_tensors(model, opt))
    for name in STATE_NAMES:
        entries += optim_entries(opt, name)
    missing = [e.key for e in entries if e.numel and e.source is None]
    if missing:
        raise ValueError(f"no data for {missing[:3]}: take a step before saving")
    return [e for e in entries if e.numel]


def global_numels(model: torch.nn.Module, opt) -> dict[str, int]:
    """Every stored key's element count in model space (the size of the full tensor)."""
    from shardopt.checkpoint.state import ParamFacts, describe, frozen_tensors
    from shardopt.optimizer import STATE_NAMES

    out: dict[str, int] = {}
    facts = ParamFacts.capture(opt, frozen_tensors(model, opt))
    for fqn, info in describe(opt, facts).items():
        out[fqn] = math.prod(info["shape"])
        if info["trainable"]:
            out.update({f"{fqn}.{name}": out[fqn] for name in STATE_NAMES})
    return out


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes ``entries`` (1-D chunks of tensors of ``numels`` elements) and nothing else;
    the state dict handed to ``dcp.save`` is ignored (pass ``{}``)."""

    def __init__(self, entries: Sequence, numels: dict[str, int]) -> None:
        super().__init__()
        self._items: list[WriteItem] = []
        self._data: dict[MetadataIndex, torch.Tensor] = {}
        for e in entries:
            offsets = torch.Size([e.offset])
            index = MetadataIndex(e.key, offsets)
            self._items.append(WriteItem(
                index=index, type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([e.numel])),
                    properties=TensorProperties(dtype=e.dtype),
                    size=torch.Size([numels[e.key]]))))
            self._data[index] = e.source.detach().reshape(-1)

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(list(self._items), planner_data={})
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        # MetadataIndex compares by (fqn, offset): the index hint DCP rewrites does not matter
        return self._data[write_item.index]


def balanced_files(numels: dict[str, int], itemsize: dict[str, int],
                   num_files: int) -> dict[str, int]:
    """``fqn_to_index_mapping`` for a Hugging Face writer: every key to one of files
    ``1..num_files`` of about equal bytes (largest first, each to the lightest file), the
    same on every rank, so that a rank's writer threads each get a file."""
    heap = [(0, i) for i in range(1, num_files + 1)]
    out = {}
    for key in sorted(numels, key=lambda k: (-numels[k] * itemsize[k], k)):
        load, i = heapq.heappop(heap)
        out[key] = i
        heapq.heappush(heap, (load + numels[key] * itemsize[key], i))
    return out
