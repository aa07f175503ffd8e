"""What the training and checkpoint benchmarks share: ranks in fresh processes, the model, the systems.

* :func:`spawn` runs ``fn(rank, world_size, *args)`` on ``nproc`` new processes (``spawn`` start
  method: nothing inherited from the parent, so every system starts from a clean CUDA context and
  allocator), joined by a TCP rendezvous on a free local port, NCCL on GPUs and gloo on CPU. A rank
  that raises writes its traceback; the parent returns per-rank results or raises :class:`RankFailed`
  with the earliest traceback, and kills ranks still running after a failure or past the timeout.
* :func:`build_gpt`: ``shardopt.recipes.model.build_model`` on the device (same weights for every
  system); ``_common.build_model`` picks it or the Hugging Face Llama by name.
* ``setup_*``: one function per system, each returning a :class:`System` whose ``step(x, y)`` runs one
  forward/backward/clip/optimizer step and returns the loss. Every system uses the same
  hyperparameters (:class:`Hyper`) and clips the global grad norm at 1.0.

Precision of each system (what it keeps per parameter besides activations):

* shardopt: bf16 params, fp32 grad buffer, fp32 main params + Adam moments sharded over ranks.
* ddp / zero: the bf16 model as built, bf16 grads, ``torch.optim.AdamW(fused=True)`` directly on the
  bf16 params (no fp32 main copy: less memory traffic than the others; ZeRO shards the moments).
* fsdp2: fp32 sharded params (main copy), ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``. ``fully_shard`` needs one original dtype per group, so every fp32 module
  of the GPT (LayerNorms, MoE routers) is its own group with an fp32 policy, then each block, then
  the root; the Hugging Face Llama (bf16 throughout) is each decoder layer, then the root.
* megatron: megatron-core's DDP (fp32 grad buffer, overlapped reduce-scatter) and distributed
  optimizer (fp32 main params + moments sharded; torch AdamW without Transformer Engine).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SYSTEMS = ("shardopt", "shardopt_overlap", "ddp", "fsdp2", "zero", "megatron")


class RankFailed(RuntimeError):
    """A rank raised, crashed or timed out; the message is the first root cause."""


# ----------------------------------------------------------------------------- processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_rank_group(kind: str) -> torch.device:
    """This process as the only rank of a process group (gloo, and NCCL for CUDA tensors on
    ``kind == "cuda"``, whose first GPU becomes current); returns the device."""
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    return device


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, backend: str,
           run_dir: str, timeout_s: float, args: tuple) -> None:
    run = Path(run_dir)
    os.setsid()  # own process group: the parent can end helpers this rank starts (writer workers)
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # as torchrun sets them
    try:
        kw: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kw["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s),
                                **kw)
        result = fn(rank, world, *args)
        (run / f"result_{rank}.json").write_text(json.dumps(result, default=str))
    except BaseException:  # noqa: BLE001 - reported to the parent, then exit non-zero
        (run / f"error_{rank}.txt").write_text(f"{time.monotonic_ns()}\n{traceback.format_exc()}")
        sys.stderr.write(f"[rank {rank}] {traceback.format_exc()}\n")
        sys.stderr.flush()
        os._exit(1)  # do not wait for peers stuck in a collective
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown only
        pass


def spawn(fn: Callable[..., Any], nproc: int, *args: Any, device: str, timeout_s: float,
          grace_s: float = 10.0) -> list[dict]:
    """Run ``fn(rank, nproc, *args)`` (module-level, JSON-returning) on fresh processes."""
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda" and torch.cuda.device_count() < nproc:
        raise RankFailed(f"{nproc} ranks need {nproc} GPUs, found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="shardopt-bench-") as run_dir:
        port = _free_port()
        procs = [ctx.Process(target=_entry, name=f"rank{r}", daemon=False,
                             args=(fn, r, nproc, port, backend, run_dir, timeout_s, args))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        failed_at = None
        while True:
            alive = [p for p in procs if p.exitcode is None]
            if not alive:
                break
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            limit = deadline if failed_at is None else min(deadline, failed_at + grace_s)
            if time.monotonic() >= limit:
                break
            wait([p.sentinel for p in alive], timeout=0.5)
        timed_out = [p for p in procs if p.exitcode is None]
        for p in timed_out:
            p.kill()  # only the processes started here, by their handles
        for p in procs:
            p.join(10)
        for p in procs:  # helpers left behind by a rank (e.g. checkpoint writer processes)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        run = Path(run_dir)
        errors = []
        for r in range(nproc):
            err = run / f"error_{r}.txt"
            if err.exists():
                stamp, _, text = err.read_text().partition("\n")
                errors.append((int(stamp), f"rank {r}: {text.strip()}"))
            elif procs[r].exitcode not in (0, None) and procs[r] not in timed_out:
                errors.append((0, f"rank {r} died with exit code {procs[r].exitcode}"))
        if errors:
            raise RankFailed(sorted(errors)[0][1])
        if timed_out:
            raise RankFailed(f"ranks {[procs.index(p) for p in timed_out]} still running after "
                             f"{timeout_s:.0f} s; killed")
        return [json.loads((run / f"result_{r}.json").read_text()) for r in range(nproc)]


def rank_device(rank: int, device: str) -> torch.device:
    return torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Collective. Seconds of ``fn`` on every rank, between barriers and device syncs."""
    barrier()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    barrier()
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- model and data
@dataclass(frozen=True)
class Hyper:
    """Hyperparameters shared by every system."""

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0


def build_gpt(preset: str, device: torch.device, seed: int = 0, **overrides: Any):
    """``shardopt.recipes.model.build_model`` on ``device`` (drawn there: same weights for every system)."""
    from shardopt.recipes.model import build_model, model_config

    return build_model(model_config(preset, **overrides), seed=seed, device=device)


def make_batches(preset: str, rank: int, world: int, micro_batch: int, num: int,
                 device: torch.device, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num`` micro-batches of this rank (shardopt's synthetic Markov task), already on device."""
    from shardopt.recipes.model import model_config

    cfg = model_config(preset)
    return markov_batches(cfg.vocab_size, cfg.seq_len, rank, world, micro_batch, num, device,
                          seed)


def markov_batches(vocab_size: int, seq_len: int, rank: int, world: int, micro_batch: int,
                   num: int, device: torch.device, seed: int = 1
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num`` micro-batches ``(inputs, next tokens)`` of this rank of the Markov task over
    ``vocab_size`` tokens, sequences of ``seq_len``, already on device."""
    from shardopt.recipes.data import BatchPlan, MarkovTask, local_batches

    task = MarkovTask(vocab_size=vocab_size, seq_len=seq_len, seed=seed)
    plan = BatchPlan(global_batch_size=micro_batch * world, dp_size=world, dp_rank=rank,
                     micro_batch_size=micro_batch)
    out = []
    for i in range(num):
        (x, y), = local_batches(task, plan, i * micro_batch * world)
        out.append((x.to(device), y.to(device)))
    return out


def torch_param_groups(model: torch.nn.Module, hp: Hyper) -> list[dict]:
    """Matrices decay, vectors do not (as ``shardopt.recipes.model.no_decay``)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": hp.weight_decay},
            {"params": other, "weight_decay": 0.0}]


# ----------------------------------------------------------------------------- systems
@dataclass
class System:
    name: str
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    model: torch.nn.Module
    optimizer: Any
    wrapped: Any = None
    notes: dict[str, Any] = field(default_factory=dict)


def setup_shardopt(model, hp: Hyper, device: torch.device,
                   overlap_param_gather: bool = False, grad_mode: str = "torch",
                   optimizer: str = "adamw", **state_dtypes: str) -> System:
    """``state_dtypes``: ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` / ``grad_dtype`` of
    :class:`shardopt.OptimizerConfig` (default fp32); ``grad_mode`` its field of that name
    (``"torch"``: p.grad after backward; ``"buffer"``: grads only in the grad buffer);
    ``optimizer="muon"``: Muon for the matrices (``shardopt.muon_groups``, with
    ``adjust_lr_fn="match_rms_adamw"`` and AdamW's learning rate and weight decay)."""
    import shardopt
    from shardopt.build import choose_kernel
    from shardopt.recipes.model import no_decay

    config = shardopt.OptimizerConfig(lr=hp.lr, betas=hp.betas, eps=hp.eps,
                                      weight_decay=hp.weight_decay, max_grad_norm=hp.max_grad_norm,
                                      overlap_param_gather=overlap_param_gather,
                                      grad_mode=grad_mode, **state_dtypes)
    group_fn = no_decay
    if optimizer == "muon":
        to_muon = shardopt.muon_groups(model, lr=hp.lr, weight_decay=hp.weight_decay,
                                       adjust_lr_fn="match_rms_adamw")

        def group_fn(fqn, p):
            return to_muon(fqn, p) or no_decay(fqn, p)
    elif optimizer != "adamw":
        raise ValueError(f"optimizer must be adamw or muon, got {optimizer!r}")
    opt = shardopt.DistributedOptimizer(model, config, param_group_fn=group_fn)

    def step(x, y):  # the system's optimizer: a resume replaces it (_ckpt_systems.py)
        loss = model(x, y)
        loss.backward()
        system.optimizer.step()
        system.optimizer.zero_grad()
        return loss.detach()

    name = "shardopt_overlap" if overlap_param_gather else "shardopt"
    name += "_muon" if optimizer == "muon" else ""
    system = System(name if grad_mode == "torch" else f"{name}_{grad_mode}", step, model, opt,
                    notes={"bucket_numel": config.bucket_numel, "state_dtypes": state_dtypes,
                           "step_kernel": choose_kernel(config, device),
                           "grad_mode": grad_mode, "optimizer": optimizer,
                           "overlap_param_gather": overlap_param_gather})
    return system


def _adamw(params, hp: Hyper, **kw):
    return torch.optim.AdamW(params, lr=hp.lr, betas=hp.betas, eps=hp.eps, fused=True, **kw)


def _ddp(model, device: torch.device):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               gradient_as_bucket_view=True)


def _torch_step(forward, model, opt, hp: Hyper):
    def step(x, y):
        loss = forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hp.max_grad_norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def setup_ddp(model, hp: Hyper, device: torch.device) -> System:
    ddp = _ddp(model, device)
    opt = _adamw(torch_param_groups(model, hp), hp)
    return System("ddp", _torch_step(ddp, model, opt, hp), model, opt, ddp,
                  notes={"precision": "bf16 params and grads, AdamW(fused) on bf16 params"})


class _Optimizers:
    """Several optimizers stepped as one (ZeroRedundancyOptimizer takes a single dtype)."""

    def __init__(self, optimizers: list) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def setup_zero(model, hp: Hyper, device: torch.device) -> System:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = _ddp(model, device)
    # ZeroRedundancyOptimizer refuses params of mixed dtypes: one instance per dtype.
    optimizers = []
    for dtype in sorted({p.dtype for p in model.parameters()}, key=str):
        groups = [{**g, "params": [p for p in g["params"] if p.dtype == dtype]}
                  for g in torch_param_groups(model, hp)]
        groups = [g for g in groups if g["params"]]
        optimizers.append(ZeroRedundancyOptimizer(
            groups, optimizer_class=torch.optim.AdamW, lr=hp.lr, betas=hp.betas, eps=hp.eps,
            fused=True))
    opt = _Optimizers(optimizers)
    return System("zero", _torch_step(ddp, model, opt, hp), model, opt, ddp,
                  notes={"precision": "bf16 params and grads, AdamW(fused) on bf16 params; "
                                      "moments sharded",
                         "instances": "one ZeroRedundancyOptimizer per param dtype (it refuses "
                                      "mixed dtypes)"})


def fsdp2_shard(model, **shard_kwargs) -> None:
    """``fully_shard`` the benchmark model in place: fp32 main params, bf16 compute, fp32 grad
    reduction. The GPT's norms and routers are fp32 groups of their own; the Hugging Face Llama
    (all bf16) is a group per decoder layer, then the root. ``shard_kwargs`` (``mesh``,
    ``reshard_after_forward``) go to every ``fully_shard`` call."""
    from _common import HFLlama
    from shardopt.recipes.model import Norm
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.to(torch.float32)  # the sharded params are the fp32 main copy
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if isinstance(model, HFLlama):
        for layer in model.lm.model.layers:
            fully_shard(layer, mp_policy=bf16, **shard_kwargs)
        fully_shard(model, mp_policy=bf16, **shard_kwargs)
        return
    # The fp32 groups must not cast their inputs: a Norm returns its input's dtype (bf16).
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                cast_forward_inputs=False)
    for block in model.blocks:
        fp32_modules = [m for m in block.modules() if isinstance(m, Norm)]
        router = getattr(block.mlp, "router", None)
        if isinstance(router, torch.nn.Linear):
            fp32_modules.append(router)
        for m in fp32_modules:
            fully_shard(m, mp_policy=fp32, **shard_kwargs)
        fully_shard(block, mp_policy=bf16, **shard_kwargs)
    fully_shard(model.norm, mp_policy=fp32, **shard_kwargs)
    fully_shard(model, mp_policy=bf16, **shard_kwargs)


def setup_fsdp2(model, hp: Hyper, device: torch.device) -> System:
    fsdp2_shard(model, reshard_after_forward=False)
    opt = _adamw(torch_param_groups(model, hp), hp)
    return System("fsdp2", _torch_step(model, model, opt, hp), model, opt,
                  notes={"precision": "fp32 sharded params, bf16 compute, fp32 reduce; the GPT's "
                                      "norms and routers are their own fully_shard groups (fp32)",
                         "reshard_after_forward": False})


# ----------------------------------------------------------------------------- megatron-core
_TRITON_STUBS = ("megatron.core.transformer.moe.ops.paged_stash",)


def import_megatron() -> dict[str, Any]:
    """Import megatron-core; without triton, stub the one triton-kernel module its import needs.

    megatron.core.pipeline_parallel imports MoE "paged stash" triton kernels at module level; nothing
    here runs them. Returns what was done, for the result file.
    """
    info: dict[str, Any] = {"triton": importlib.util.find_spec("triton") is not None}
    if not info["triton"]:
        class _Any:
            def __call__(self, *a, **k):
                return _Any()

            def __getattr__(self, name):
                return _Any()

        class _Stub(types.ModuleType):
            def __getattr__(self, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return _Any()

        for name in _TRITON_STUBS:
            sys.modules.setdefault(name, _Stub(name))
        info["stubbed"] = list(_TRITON_STUBS)
    import megatron.core  # noqa: F401
    from megatron.core import package_info

    info["version"] = package_info.__version__
    return info


def megatron_model_sharded_state_dict(module: torch.nn.Module, dp_rank: int) -> dict:
    """Model weights as megatron ShardedTensors: full tensors, replicated over DP (rank 0 owns)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    return {name: ShardedTensor.from_rank_offsets(name, t, replica_id=(0, 0, dp_rank))
            for name, t in module.state_dict(keep_vars=True).items()}


def _megatron_overrides(opt_config) -> dict:
    """megatron-core's standard overrides plus one that puts fp32 params in their own groups.

    megatron-core 0.19.2 maps a model param to its optimizer state by its position in the param
    group (``model_param_group_index_map``), counted over the group's params in buffer order, while
    the inner optimizer's group lists fp32 params first and then the main copies of bf16 params. In a
    group holding both dtypes (here: the decayed group has the bf16 matrices and the fp32 MoE router
    weights) positions disagree, and ``sharded_state_dict`` attaches one param's state to another
    (``dp_reshardable`` save fails an assertion on the shapes). One dtype per group keeps positions
    consistent. The override changes only ``min_lr``, which nothing reads without megatron's LR
    scheduler, and makes the groups' identifiers distinct for ``load_state_dict``.
    """
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate

    overrides = dict(get_standard_config_overrides(opt_config))
    fp32 = ParamKey(predicate=ParamPredicate(name="fp32_param",
                                             fn=lambda p: p.dtype == torch.float32))
    overrides[fp32] = {"min_lr": 0.0}
    return overrides


def setup_megatron(model, hp: Hyper, device: torch.device, overlap_param_gather: bool = False,
                   split_dtype_groups: bool = True) -> System:
    if device.type == "cpu":
        import _cpu_shim  # smoke runs only: megatron-core allocates on CUDA unconditionally

        _cpu_shim.install()
    info = import_megatron()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    cfg = model.config
    tconfig = TransformerConfig(num_layers=cfg.num_layers, hidden_size=cfg.d_model,
                                num_attention_heads=cfg.num_heads, ffn_hidden_size=cfg.d_ff,
                                bf16=True, params_dtype=torch.bfloat16)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True,
        overlap_param_gather=overlap_param_gather, use_distributed_optimizer=True)
    ddp = DistributedDataParallel(tconfig, ddp_config, model)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=hp.lr, min_lr=hp.lr, weight_decay=hp.weight_decay,
        adam_beta1=hp.betas[0], adam_beta2=hp.betas[1], adam_eps=hp.eps,
        bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True,
        overlap_param_gather=overlap_param_gather, clip_grad=hp.max_grad_norm)
    overrides = _megatron_overrides(opt_config) if split_dtype_groups else None
    opt = get_megatron_optimizer(opt_config, [ddp], config_overrides=overrides)
    for inner in megatron_inner(opt):  # what megatron's LR/WD scheduler would set: no decay on vectors
        for g in inner.optimizer.param_groups:
            g["weight_decay"] = hp.weight_decay * g.get("wd_mult", 1.0)

    def step(x, y):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(x, y)
        loss.backward()
        ddp.finish_grad_sync()
        ok, _, _ = opt.step()
        if not ok:
            raise RuntimeError("megatron optimizer step reported failure (skipped update)")
        return loss.detach()

    info.update({"grad_reduce_in_fp32": True, "overlap_grad_reduce": True,
                 "overlap_param_gather": overlap_param_gather,
                 "bucket_size": ddp_config.bucket_size,
                 "param_groups_split_by_dtype": split_dtype_groups,
                 "inner_optimizer": [type(o.optimizer).__name__ for o in megatron_inner(opt)]})
    return System("megatron", step, model, opt, ddp, notes=info)


def megatron_inner(opt) -> list:
    """The DistributedOptimizer(s) inside what ``get_megatron_optimizer`` returned."""
    return list(getattr(opt, "chained_optimizers", [opt]))


SETUP: dict[str, Callable[..., System]] = {
    "shardopt": setup_shardopt,
    "shardopt_overlap": lambda model, hp, device, **kw: setup_shardopt(model, hp, device, True,
                                                                     **kw),
    "ddp": setup_ddp,
    "fsdp2": setup_fsdp2,
    "zero": setup_zero,
    "megatron": setup_megatron,
}
