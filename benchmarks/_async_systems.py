"""The savers ``async_save.py`` times: shardopt's asynchronous save (and its drain setting
for a sweep, and the check of each checkpoint against a blocking save), DCP's ``async_save``
and megatron-core's asynchronous ``dist_checkpointing.save``, each behind ``save(step)``,
``before_step()``, ``busy()`` and ``finish()``."""

from __future__ import annotations

import inspect
import shutil
import time
from pathlib import Path
from typing import Any

import torch



class ShardoptSaver:
    """shardopt's asynchronous save, its drain's piece size and pieces in flight set for
    every save (``drain``: ``(bytes, in flight)``, None for the defaults). With
    ``verify``, each save is preceded, outside the timed iteration, by a blocking save of
    the same state, and the asynchronous checkpoint is checked against it byte for byte
    (every data file, the manifest but its creation time and checksum) and with
    ``checkpoint.verify`` before the next save; the results are in :attr:`notes`."""

    snapshot = "host"  # the snapshot kind its saves use (the key of prepare_s)

    @classmethod
    def prepare(cls, model, opt) -> float:
        """``checkpoint.prepare``; its seconds."""
        from shardopt import checkpoint
        t0 = time.perf_counter()
        checkpoint.prepare(model, opt)
        return time.perf_counter() - t0

    def __init__(self, model, opt, root: Path, drain: tuple[int, int] | None = None,
                 verify: bool = False) -> None:
        from shardopt import checkpoint
        defaults = checkpoint.CheckpointConfig()
        self.ckpt, self.model, self.opt, self.root = checkpoint, model, opt, root
        self.drain = drain or (defaults.drain_piece_bytes, defaults.drain_in_flight)
        self.config = checkpoint.CheckpointConfig(drain_piece_bytes=self.drain[0],
                                                  drain_in_flight=self.drain[1])
        self.verify = verify
        self.handle = self.reference = None
        self.notes: dict[str, Any] = {"drain": {"piece_bytes": self.drain[0],
                                                "in_flight": self.drain[1]}}
        if verify:
            self.notes["verified"] = []

    def before_save(self, step: int) -> None:
        if not self.verify:
            return
        self._check()
        self.reference = self.ckpt.save(self.root / "blocking", self.model, self.opt,
                                        step=step, keep_last=1)

    def save(self, step: int) -> None:
        self.handle = self.ckpt.save(self.root / "async", self.model, self.opt, step=step,
                                     keep_last=1, blocking=False, config=self.config)

    def before_step(self) -> None:  # step() itself waits for the snapshot copies
        pass

    def busy(self) -> bool:
        return self.handle is not None and not self.handle.done()

    def _check(self) -> None:
        """The last asynchronous checkpoint against its blocking twin (once written)."""
        if self.reference is None:
            return
        path = Path(self.handle.wait())
        self.ckpt.verify(str(path))
        self.notes["verified"].append({"path": path.name,
                                       "equal": _same_checkpoint(path, Path(self.reference))})
        self.reference = None

    def finish(self) -> None:
        if self.handle is not None:
            self.handle.wait()
        if self.verify:
            self._check()
            self.notes["all_equal"] = all(v["equal"] for v in self.notes["verified"])


def _same_checkpoint(a: Path, b: Path) -> bool:
    """Whether two committed checkpoints hold the same files, byte for byte, and the same
    manifest but its creation time and checksum."""
    import filecmp
    import json
    names = sorted(f.name for f in a.iterdir())
    if names != sorted(f.name for f in b.iterdir()):
        return False
    for name in names:
        if name == "manifest.json":
            ma, mb = (json.loads((p / name).read_text()) for p in (a, b))
            for m in (ma, mb):
                m.pop("created"), m.pop("checksum")
            if ma != mb:
                return False
        elif not filecmp.cmp(a / name, b / name, shallow=False):
            return False
    return True


class DcpSaver:
    def __init__(self, model, opt, root: Path) -> None:
        import torch.distributed.checkpoint as dcp
        self.dcp, self.model, self.opt, self.root = dcp, model, opt, root
        self.stager, self.notes = None, {"staging": "default (none)"}
        self.staging = self.upload = None
        self.kept: list[Path] = []

    def _new_stager(self):
        """A DefaultStager for one save. On the GPU host (torch 2.11) a DefaultStager staged
        a first state dict and raised KeyError(<class 'type'>) on the second, in each of
        three StagingOptions tried: its close() after every stage empties its copy dispatch
        table (a torch bug; 2.13 stages twice on CPU). A fresh one per save avoids that, and
        loses no reuse: that close() also drops its pinned copies."""
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:
            return None
        gpu = torch.cuda.is_available()  # pinned and non-blocking copies need one
        self.notes = {"staging": f"DefaultStager(pinned={gpu}, async, non-blocking={gpu}), "
                                 "one per save"}
        return DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                            use_async_staging=True, use_non_blocking_copy=gpu))

    def save(self, step: int) -> None:
        self.finish()  # one save in flight, as shardopt
        self.close()
        self.stager = self._new_stager()
        path = self.root / f"step_{step:08d}"
        kw = {"async_stager": self.stager} if self.stager is not None else {}
        state = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        out = self.dcp.async_save(state, checkpoint_id=str(path), **kw)
        if hasattr(out, "upload_completion"):
            self.staging, self.upload = out.staging_completion, out.upload_completion
        else:
            self.staging, self.upload = None, out
        self.kept.append(path)

    def before_step(self) -> None:  # the step writes what the stager may still be reading
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def busy(self) -> bool:
        return self.upload is not None and not self.upload.done()

    def close(self) -> None:  # its pinned staging memory
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def finish(self) -> None:
        self.before_step()
        if self.upload is not None:
            self.upload.result()
            self.upload = None
        while len(self.kept) > 1:  # keep_last=1, as shardopt
            shutil.rmtree(self.kept.pop(0), ignore_errors=True)


class MegatronAsyncSaver:
    """megatron-core's asynchronous ``dist_checkpointing.save`` (``async_sharded_save=True``,
    its default torch_dist strategy in the fully-parallel wrapper, as ``_ckpt_systems``
    saves synchronously) of its own DDP model and distributed optimizer, trained in its own
    loop: the request is scheduled on an ``AsyncCallsQueue`` and finished saves are finalized
    before each step without blocking, as megatron's training loop does."""

    def __init__(self, system, root: Path, device: torch.device) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        import _ckpt_systems
        self.ckpt = _ckpt_systems.MegatronCkpt(system, 0, device, 1)
        self.queue, self.root, self.kept = AsyncCallsQueue(), root, []
        self.notes = {"strategy": "torch_dist, fully parallel, async_sharded_save, "
                                  "async_strategy mcore where the release has the option"}

    def save(self, step: int) -> None:
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.serialization import (
            get_default_save_sharded_strategy)
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper)
        self.finish()  # one save in flight, as shardopt
        path = self.root / f"step_{step:08d}"
        path.mkdir()
        strategy = FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy(),
            parallel_state.get_data_parallel_group(with_context_parallel=True))
        # megatron-core 0.19 defaults to async_strategy="nvrx" (nvidia-resiliency-ext, not
        # installed here); "mcore" is its own implementation, the one older releases use.
        extra = ({"async_strategy": "mcore"} if "async_strategy" in
                 inspect.signature(dist_checkpointing.save).parameters else {})
        request = dist_checkpointing.save(self.ckpt._sharded(False), str(path),
                                          sharded_strategy=strategy, async_sharded_save=True,
                                          **extra)
        self.queue.schedule_async_request(request)
        self.kept.append(path)

    def before_step(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=False)

    def busy(self) -> bool:
        return self.queue.get_num_unfinalized_calls() > 0

    def finish(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True)
        while len(self.kept) > 1:  # keep_last=1, as shardopt
            shutil.rmtree(self.kept.pop(0), ignore_errors=True)

    def close(self) -> None:
        self.queue.close()


SAVERS = {"shardopt": ShardoptSaver, "dcp": DcpSaver, "megatron": MegatronAsyncSaver}
# Run at --nproc 1 only: megatron's trainer here is built as rank 0 of 1.
DP1_ONLY = ("dcp", "megatron")


def _drain_setting(text: str) -> tuple[int, int]:
    """``"4m:1"`` -> (4 MiB, 1): a drain's piece size (``k``/``m`` suffix) and pieces in flight."""
    size, _, flight = text.partition(":")
    scale = {"k": 1 << 10, "m": 1 << 20}.get(size[-1:].lower(), 1)
    return int(float(size.rstrip("kKmM")) * scale), int(flight or 1)


def _saver(system: str, trainer: Any, root: Path, verify: bool) -> Any:
    """The saver of ``system``: a name of :data:`SAVERS`, a shardopt one with ``@PIECE:FLIGHT``
    for its drain's setting (``shardopt@2m:1``)."""
    name, _, drain = system.partition("@")
    if name.startswith("shardopt"):
        return SAVERS[name](trainer.model, trainer.opt, root,
                            _drain_setting(drain) if drain else None, verify)
    return SAVERS[name](trainer.model, trainer.opt, root)
