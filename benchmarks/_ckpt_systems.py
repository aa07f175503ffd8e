"""The checkpoint systems of ``checkpoint_io.py``: one class per way users save and load.

Each class has ``save(root)``, ``load(root)`` (in place: into the optimizer that saved, as a
retry or rollback does) and ``tensors()`` (what must come back bit for bit). Systems that can
resume also have ``prepare_resume()`` and ``resume(root)``: the first frees the optimizer's
moments outside the timed region (so the device never holds two copies); the second is timed
and does what a restarted process does, building a new optimizer and loading into it.

Every system writes with the same number of threads per rank, ``threads``: shardopt's
``io_threads`` and DCP's ``FileSystemWriter(thread_count=...)``. DCP's ``FileSystemReader``
has no thread setting (it reads on the calling thread); ``torch.save`` / ``torch.load`` have
none either.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import _peers


# ----------------------------------------------------------------------------- shardopt
def shardopt_states(opt: Any) -> dict[str, torch.Tensor]:
    from shardopt.optimizer import STATE_NAMES

    out = {}
    for shard in opt.shard_state.shards:
        for n in STATE_NAMES:
            try:
                out[f"{shard.fqn}.{n}"] = opt.shard_state.view(n, shard)
            except RuntimeError:  # moments not allocated before the first step or load
                pass
    return out


def drop_moments(opt: Any) -> None:
    """Free a DistributedOptimizer's Adam moments (it has no public call for that)."""
    state = getattr(opt, "_state", None)  # the records of the shard state (shard_state.py)
    if state is not None:
        for name in [n for n, h in state.held.items() if h.kind == "moments"]:
            held = state.held.pop(name)
            if held.pin is not None:  # moments a low_memory_resume load staged
                held.pin.release()
        state.generation += 1
    if any(not n.endswith(".master_param") for n in shardopt_states(opt)):
        raise RuntimeError("the old optimizer still holds moments; shardopt's internals changed")
    gc.collect()


def new_shardopt_optimizer(s: _peers.System) -> Any:
    """A new optimizer over the same model, config and param groups, without moments (as
    after a process restart); it replaces ``s.optimizer``, whose grad hooks are removed."""
    from shardopt import DistributedOptimizer
    from shardopt.config import GROUP_KEYS

    old = s.optimizer
    access = old.shard_state
    group = {fqn: dict(old.param_groups[gi]) for fqn, gi in access.group_of.items()}
    config, dp_group = old.config, access.dp.group
    # First: a param belongs to one optimizer at a time, and the old one lets go of the
    # model's params (its hooks) only once it is collected.
    s.optimizer = old = access = None
    gc.collect()
    new = DistributedOptimizer(
        s.model, config, process_group=dp_group,
        param_group_fn=lambda fqn, p: {k: group[fqn][k] for k in GROUP_KEYS})
    s.optimizer = new
    return new


class ShardoptCkpt:
    """``checkpoint.save`` / ``checkpoint.load``; a resume builds a new ``DistributedOptimizer``
    and loads into it (its moments are read into new tensors in one verifying pass)."""

    def __init__(self, s: _peers.System, rank: int, device: torch.device, threads: int) -> None:
        self.s, self.threads = s, threads
        self.path: str | None = None

    def save(self, root: Path) -> None:
        from shardopt import checkpoint

        self.path = checkpoint.save(root, self.s.model, self.s.optimizer, step=1,
                                    config=checkpoint.CheckpointConfig(io_threads=self.threads))

    def load(self, root: Path) -> None:
        from shardopt import checkpoint

        checkpoint.load(self.path, self.s.model, self.s.optimizer,
                        config=checkpoint.CheckpointConfig(io_threads=self.threads))

    def prepare_resume(self) -> None:
        drop_moments(self.s.optimizer)

    def resume(self, root: Path) -> None:
        new_shardopt_optimizer(self.s)
        self.load(root)

    def tensors(self) -> list[torch.Tensor]:
        """Params and every allocated state of this rank (a new optimizer has no moments)."""
        return [p.detach() for p in self.s.model.parameters()] + \
            list(shardopt_states(self.s.optimizer).values())


class _ShardoptTensors:
    """shardopt's per-rank state as a plain FQN-keyed dict of live views (what it saves), for
    the generic writers. Their resume builds a new ``DistributedOptimizer``, allocates its
    moments as its first step would, and loads into the live views."""

    def __init__(self, s: _peers.System, rank: int, device: torch.device, threads: int) -> None:
        self.s, self.rank, self.device, self.threads = s, rank, device, threads

    def live(self) -> dict[str, torch.Tensor]:
        opt = self.s.optimizer  # a resume replaces it
        return {**{s.fqn: opt.shard_state.view("params", s) for s in opt.shard_state.shards},
                **shardopt_states(opt)}

    def tensors(self) -> list[torch.Tensor]:
        return list(self.live().values())

    def prepare_resume(self) -> None:
        drop_moments(self.s.optimizer)

    def resume(self, root: Path) -> None:
        opt = new_shardopt_optimizer(self.s)
        target = opt.shard_state.load_target(on_host=False)  # moments as a first step makes
        opt.shard_state.adopt(target.moments, dict(opt.param_steps))
        self.load(root)


class TorchSaveCkpt(_ShardoptTensors):
    """One ``torch.save`` file per rank (+ ``fsync``, as the other writers make their files
    durable); ``torch.load(map_location=<gpu>)`` + ``copy_`` back."""

    def _file(self, root: Path) -> Path:
        return root / f"rank{self.rank:05d}.pt"

    def save(self, root: Path) -> None:
        # Model shards are views into the full param buffer; torch.save would write the whole
        # storage, so they are cloned first (a GPU copy of a few GB: milliseconds).
        params = {s.fqn for s in self.s.optimizer.shard_state.shards}
        state = {k: (v.clone() if k in params else v) for k, v in self.live().items()}
        with open(self._file(root), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, root: Path) -> None:
        loaded = torch.load(self._file(root), map_location=self.device, weights_only=True)
        live = self.live()
        with torch.no_grad():
            for k, v in loaded.items():
                live[k].copy_(v)


class DcpPlainCkpt(_ShardoptTensors):
    """The same tensors as a plain state dict (rank-unique keys) through DCP's
    ``FileSystemWriter(thread_count=threads)`` / ``FileSystemReader``."""

    def _state(self) -> dict[str, torch.Tensor]:
        return {f"rank{self.rank:05d}/{k}": v for k, v in self.live().items()}

    def writer(self, root: Path) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(str(root), thread_count=self.threads)

    def save(self, root: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), storage_writer=self.writer(root))

    def load(self, root: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        dcp.load(self._state(), storage_reader=FileSystemReader(str(root)))


class DcpAsyncCkpt(DcpPlainCkpt):
    """``dcp.async_save`` with the same writer: ``returned_s`` is the time until it returned
    (training could go on), the timed save lasts until the checkpoint is complete. Loads as
    ``dcp_plain``. async_save needs a process group with a CPU backend: a gloo group."""

    def __init__(self, s: _peers.System, rank: int, device: torch.device, threads: int) -> None:
        super().__init__(s, rank, device, threads)
        # collective: every rank builds the checkpointers in the same order
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.returned_s: float | None = None

    def save(self, root: Path) -> None:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        pending = dcp.async_save(self._state(), storage_writer=self.writer(root),
                                 process_group=self.group)
        self.returned_s = time.perf_counter() - t0
        done = getattr(pending, "upload_completion", pending)  # AsyncSaveResponse or Future
        done.result()


class DcpFsdp2Ckpt:
    """An FSDP2 model + AdamW through ``get_state_dict`` and DCP (torchtitan's recipe); a
    resume builds a new AdamW, whose state ``get_state_dict`` initialises, and loads."""

    def __init__(self, s: _peers.System, rank: int, device: torch.device, threads: int) -> None:
        self.s, self.threads = s, threads

    def save(self, root: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.s.model, self.s.optimizer)
        dcp.save({"model": msd, "optim": osd},
                 storage_writer=FileSystemWriter(str(root), thread_count=self.threads))

    def load(self, root: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(self.s.model, self.s.optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=FileSystemReader(str(root)))
        set_state_dict(self.s.model, self.s.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    def prepare_resume(self) -> None:
        self.s.optimizer.state.clear()
        gc.collect()

    def resume(self, root: Path) -> None:
        hp = _peers.Hyper()
        self.s.optimizer = _peers._adamw(_peers.torch_param_groups(self.s.model, hp), hp)
        self.load(root)

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for p in self.s.model.parameters():
            out.append(p.to_local() if hasattr(p, "to_local") else p.detach())
            st = self.s.optimizer.state.get(p, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    t = st[k]
                    out.append(t.to_local() if hasattr(t, "to_local") else t)
        return out


class MegatronCkpt:
    """megatron-core's ``dist_checkpointing`` of the model's sharded state dict and
    ``optimizer.sharded_state_dict`` (``dp_reshardable``, with its fully-parallel save
    wrapper). In place only: no resume is measured for it."""

    METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}

    def __init__(self, s: _peers.System, rank: int, device: torch.device, threads: int) -> None:
        self.ddp, self.opt, self.rank = s.wrapped, s.optimizer, rank

    def _sharded(self, is_loading: bool) -> dict:
        model_sd = _peers.megatron_model_sharded_state_dict(self.ddp.module, self.rank)
        return {"model": model_sd,
                "optimizer": self.opt.sharded_state_dict(model_sd, is_loading=is_loading,
                                                         metadata=dict(self.METADATA))}

    def save(self, root: Path) -> None:
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.serialization import (
            get_default_save_sharded_strategy)
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper)

        strategy = FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy(),
            parallel_state.get_data_parallel_group(with_context_parallel=True))
        dist_checkpointing.save(self._sharded(False), str(root), sharded_strategy=strategy)

    def load(self, root: Path) -> None:
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(self._sharded(True), str(root))
        self.ddp.module.load_state_dict(loaded["model"])
        # no_grad: for fp32 params the main param is a view of the model param (a leaf that
        # requires grad), and megatron-core 0.19.2 copies into it in place without no_grad.
        with torch.no_grad():
            self.opt.load_state_dict(loaded["optimizer"])

    def tensors(self) -> list[torch.Tensor]:
        out = [p.detach() for p in self.ddp.module.parameters()]
        for inner in _peers.megatron_inner(self.opt):
            torch_opt = inner.optimizer
            for g in torch_opt.param_groups:
                for p in g["params"]:
                    out.append(p.detach())
                    st = torch_opt.state.get(p, {})
                    out.extend(st[k] for k in ("exp_avg", "exp_avg_sq") if k in st)
        return out


CKPT = {"shardopt": ShardoptCkpt, "torch_save": TorchSaveCkpt, "dcp_plain": DcpPlainCkpt,
        "dcp_async": DcpAsyncCkpt, "dcp_fsdp2": DcpFsdp2Ckpt, "megatron": MegatronCkpt}
