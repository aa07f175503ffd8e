"""The systems resume_memory.py compares, each behind the same small interface.

* :class:`Shardopt`  — shardopt's DistributedOptimizer and ``shardopt.checkpoint`` save/load.
* :class:`FSDP2`     — ``torch.distributed.fsdp.fully_shard`` (fp32 sharded params, bf16 compute,
  fp32 reduction, ``_peers.fsdp2_shard`` as in train_iter.py) + fused ``torch.optim.AdamW``, and
  torch.distributed.checkpoint with its standard recipe (``get_state_dict`` -> ``dcp.save``;
  ``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``).
* :class:`Megatron`  — megatron-core's own DDP wrapper and DistributedOptimizer from
  ``get_megatron_optimizer`` (no Transformer Engine, so it wraps ``torch.optim.AdamW``), saved and
  loaded with ``megatron.core.dist_checkpointing`` using the sharded-state-dict metadata of
  Megatron-LM's training loop (``dp_reshardable``).

Every system trains the same model (the reference GPT, or ``_common.HFLlama``; megatron-core only
the GPT) with the same hyperparameters. A system's ``train_step`` marks ``forward``, ``backward``
and ``step`` on the :class:`_common.MemoryTimeline`; ``load`` marks its own sub-steps under the
phase ``load``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _common import MemoryTimeline
from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint
from shardopt.recipes.model import GPT, no_decay

LR, BETAS, EPS, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


class System:
    """One training stack: optimizer + checkpoint recipe around a model on this rank's device."""

    name = "?"

    def train_step(self, x: torch.Tensor, y: torch.Tensor, tl: MemoryTimeline, phase: str) -> float:
        raise NotImplementedError

    def save(self, path: Path, step: int) -> None:
        raise NotImplementedError

    def load(self, path: Path, tl: MemoryTimeline) -> None:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {}


def _fwd_bwd(model: torch.nn.Module, x, y, tl: MemoryTimeline, phase: str) -> torch.Tensor:
    loss = model(x, y)
    tl.mark(phase, "forward")
    loss.backward()
    tl.mark(phase, "backward")
    return loss


def _checked(loss: torch.Tensor, who: str) -> float:
    value = float(loss.detach())
    if not torch.isfinite(torch.tensor(value)):
        raise FloatingPointError(f"{who}: loss is {value}")
    return value


# ----------------------------------------------------------------------------- shardopt
class Shardopt(System):
    name = "shardopt"

    def __init__(self, model: torch.nn.Module, low_memory_resume: bool = False) -> None:
        self.model = model
        self.low_memory_resume = low_memory_resume
        config = OptimizerConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                 max_grad_norm=MAX_GRAD_NORM)
        self.opt = DistributedOptimizer(model, config, param_group_fn=no_decay)

    def train_step(self, x, y, tl, phase):
        loss = _fwd_bwd(self.model, x, y, tl, phase)
        self.opt.step()
        self.opt.zero_grad()
        tl.mark(phase, "step")
        return _checked(loss, self.name)

    def save(self, path, step):
        checkpoint.save(path, self.model, self.opt, step=step)

    def load(self, path, tl):
        info = checkpoint.load(path, self.model, self.opt, low_memory_resume=self.low_memory_resume)
        tl.mark("load", "checkpoint.load")
        if info.step <= 0:
            raise RuntimeError(f"shardopt loaded step {info.step} from {info.path}")

    def describe(self):
        return {"memory_bytes": self.opt.memory_bytes(), "low_memory_resume": self.low_memory_resume}


# ----------------------------------------------------------------------------- FSDP2
class FSDP2(System):
    """FSDP2 with the usual mixed-precision recipe: fp32 sharded params (the main copy), bf16 compute
    and fp32 gradient reduction; FSDP2's default ``reshard_after_forward``."""

    name = "fsdp2"

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from _peers import fsdp2_shard

        fsdp2_shard(model, mesh=init_device_mesh(device.type, (dist.get_world_size(),)))
        self.model = model
        decay = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay}, {"params": rest, "weight_decay": 0.0}],
            lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)

    def train_step(self, x, y, tl, phase):
        loss = _fwd_bwd(self.model, x, y, tl, phase)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        tl.mark(phase, "step")
        return _checked(loss, self.name)

    def save(self, path, step):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=str(path))

    def load(self, path, tl):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        tl.mark("load", "get_state_dict")
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        dcp.load(state, checkpoint_id=str(path))
        tl.mark("load", "dcp.load")
        set_state_dict(self.model, self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        tl.mark("load", "set_state_dict")
        if int(state["step"]) <= 0:
            raise RuntimeError(f"fsdp2 loaded step {state['step']} from {path}")


# ----------------------------------------------------------------------------- megatron-core
def megatron_available() -> str | None:
    """None if megatron-core imports here, else why not (one line)."""
    try:
        import megatron.core.distributed  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means the peer cannot run
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


class Megatron(System):
    name = "megatron"

    def __init__(self, model: GPT, device: torch.device, mixed_dtype_groups: bool = False) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig as MOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides
        from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.module import MegatronModule

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                                     pipeline_model_parallel_size=1)
        cfg = model.config
        self.tconfig = TransformerConfig(
            num_layers=cfg.num_layers, hidden_size=cfg.d_model, num_attention_heads=cfg.num_heads,
            ffn_hidden_size=cfg.d_ff, bf16=cfg.dtype == torch.bfloat16, params_dtype=cfg.dtype,
            pipeline_dtype=cfg.dtype)

        class Wrapped(MegatronModule):
            """The GPT as a MegatronModule, so the DDP wrapper and dist_checkpointing accept it."""

            def __init__(self, config, gpt: GPT) -> None:
                super().__init__(config)
                self.gpt = gpt

            def forward(self, tokens, targets):
                return self.gpt(tokens, targets)

        self.ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True,
            bucket_size=40_000_000)
        self.model = DistributedDataParallel(self.tconfig, self.ddp_config, Wrapped(self.tconfig, model))
        self.oconfig = MOptimizerConfig(
            optimizer="adam", lr=LR, weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0],
            adam_beta2=BETAS[1], adam_eps=EPS, clip_grad=MAX_GRAD_NORM, bf16=True,
            params_dtype=cfg.dtype, use_distributed_optimizer=True)
        # megatron-core 0.19.2 cannot checkpoint a param group that mixes fp32 and bf16 params:
        # DistributedOptimizer.model_param_group_index_map numbers a group's params in grad-buffer
        # order, but the inner optimizer's group lists the fp32 params first, so state is looked up
        # for the wrong param (sharded_param_state_dp_reshardable then fails its shape assertion).
        # Here the decayed group would hold the bf16 matrices and the fp32 MoE router weights, so
        # the routers get a group of their own, told apart by ``min_lr`` (read only by megatron's
        # LR scheduler, which is not used): same hyperparameters, same memory.
        overrides = get_standard_config_overrides(self.oconfig)
        if not mixed_dtype_groups:
            fp32_matrix = ParamPredicate(name="fp32_matrix",
                                         fn=lambda p: p.dtype == torch.float32 and p.ndim >= 2)
            overrides[ParamKey(predicate=fp32_matrix)] = {"min_lr": 0.0}
        self.mixed_dtype_groups = mixed_dtype_groups
        self.opt = get_megatron_optimizer(self.oconfig, [self.model], config_overrides=overrides)
        self.metadata = {
            "distrib_optim_sharding_type": "dp_reshardable",
            "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
        }

    def _dist_optimizers(self) -> list[Any]:
        return list(getattr(self.opt, "chained_optimizers", [self.opt]))

    def train_step(self, x, y, tl, phase):
        self.model.zero_grad_buffer()
        self.opt.zero_grad()
        loss = _fwd_bwd(self.model, x, y, tl, phase)
        self.model.finish_grad_sync()
        ok, grad_norm, _ = self.opt.step()
        tl.mark(phase, "step")
        if not ok:
            raise RuntimeError(f"megatron optimizer step was skipped (grad norm {grad_norm})")
        return _checked(loss, self.name)

    def _sharded_state_dict(self, is_loading: bool) -> dict[str, Any]:
        # As Megatron-LM does: the unwrapped module's sharded state dict (no "module." prefix).
        state = {"model": self.model.module.sharded_state_dict(metadata=self.metadata)}
        state["optimizer"] = self.opt.sharded_state_dict(state, is_loading=is_loading,
                                                         metadata=self.metadata)
        return state

    def save(self, path, step):
        from megatron.core import dist_checkpointing

        os.makedirs(path, exist_ok=True)
        state = self._sharded_state_dict(is_loading=False)
        state["iteration"] = step
        dist_checkpointing.save(state, str(path))

    def load(self, path, tl):
        from megatron.core import dist_checkpointing

        # Without Transformer Engine/Apex the inner torch AdamW has no state before its first
        # step and DistributedOptimizer.state_dict() asserts on that (it reads every param's
        # 'step'); megatron's own fix-up for this case is a dummy step with zero grads.
        for opt in self._dist_optimizers():
            if len(opt.optimizer.state) == 0:
                opt._init_optimizer_states_with_dummy_values()
        tl.mark("load", "init_state_dummy_step")
        state = self._sharded_state_dict(is_loading=True)
        state["iteration"] = 0
        tl.mark("load", "sharded_state_dict")
        loaded = dist_checkpointing.load(state, str(path))
        tl.mark("load", "dist_checkpointing.load")
        # load_parameter_state_from_dp_reshardable copies into views of params that require
        # grad, which autograd refuses outside no_grad.
        with torch.no_grad():
            self.model.load_state_dict(loaded["model"], strict=True)
            self.opt.load_state_dict(loaded["optimizer"])
        tl.mark("load", "load_state_dict")
        if int(loaded["iteration"]) <= 0:
            raise RuntimeError(f"megatron loaded iteration {loaded['iteration']} from {path}")

    def describe(self):
        return {"sharding_type": self.metadata["distrib_optim_sharding_type"],
                "fp32_matrices_in_own_group": not self.mixed_dtype_groups,
                "inner_optimizer": type(self._dist_optimizers()[0].optimizer).__name__}
