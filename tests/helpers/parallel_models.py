"""Small tensor- and expert-parallel models, their rank jobs and their one-process references.

* :class:`TPNet`: a column-parallel and a row-parallel linear (``parallelize_module`` over a
  "tp" mesh dim) and a plain LayerNorm, on a ``(dp, tp)`` mesh.
* ``"llama"``: a tiny Hugging Face ``LlamaForCausalLM`` from a config, attention and MLP
  projections column- and row-parallel (:data:`LLAMA_PLAN`), embeddings, norms and head plain.
* :class:`MoE`: a dense input projection, router and LayerNorm, and a 3-D ``experts`` param
  sharded ``Shard(0)`` on an "ep" mesh dim of a ``(dp, ep)`` mesh. Dense params are data
  parallel over the whole world, experts over the expert-DP group ``mesh["dp"]``. Each rank
  sees its own tokens; the experts' outputs go back through an all-reduce over "ep".

Every rank job returns the full params (``full_tensor()``) and each step's ``last_grad_norm``;
:func:`reference` trains the same model in one process on the global batch with
``torch.optim.AdamW`` and ``clip_grad_norm_``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint

DIM, HIDDEN, EXPERTS = 8, 16, 4


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(x))))


TP_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}
LLAMA_PLAN = {f"model.layers.*.{name}": style for name, style in [
    ("self_attn.q_proj", ColwiseParallel()), ("self_attn.k_proj", ColwiseParallel()),
    ("self_attn.v_proj", ColwiseParallel()), ("self_attn.o_proj", RowwiseParallel()),
    ("mlp.gate_proj", ColwiseParallel()), ("mlp.up_proj", ColwiseParallel()),
    ("mlp.down_proj", RowwiseParallel())]}
VOCAB, SEQ = 64, 8


def llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies by ``scale`` (the experts' gradient divide
    factor: each expert's grad sums the tokens of every ep rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _AllReduce(torch.autograd.Function):
    """Sum over ``group``; every rank's loss reads the sum, so the gradient is summed too."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class MoE(nn.Module):
    """Soft-routed experts; ``ep_group`` None: all experts local (the reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.Parameter(torch.randn(EXPERTS, DIM, DIM) * 0.3)
        self.norm = nn.LayerNorm(DIM)
        self.ep_group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        gates = torch.softmax(self.router(h), dim=-1)
        if self.ep_group is None:
            y = _experts(h, gates, self.experts)
        else:
            y = self._expert_parallel(h, gates)
        return self.norm(h + y)

    def _expert_parallel(self, h: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        ep, me = dist.get_world_size(self.ep_group), dist.get_rank(self.ep_group)
        local = _ScaleGrad.apply(self.experts.to_local(), 1.0 / ep)
        per = local.shape[0]
        h_all, gates_all = (_gather(t, ep, me, self.ep_group) for t in (h, gates))
        mine = gates_all[:, me * per:(me + 1) * per]
        y_all = _AllReduce.apply(_experts(h_all, mine, local), self.ep_group)
        return y_all.narrow(0, me * h.shape[0], h.shape[0])


def _experts(h: torch.Tensor, gates: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("te,tei->ti", gates, torch.tanh(torch.einsum("td,edi->tei", h, w)))


def _gather(t: torch.Tensor, size: int, rank: int, group: Any) -> torch.Tensor:
    """Every ep rank's ``t`` stacked in rank order, through a differentiable all-reduce."""
    padded = torch.zeros((size * t.shape[0], *t.shape[1:]), dtype=t.dtype)
    padded = padded.index_copy(0, torch.arange(rank * t.shape[0], (rank + 1) * t.shape[0]), t)
    return _AllReduce.apply(padded, group)


@dataclass(frozen=True)
class Run:
    kind: str  # "tp" or "moe"
    dp: int = 2
    mp: int = 2  # tp or ep size
    steps: int = 4
    max_grad_norm: float = 0.05
    grad_mode: str = "torch"
    seed: int = 0
    extra: dict = field(default_factory=dict)
    plan: bool = False  # with mp == 1: a model-parallel plan all the same (dp_group_fn)
    groups: bool = False  # no weight decay for biases and norms (param_group_fn)

    def config(self) -> OptimizerConfig:
        return OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                               max_grad_norm=self.max_grad_norm, grad_mode=self.grad_mode,
                               bucket_numel=100, align_numel=1, **self.extra)


def no_decay(fqn: str, param: nn.Parameter) -> dict[str, float]:
    return {"weight_decay": 0.0} if "bias" in fqn or "norm" in fqn else {}


def batch(run: Run, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: 4 samples per data-parallel piece of the world."""
    g = torch.Generator().manual_seed(1000 * run.seed + step)
    n = 4 * pieces(run)
    if run.kind == "llama":
        ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        return ids, ids
    return torch.randn(n, DIM, generator=g), torch.randn(n, DIM, generator=g)


def loss_of(run: Run, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if run.kind == "llama":
        return model(input_ids=x, labels=y).loss
    return torch.nn.functional.mse_loss(model(x), y)


def fresh(run: Run) -> nn.Module:
    torch.manual_seed(run.seed)
    return {"tp": TPNet, "moe": MoE, "llama": llama}[run.kind]()


def build(run: Run) -> tuple[nn.Module, DistributedOptimizer, int]:
    """This rank's parallelised model, its optimizer, and which piece of a batch it trains."""
    model = fresh(run)
    groups = no_decay if run.groups else None
    if run.kind != "moe" and run.mp == 1:
        return model, DistributedOptimizer(model, run.config(), dp_group_fn=_process_group
                                           if run.plan else None,
                                           param_group_fn=groups), dist.get_rank()
    if run.kind != "moe":
        mesh = init_device_mesh("cpu", (run.dp, run.mp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], TP_PLAN if run.kind == "tp" else LLAMA_PLAN)
        opt = DistributedOptimizer(model, run.config(), process_group=mesh["dp"].get_group(),
                                   param_group_fn=groups)
        return model, opt, mesh["dp"].get_local_rank()
    if run.mp == 1:  # no expert parallelism: every param plain, data parallel over the world
        return model, DistributedOptimizer(model, run.config()), dist.get_rank()
    mesh = init_device_mesh("cpu", (run.dp, run.mp), mesh_dim_names=("dp", "ep"))
    ep = mesh["ep"]
    full = model.experts.detach()
    per = EXPERTS // run.mp
    mine = full[ep.get_local_rank() * per:(ep.get_local_rank() + 1) * per].clone()
    model.experts = nn.Parameter(DTensor.from_local(mine, ep, [Shard(0)], run_check=False))
    model.ep_group = ep.get_group()
    expert_dp = mesh["dp"].get_group()
    opt = DistributedOptimizer(model, run.config(), dp_group_fn=lambda fqn, p: (
        expert_dp if fqn == "experts" else None))
    return model, opt, dist.get_rank()


def _process_group(fqn: str, param: nn.Parameter) -> None:
    return None  # every param in process_group


def pieces(run: Run) -> int:
    """Into how many pieces a global batch is cut: one per DP rank of the dense params."""
    return run.dp * run.mp if run.kind == "moe" else run.dp


def train_step(model: nn.Module, opt: DistributedOptimizer, run: Run, piece: int,
               step: int) -> float | None:
    """One step on this rank's piece of the global batch of ``step``; the grad norm."""
    x, y = batch(run, step)
    n = x.shape[0] // pieces(run)
    x, y = x[piece * n:(piece + 1) * n], y[piece * n:(piece + 1) * n]
    loss_of(run, model, x, y).backward()
    opt.step()
    opt.zero_grad()
    return opt.last_grad_norm


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective over each DTensor's mesh: every param's global tensor."""
    return {fqn: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for fqn, p in model.named_parameters()}


def train_rank(rank: int, world_size: int, run: Run) -> dict[str, Any]:
    model, opt, piece = build(run)
    norms = [train_step(model, opt, run, piece, step) for step in range(run.steps)]
    return {"params": full_params(model), "norms": norms}


def checkpoint_rank(rank: int, world_size: int, run: Run, root: str, load_from: str | None,
                    first: int, steps: int, save: bool) -> dict[str, Any]:
    """Build at ``run``'s layout, load ``load_from`` (if any), train ``steps`` steps from
    step ``first``, then save to ``root`` (if ``save``) at step ``first + steps``."""
    model, opt, piece = build(run)
    if load_from is not None:
        checkpoint.load(load_from, model, opt)
    norms = [train_step(model, opt, run, piece, step) for step in range(first, first + steps)]
    path = checkpoint.save(root, model, opt, step=first + steps) if save else None
    return {"params": full_params(model), "norms": norms, "path": path}


def reference(run: Run) -> dict[str, Any]:
    """One process, the whole model, ``torch.optim.AdamW`` and ``clip_grad_norm_``."""
    model = fresh(run)
    cfg = run.config()
    named = list(model.named_parameters())
    decay = [p for f, p in named if not (run.groups and no_decay(f, p))]
    rest = [p for f, p in named if run.groups and no_decay(f, p)]
    opt = torch.optim.AdamW([{"params": decay}] + ([{"params": rest, "weight_decay": 0.0}]
                                                   if rest else []),
                            lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    norms = []
    for step in range(run.steps):
        x, y = batch(run, step)
        loss_of(run, model, x, y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                          run.max_grad_norm)))
        opt.step()
        opt.zero_grad()
    return {"params": {f: p.detach().clone() for f, p in model.named_parameters()},
            "norms": norms}


def mismatch(ours: dict[str, Any], ref: dict[str, Any], atol: float = 2e-5,
             norm_rtol: float = 1e-5) -> list[str]:
    """What differs between a rank's result and the reference (empty: it matches)."""
    out = []
    for fqn, want in ref["params"].items():
        diff = (ours["params"][fqn] - want).abs().max().item()
        if diff > atol:
            out.append(f"param {fqn}: max diff {diff:.3g}")
    for step, (a, b) in enumerate(zip(ours["norms"], ref["norms"])):
        if abs(a - b) > norm_rtol * abs(b):
            out.append(f"step {step}: last_grad_norm {a} against {b}")
    return out
