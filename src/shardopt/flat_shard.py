"""FlatShard: one rank's contiguous part of a param's flattened state, as DCP understands it.

A state-dict entry is a 1-D range ``[offset, offset + local.numel())`` of a param's flattened
elements, at any offset. DCP treats a plain tensor as replicated and DTensor describes only
even chunks, so a FlatShard is a storage-less tensor subclass of the param's full 1-D shape
implementing DCP's checkpointable hooks (as DTensor does): a save writes each rank's range
under its offset, a load reads whatever saved chunks overlap it, at any DP size. Its data is
``.local``; it pickles as local tensor, offset and size, registered as a safe global for
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class FlatShard(torch.Tensor):
    """Elements ``[offset, offset + local.numel())`` of a flattened tensor of ``numel`` elements
    (:meth:`lazy`: made on first use, so state that does not exist yet costs nothing)."""

    _local: torch.Tensor | None
    _make: Callable[[], torch.Tensor] | None
    offset: int
    local_numel: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, offset: int, numel: int) -> FlatShard:
        return cls._wrap(local, None, offset, numel, local.numel(), local.dtype, local.device)

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # __new__ did everything
        super().__init__()

    @classmethod
    def lazy(cls, make: Callable[[], torch.Tensor], offset: int, numel: int, local_numel: int,
             dtype: torch.dtype, device: torch.device) -> FlatShard:
        """A FlatShard whose local tensor ``make()`` is called for on first use."""
        return cls._wrap(None, make, offset, numel, local_numel, dtype, device)

    @classmethod
    def _wrap(cls, local: torch.Tensor | None, make: Callable[[], torch.Tensor] | None,
              offset: int, numel: int, local_numel: int, dtype: torch.dtype,
              device: torch.device) -> FlatShard:
        if not 0 <= offset <= offset + local_numel <= numel:
            raise ValueError(f"FlatShard range [{offset}, {offset + local_numel}) is not "
                             f"within [0, {numel})")
        if local is not None and local.dim() != 1:
            raise ValueError(f"a FlatShard's local tensor is 1-D, got shape {tuple(local.shape)}")
        r = torch.Tensor._make_wrapper_subclass(cls, (numel,), dtype=dtype, device=device,
                                                requires_grad=False)
        r._local, r._make, r.offset, r.local_numel = local, make, offset, local_numel
        return r

    @property
    def local(self) -> torch.Tensor:
        """This rank's elements (1-D)."""
        if self._local is None:
            self._local = self._make()
            self._make = None
        return self._local

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if func is torch.ops.aten.new_empty.default:
            # DCP's async-save stager copies a tensor subclass as new_empty on the host,
            # then deep-copies its attributes (our local tensor, offset) onto the result.
            kwargs = kwargs or {}
            return cls._wrap(None, None, 0, math.prod(args[1]), 0,
                             kwargs.get("dtype") or args[0].dtype,
                             torch.device(kwargs.get("device") or args[0].device))
        raise TypeError(f"{func} on a FlatShard: it only carries one rank's part of a sharded "
                        "state; compute with its .local tensor")

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"FlatShard(numel={self.shape[0]}, offset={self.offset}, "
                f"local_numel={self.local_numel}, dtype={self.dtype})")

    def to(self, *args: Any, **kwargs: Any) -> FlatShard:  # type: ignore[override]
        """As ``torch.Tensor.to``: ``self`` when nothing changes (and ``copy`` is not set),
        else a FlatShard of the same range whose local tensor is moved or cast. Frameworks
        that move optimizer state between devices call this on every state tensor."""
        copy = bool(kwargs.pop("copy", False))
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format not in (None, torch.preserve_format, torch.contiguous_format):
            raise ValueError(f"a FlatShard is 1-D; memory_format={memory_format} does not apply")
        local = self.local
        moved = local.to(device=device, dtype=dtype, non_blocking=non_blocking, copy=copy)
        if moved is local:
            return self
        return FlatShard(moved, self.offset, self.shape[0])

    def cpu(self) -> FlatShard:  # type: ignore[override]
        return self.to("cpu")

    def cuda(self, device: Any = None, non_blocking: bool = False) -> FlatShard:  # type: ignore[override]
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device)
                       if isinstance(device, int) else device, non_blocking=non_blocking)

    def __reduce_ex__(self, protocol: int) -> tuple:
        return FlatShard, (self.local, self.offset, self.shape[0])

    def __deepcopy__(self, memo: dict) -> FlatShard:
        return FlatShard(self.local.clone(), self.offset, self.shape[0])

    # --------------------------------------------- torch.distributed.checkpoint hooks
    def _chunks(self) -> list[ChunkStorageMetadata]:
        n = self.local_numel
        return [ChunkStorageMetadata(torch.Size([self.offset]), torch.Size([n]))] if n else []

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=props,
                                                      size=self.shape))
                for chunk in self._chunks()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunks()

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset is not None and tuple(index.offset) != (self.offset,):
            raise ValueError(f"{index.fqn!r}: this rank holds elements from {self.offset}, "
                             f"not from {tuple(index.offset)}")
        return self.local


torch.serialization.add_safe_globals([FlatShard])
