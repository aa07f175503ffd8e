"""``checkpoint.prepare``: the host memory of the first asynchronous save, allocated ahead.

Not collective. What it holds and when it is freed: docs/async_save.md, First save.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ..layout import ParamShard, Range
from ..optimizer import DistributedOptimizer
from . import background, state
from .config import CheckpointConfig, settings
from .snapshot import Extent, buffer_sizes
from ..errors import CheckpointError


def prepare(model: torch.nn.Module, optimizer: DistributedOptimizer,
            config: CheckpointConfig | None = None) -> None:
    """Not collective: each rank prepares its own. Allocate now the host snapshot the
    optimizer's next asynchronous save with ``config`` copies into, sized for the state as
    after the first step (also before it) and page-locked on a GPU, so that save locks
    nothing. Waits for a save in flight first; again, with nothing changed, it allocates
    nothing. After the first step it also plans the copies, which that save then
    repeats. Out of host memory: :class:`CheckpointError` naming the rank and the bytes,
    and no snapshot memory held."""
    settings(config)
    st = optimizer.shard_state
    frozen = state.frozen_tensors(model, optimizer, check_model=True)
    background.wait_pending(optimizer)  # its drain and writer use the buffers
    sizes = buffer_sizes(snapshot_extents(optimizer, frozen))
    cuda = st.device.type == "cuda"
    try:  # registered for the optimizer's device (its context), whichever is current
        with torch.cuda.device(st.device) if cuda else nullcontext():
            snap = background.of(optimizer).snapshot
            snap.prepare(sizes)
        if st.has_moments:  # the sources exist: the first save repeats this plan
            snap.plan(state.contents(optimizer, frozen), state.sources(optimizer, frozen))
        return
    except Exception as e:  # noqa: BLE001 - raised below, without the frames that hold memory
        reason = f"{type(e).__name__}: {e}"
    nbytes = sum(n * d.itemsize for d, n in sizes.items())
    raise CheckpointError(
        f"[dp rank {st.dp.rank}] checkpoint.prepare: allocating the host snapshot of "
        f"asynchronous saves, {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of "
        f"{'page-locked ' if cuda else ''}host memory, failed ({reason}); none is held. "
        "Free host memory (or raise the locked-memory limit, ulimit -l), or save blocking")


def snapshot_extents(opt: DistributedOptimizer, frozen: dict[str, torch.Tensor]
                     ) -> list[Extent]:
    """Coordinator-free. Where the sources of what an asynchronous save of this rank
    snapshots lie once the first step has allocated the moments: before it, each moment
    (and its int8 scales) of each layout buffer as storage yet to be allocated."""
    out = [Extent.of(e.source) for job in state.contents(opt, frozen) for e in job.entries
           if e.source is not None]
    if opt.shard_state.has_moments:
        return out
    storages: dict[tuple[str, int, str], int] = {}  # (moment, buffer, part) -> its name

    def piece(name: str, s: ParamShard, part: str, dtype: torch.dtype, r: Range) -> Extent:
        storage = storages.setdefault((name, s.buffer_index, part), -1 - len(storages))
        return Extent(storage, dtype, r.start, r.size)

    for s in opt.shard_state.parallel.saved_shards:
        for name, enc in state.param_encodings(opt, s.fqn).items():
            out.append(piece(name, s, "values", enc.dtype, s.range_local))
            if enc.block:
                out.append(piece(name, s, "scales", torch.float32,
                                 s.range_local.blocks(enc.block)))
    return out
