"""BoxShard: a :class:`~shardopt.flat_shard.FlatShard` of a tensor-parallel param's block.

A DTensor param's state on this rank is a flat range of its local block (a box of the global
tensor). As a state-dict entry it has the param's global shape and hands DCP that range as
the N-D boxes of the global tensor it covers (:func:`shardopt.boxes.flat_boxes`), so
``torch.distributed.checkpoint`` saves and loads it at any DP, TP or EP layout, as it does
DTensors. Its data is ``.local`` (1-D); it pickles as local tensor, offset, block and shape.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from .boxes import Box, flat_boxes
from .flat_shard import FlatShard
from .layout import Range


class BoxShard(FlatShard):
    """Elements ``[offset, offset + local.numel())`` of ``block`` (flattened) of a tensor of
    ``shape``."""

    block: Box

    @staticmethod
    def __new__(cls, local: torch.Tensor, offset: int, block: Box,
                shape: tuple[int, ...]) -> BoxShard:
        r = cls._wrap(local, None, offset, block.numel, local.numel(), local.dtype,
                      local.device, tuple(shape))
        r.block = block
        return r

    @classmethod
    def lazy_box(cls, make: Any, offset: int, block: Box, shape: tuple[int, ...],
                 local_numel: int, dtype: torch.dtype, device: torch.device) -> BoxShard:
        """A BoxShard whose local tensor ``make()`` is called for on first use."""
        r = cls._wrap(None, make, offset, block.numel, local_numel, dtype, device, tuple(shape))
        r.block = block
        return r

    def _boxes(self) -> list[tuple[Box, int]]:
        """Each box this rank holds and where its data starts in ``local``."""
        out, pos = [], 0
        for b in flat_boxes(self.block, Range(self.offset, self.offset + self.local_numel)):
            out.append((b, pos))
            pos += b.numel
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"BoxShard(shape={tuple(self.shape)}, block={self.block.to_json()}, "
                f"offset={self.offset}, local_numel={self.local_numel}, dtype={self.dtype})")

    def _with_local(self, local: torch.Tensor) -> BoxShard:
        return BoxShard(local, self.offset, self.block, tuple(self.shape))

    def __reduce_ex__(self, protocol: int) -> tuple:
        return BoxShard, (self.local, self.offset, self.block, tuple(self.shape))

    def _chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.lengths))
                for b, _ in self._boxes()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for b, pos in self._boxes():
            if index.offset is None or tuple(index.offset) == b.offsets:
                return self.local.narrow(0, pos, b.numel).view(b.lengths)
        raise ValueError(f"{index.fqn!r}: this rank holds no box of it at {tuple(index.offset)}")


torch.serialization.add_safe_globals([BoxShard, Box])


def state_block(st: Any, name: str, fqn: str) -> Box | None:
    """The block a state-dict entry of ``fqn`` counts in: with a model-parallel plan
    (``st.parallel.model_parallel``) the param's local box of its global tensor, else (and for 8-bit
    moments' scales, 1-D over the local tensor) None: a flat FlatShard."""
    if name.endswith(".scale") or not st.parallel.model_parallel:
        return None
    return st.parallel.blocks.get(fqn) or Box.whole(st.parallel.global_shapes[fqn])


def box_value(st: Any, name: str, fqn: str, shard: Any, offset: int, size: int,
              dtype: torch.dtype, block: Box) -> BoxShard:
    """State ``name`` of ``fqn`` on this rank as a BoxShard viewing the live state
    (``st``: the optimizer's ``shard_state``; ``shard`` None: this rank holds none of it)."""
    shape = st.parallel.global_shapes[fqn]
    if shard is None:
        return BoxShard(torch.empty(0, dtype=dtype, device=st.device), 0, block, shape)
    if name == "master_param":
        return BoxShard(st.view(name, shard), offset, block, shape)
    if st.has_moments:
        return BoxShard(st.moment(name, shard).values, offset, block, shape)
    return BoxShard.lazy_box(lambda: torch.zeros(size, dtype=dtype), offset, block, shape, size,
                             dtype, torch.device("cpu"))
