"""Phase 3 of the optimizer's schedule (:mod:`.optimizer`): each rank's updated shard into
the model-dtype param buffers, and the all-gathers that give every rank the full params.

With ``overlap_param_gather`` the all-gathers stay in flight after ``step()``; a forward
pre-hook on each module waits for the buckets of its own params, and a
``model.load_state_dict`` pre-hook for all of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from . import comm
from .buffers import FlatBuffers
from .config import OptimizerConfig
from .layout import Bucket, Layout


class ParamSync:
    """The param all-gathers of one optimizer, and those still in flight."""

    def __init__(self, dp: comm.DPGroup, buffers: FlatBuffers, layout: Layout,
                 main: Sequence[torch.Tensor | None], launch_order: Sequence[Bucket]) -> None:
        self.dp, self.buffers, self.layout, self.main = dp, buffers, layout, main
        self.launch_order = launch_order
        # overlap_param_gather: all-gathers in flight, keyed (buffer index, bucket index); each
        # module's forward waits for the buckets of its own params.
        self.handles: dict[tuple[int, int], object] = {}

    def register_hooks(self, model: torch.nn.Module, config: OptimizerConfig,
                       fqn_of: Mapping[torch.nn.Parameter, str]) -> list[object]:
        """The hooks that wait for gathers in flight (none without ``overlap_param_gather``
        or with one rank), for the caller to keep."""
        if not (config.overlap_param_gather and self.dp.size > 1):
            return []
        hooks = []
        for module in model.modules():
            keys = sorted({(self.layout.slots[fqn_of[p]].buffer_index,
                            self.layout.slots[fqn_of[p]].bucket_index)
                           for p in module.parameters(recurse=False) if p in fqn_of})
            if keys:
                hooks.append(module.register_forward_pre_hook(
                    lambda _m, _args, keys=tuple(keys): self._wait(keys)))
        # model.load_state_dict writes the params: no gather may still be writing them.
        hooks.append(model.register_load_state_dict_pre_hook(lambda *_: self.finish()))
        return hooks

    def _wait(self, keys: tuple[tuple[int, int], ...]) -> None:
        if self.handles:
            for key in keys:
                handle = self.handles.pop(key, None)
                if handle is not None:
                    handle.wait()

    def finish(self) -> None:
        """Wait for every all-gather still in flight."""
        for handle in self.handles.values():
            handle.wait()
        self.handles.clear()

    def publish(self, own_written: bool = False, wait: bool = True) -> None:
        """Collective. Copy main shards into the model-dtype buffer (unless the update wrote
        them: ``own_written``), then all-gather every bucket, in the order forward uses them.
        Without ``wait`` the all-gathers stay in flight (see :meth:`finish`)."""
        self.finish()
        for bucket in reversed(self.launch_order):
            full = self.buffers.bucket_params(bucket)
            main = self.main[bucket.buffer_index]
            if main is not None and not own_written:
                own = full.narrow(0, self.dp.rank * bucket.shard_numel, bucket.shard_numel)
                offset = self.layout.buffers[bucket.buffer_index].local_offset(bucket.index)
                own.copy_(main.narrow(0, offset, bucket.shard_numel))
            handle = comm.all_gather_(full, self.dp, async_op=True)
            if handle is not comm.DONE:
                self.handles[(bucket.buffer_index, bucket.index)] = handle
        if wait:
            self.finish()
