"""The models and training runs that several test modules share.

* :class:`MixedLM`, :func:`build`, :func:`train`: the checkpoint tests' tiny LM (bf16 matmuls
  with fp32 norm and router between them, a frozen param, a 0-d buffer, tiny buckets so params
  split across ranks) and its deterministic training, each rank on its slice of a global batch.
* :class:`Scenario`, :func:`train_rank`, :func:`assert_matches_reference`: the optimizer on
  several ranks against ``torch.optim.AdamW`` on a full replica (:class:`ToyLM`).
* :class:`MixedNet`: bf16, fp16 and fp32 params interleaved, with a top-1 router.
* :class:`MixedMLP`, :class:`MlpReference`: a small bf16/fp16/fp32 net whose modules a step
  can leave out, against ``torch.optim.AdamW`` on fp32 masters of a full replica.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers.checks import bits, model_state, param_copies
from helpers.dist import device_for
from shardopt import DistributedOptimizer, OptimizerConfig, checkpoint

# ------------------------------------------------------ the checkpoint tests' model and run

LM_VOCAB, LM_DIM, LM_HIDDEN, LM_SEQ, LM_EXPERTS = 29, 10, 14, 6, 3
LM_BATCH = 12  # every DP size tested (1..4) divides it
STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")

def _apply(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x.to(module.weight.dtype))


class MixedLM(nn.Module):
    """A tiny LM: bf16 matmuls with fp32 params (norm, router) registered between them.

    ``fp32`` names the modules kept in fp32 (the rest are bf16), so a test can
    change a param's dtype between save and load. The frozen ``pos`` and the
    0-d ``temperature`` buffer depend on the seed, so a load must restore them.
    """

    def __init__(self, *, tied: bool = False, dropout: float = 0.0,
                 fp32: tuple[str, ...] = ("norm", "router"), experts: int = LM_EXPERTS,
                 down_bias: bool = True, extra_layer: bool = False) -> None:
        super().__init__()

        def dt(name: str) -> torch.dtype:
            return torch.float32 if name in fp32 else torch.bfloat16

        self.emb = nn.Embedding(LM_VOCAB, LM_DIM).to(dt("emb"))
        self.pos = nn.Parameter(0.1 * torch.randn(LM_SEQ, LM_DIM).to(dt("emb")), requires_grad=False)
        self.up = nn.Linear(LM_DIM, LM_HIDDEN).to(dt("up"))
        self.norm = nn.LayerNorm(LM_HIDDEN).to(dt("norm"))
        self.router = nn.Linear(LM_HIDDEN, experts).to(dt("router"))
        self.down = nn.Linear(LM_HIDDEN, LM_DIM, bias=down_bias).to(dt("down"))
        self.extra = nn.Linear(LM_DIM, LM_DIM).to(dt("extra")) if extra_layer else None
        self.head = nn.Linear(LM_DIM, LM_VOCAB, bias=False).to(dt("head"))
        if tied:
            self.head.weight = self.emb.weight
        self.drop = nn.Dropout(dropout)
        self.register_buffer("temperature", 1.0 + torch.rand(()))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos[: tokens.shape[1]]
        x = F.gelu(_apply(self.up, h))
        n = self.norm(x.to(self.norm.weight.dtype)).float()
        gate = torch.softmax(_apply(self.router, n).float() / self.temperature, dim=-1)
        x = _apply(self.down, self.drop(n)) * gate[..., :1].to(self.down.weight.dtype)
        if self.extra is not None:
            x = x + _apply(self.extra, x)
        logits = _apply(self.head, h + x.to(h.dtype))
        return F.cross_entropy(logits.float().reshape(-1, LM_VOCAB), targets.reshape(-1))


def param_groups(fqn: str, param: nn.Parameter) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if fqn.endswith(".bias") or fqn.startswith("norm."):
        out["weight_decay"] = 0.0
    if fqn.startswith("router."):
        out["lr"] = 5e-3
    return out


def make_config(**overrides: Any) -> OptimizerConfig:
    # Tiny buckets: the big params get buckets of their own and split across ranks.
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0,
              bucket_numel=97, align_numel=4)
    kw.update(overrides)
    return OptimizerConfig(**kw)


def build(seed: int, device: torch.device | str = "cpu",
          **model_kwargs: Any) -> tuple[MixedLM, DistributedOptimizer]:
    torch.manual_seed(seed)
    model = MixedLM(**model_kwargs).to(device)
    return model, DistributedOptimizer(model, make_config(), param_group_fn=param_groups)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    return (torch.randint(LM_VOCAB, (LM_BATCH, LM_SEQ), generator=g),
            torch.randint(LM_VOCAB, (LM_BATCH, LM_SEQ), generator=g))


def train(model: nn.Module, opt: DistributedOptimizer, steps: range, rank: int,
          world_size: int, scheduler: Any = None) -> list[float]:
    """Each rank takes its slice of the deterministic global batch of every step."""
    per = LM_BATCH // world_size
    device = next(model.parameters()).device
    losses = []
    for step in steps:
        tokens, targets = global_batch(step)
        mine = slice(rank * per, (rank + 1) * per)
        loss = model(tokens[mine].to(device), targets[mine].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def live_optimizer_state(opt: DistributedOptimizer) -> list[tuple[str, int, int, dict]]:
    """This rank's shards of every state tensor: ``(fqn, start, end, {name: tensor})``."""
    return [(s.fqn, s.range_param.start, s.range_param.end,
             {n: opt.shard_state.view(n, s).detach().cpu().clone() for n in STATE_NAMES})
            for s in opt.shard_state.shards]


@dataclasses.dataclass(frozen=True)
class Saved:
    """One checkpoint saved at 3 ranks (:func:`save_three_rank`) and what the ranks held."""

    root: Path
    path: Path
    params: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]  # "{fqn}.{name}" -> full fp32 tensor, assembled from ranks
    shapes: dict[str, torch.Size]


def save_three_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, opt = build(0)
    train(model, opt, range(2), rank, world_size)
    # Small hash blocks, so files span several blocks.
    checkpoint.save(root, model, opt, step=2, extra={"data": [1, 2]},
                    config=checkpoint.CheckpointConfig(block_bytes=512))
    return {"params": model_state(model), "state": live_optimizer_state(opt),
            "shapes": {fqn: p.shape for fqn, p in model.named_parameters()}}


# ------------------------------------------------- the optimizer against torch.optim.AdamW

TOY_VOCAB, TOY_DIM, TOY_HIDDEN, TOY_SEQ = 37, 12, 20, 5
# fp32 everywhere; summation order differs between the sharded and the full
# replica run, so results agree to rounding, not bitwise.
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
# GPU kernels (TF32 is off by default for matmul, but reductions differ more).
CUDA_TOL = dict(rtol=1e-4, atol=1e-5)


class ToyLM(nn.Module):
    """A tiny language model with odd-sized params (a 0-d and a zero-size one among them),
    an optional branch and an unused layer."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(TOY_VOCAB, TOY_DIM)
        self.up = nn.Linear(TOY_DIM, TOY_HIDDEN)
        self.norm = nn.LayerNorm(TOY_HIDDEN)
        self.down = nn.Linear(TOY_HIDDEN, TOY_DIM)
        self.branch = nn.Linear(TOY_DIM, TOY_DIM)  # used on some (rank, micro-batch, step) only
        self.unused = nn.Linear(3, 7)  # never used: its grad never exists
        self.head = nn.Linear(TOY_DIM, TOY_VOCAB, bias=False)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.empty = nn.Parameter(torch.zeros(0, TOY_DIM))
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.emb(tokens)
        z = self.down(self.norm(torch.tanh(self.up(h))))
        if use_branch:
            z = z + self.branch(z)
        logits = self.head(h + self.scale * z + self.empty.sum(0))
        return F.cross_entropy(logits.reshape(-1, TOY_VOCAB), targets.reshape(-1))


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One training run, shared by the ranks and the parent's reference."""

    world_size: int
    steps: int = 5
    micro_batches: int = 1
    batch_per_rank: int = 3
    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float | None = None
    bucket_numel: int = 150
    align_numel: int = 4
    overlap_grad_reduce: bool = True
    groups: str | None = None  # name in GROUP_FNS
    scheduler: str | None = None  # "cosine" or "lambda"
    tied: bool = False
    branch: bool = False
    seed: int = 0
    step_kernel: str = "auto"

    def config(self) -> OptimizerConfig:
        return OptimizerConfig(
            lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm, bucket_numel=self.bucket_numel,
            align_numel=self.align_numel, overlap_grad_reduce=self.overlap_grad_reduce,
            step_kernel=self.step_kernel,
        )

    def model(self) -> ToyLM:
        torch.manual_seed(self.seed)
        return ToyLM(self.tied)

    def batches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and targets indexed ``[step, micro, rank]``."""
        g = torch.Generator().manual_seed(self.seed + 1)
        shape = (self.steps, self.micro_batches, self.world_size, self.batch_per_rank, TOY_SEQ)
        return torch.randint(TOY_VOCAB, shape, generator=g), torch.randint(TOY_VOCAB, shape, generator=g)

    def uses_branch(self, step: int, micro: int, rank: int) -> bool:
        # Some ranks use it, some don't, and at some steps nobody does.
        return self.branch and (step + micro + rank) % 3 == 0


def no_decay_for_bias_and_norm(fqn: str, param: nn.Parameter) -> dict[str, Any]:
    if fqn.endswith(".bias") or ".norm." in f".{fqn}":
        return {"weight_decay": 0.0}
    return {}


def groups_with_lr_override(fqn: str, param: nn.Parameter) -> dict[str, Any]:
    out = no_decay_for_bias_and_norm(fqn, param)
    if fqn.startswith("emb."):
        out["lr"] = 3e-3
        out["betas"] = (0.8, 0.9)
    return out


GROUP_FNS = {"no_decay": no_decay_for_bias_and_norm, "lr_override": groups_with_lr_override}


def make_scheduler(kind: str | None, opt: torch.optim.Optimizer, steps: int):
    if kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return None


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {fqn: p.detach().to("cpu", copy=True) for fqn, p in model.named_parameters()}

def reference_run(sc: Scenario) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Single process, full global batch, ``torch.optim.AdamW``; params after each step."""
    model = sc.model()
    named = list(model.named_parameters())
    group_fn = GROUP_FNS[sc.groups] if sc.groups else None
    groups: dict[tuple, dict[str, Any]] = {}
    for fqn, p in named:
        over = group_fn(fqn, p) if group_fn else {}
        groups.setdefault(tuple(sorted(over.items())), {"params": [], **over})["params"].append(p)
    opt = torch.optim.AdamW(list(groups.values()), lr=sc.lr, betas=sc.betas, eps=sc.eps,
                            weight_decay=sc.weight_decay)
    sched = make_scheduler(sc.scheduler, opt, sc.steps)
    tokens, targets = sc.batches()
    history, norms = [], []
    pieces = sc.world_size * sc.micro_batches
    for step in range(sc.steps):
        opt.zero_grad()
        for rank in range(sc.world_size):
            for micro in range(sc.micro_batches):
                loss = model(tokens[step, micro, rank], targets[step, micro, rank],
                             sc.uses_branch(step, micro, rank))
                (loss / pieces).backward()
        # With max_norm=inf the grads are left as they are and only the norm is returned.
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                          sc.max_grad_norm or float("inf"))))
        opt.step()
        if sched is not None:
            sched.step()
        history.append(param_copies(model))
    return history, norms


def train_rank(rank: int, world_size: int, sc: Scenario, backend: str | None) -> dict[str, Any]:
    """Train ``sc`` on this rank's slices; return params after each step and what the group saw."""
    device = device_for(backend, rank)
    model = sc.model().to(device)
    params_before = {fqn: (id(p), p.dtype, p.shape) for fqn, p in model.named_parameters()}
    group_fn = GROUP_FNS[sc.groups] if sc.groups else None
    opt = DistributedOptimizer(model, sc.config(), param_group_fn=group_fn)
    sched = make_scheduler(sc.scheduler, opt, sc.steps)
    fqn_of = {p: fqn for fqn, p in model.named_parameters()}
    groups = [{"fqns": sorted(fqn_of[p] for p in g["params"]),
               **{k: v for k, v in g.items() if k != "params"}} for g in opt.param_groups]
    tokens, targets = sc.batches()
    history, lrs, grad_norms = [], [], []
    for step in range(sc.steps):
        opt.zero_grad()
        for micro in range(sc.micro_batches):
            loss = model(tokens[step, micro, rank].to(device), targets[step, micro, rank].to(device),
                         sc.uses_branch(step, micro, rank)) / sc.micro_batches
            if micro < sc.micro_batches - 1:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        grad_norms.append(opt.last_grad_norm)
        if sched is not None:
            sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
        history.append(param_copies(model))
    params_after = {fqn: (id(p), p.dtype, p.shape) for fqn, p in model.named_parameters()}
    return {
        "history": history,
        "groups": groups,
        "lrs": lrs,
        "grad_norms": grad_norms,
        "same_param_objects": params_before == params_after,
        "tie_kept": model.head.weight is model.emb.weight if sc.tied else None,
        "dist_initialized": dist.is_initialized(),
    }


def assert_ranks_identical(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results[1:], start=1):
        for step, (ours, theirs) in enumerate(zip(results[0]["history"], res["history"])):
            for fqn, t in ours.items():
                assert torch.equal(bits(t), bits(theirs[fqn])), (
                    f"rank {rank} differs from rank 0 in {fqn} after step {step}")


def assert_matches_reference(sc: Scenario, results: list[dict[str, Any]], tol: dict) -> None:
    reference, norms = reference_run(sc)
    assert_ranks_identical(results)
    for res in results:  # last_grad_norm is the global norm before clipping, on every rank
        torch.testing.assert_close(res["grad_norms"], norms, rtol=1e-5, atol=0)
    for step, (got, want) in enumerate(zip(results[0]["history"], reference, strict=True)):
        assert got.keys() == want.keys()
        for fqn in want:
            torch.testing.assert_close(got[fqn], want[fqn], **tol,
                                       msg=lambda m, f=fqn, s=step: f"{f} after step {s}: {m}")
    for res in results:
        assert res["same_param_objects"], "params must stay the same objects, dtypes and shapes"


def tol_for(backend: str) -> dict:
    return CUDA_TOL if backend == "nccl" else FP32_TOL


# ------------------------------------------------------------------- mixed precision

class MixedNet(nn.Module):
    """bf16 Linears, fp32 LayerNorms and a fp32 top-1 router interleaved, one fp16 Linear."""

    def __init__(self, num_experts: int = 4, width: int = 24) -> None:
        super().__init__()
        self.inp = nn.Linear(10, width).to(torch.bfloat16)
        self.norm1 = nn.LayerNorm(width)
        self.router = nn.Linear(width, num_experts)
        self.experts = nn.ModuleList(
            nn.Linear(width, width).to(torch.bfloat16) for _ in range(num_experts))
        self.norm2 = nn.LayerNorm(width)
        self.proj = nn.Linear(width, width).to(torch.float16)
        self.out = nn.Linear(width, 1).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(self.inp(x.to(torch.bfloat16)).float())
        gates = torch.softmax(self.router(h), dim=-1)
        top = gates.argmax(dim=-1)
        mixed = torch.zeros_like(h)
        for k, expert in enumerate(self.experts):
            rows = (top == k).nonzero(as_tuple=True)[0]
            if rows.numel():  # an expert with no tokens on this rank gets no grad here
                y = expert(h[rows].to(torch.bfloat16)).float() * gates[rows, k : k + 1]
                mixed = mixed.index_add(0, rows, y)
        h = torch.tanh(self.proj(self.norm2(h + mixed).to(torch.float16)))
        return self.out(h.to(torch.bfloat16)).float().squeeze(-1)


def mixed_data(world_size: int, per_rank: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(world_size, per_rank, 10, generator=g)
    y = torch.sin(x.sum(-1)) + 0.5 * x[..., 0]
    return x, y


def mixed_config(**overrides: Any) -> OptimizerConfig:
    return OptimizerConfig(**{"lr": 1e-2, "weight_decay": 0.01, "max_grad_norm": 1.0,
                              "bucket_numel": 200, "align_numel": 8, **overrides})


# ------------------------------------------- a small mixed net against AdamW on fp32 masters

# bf16 params: a last-bit difference in the fp32 sums flips a bf16 rounding now and then.
MLP_TOL = dict(rtol=2e-2, atol=2e-3)


class MixedMLP(nn.Module):
    """bf16 and fp16 Linears, fp32 LayerNorm and Linear; ``skip`` leaves modules out."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8).to(torch.bfloat16)
        self.norm = nn.LayerNorm(8)
        self.b = nn.Linear(8, 8).to(torch.bfloat16)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 1).to(torch.float16)

    def forward(self, x: torch.Tensor, skip: frozenset[str] = frozenset()) -> torch.Tensor:
        h = self.norm(self.a(x.to(self.a.weight.dtype)).to(self.norm.weight.dtype))
        if "b" not in skip:
            h = h + self.b(h.to(self.b.weight.dtype)).to(h.dtype)
        if "c" not in skip:
            h = torch.tanh(self.c(h.to(self.c.weight.dtype)))
        return self.d(h.to(self.d.weight.dtype)).float().squeeze(-1)


def mlp_batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(5, 6, generator=g)
    return x, torch.sin(x.sum(-1))


def mlp_loss(model: MixedMLP, step: int, rank: int, micro: int, skip: frozenset[str]) -> torch.Tensor:
    x, y = mlp_batch(step, rank, micro)
    return F.mse_loss(model(x, skip), y)


def mlp_config(kernel: str, clip: float | None = None, overlap: bool = False,
               grad_mode: str = "torch") -> OptimizerConfig:
    return OptimizerConfig(lr=2e-2, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=clip,
                           bucket_numel=90, align_numel=4, step_kernel=kernel,
                           overlap_param_gather=overlap, grad_mode=grad_mode)


class MlpReference:
    """torch.optim.AdamW on fp32 masters of a full replica; ``skips[step][rank]`` as the ranks."""

    def __init__(self, cfg: OptimizerConfig) -> None:
        torch.manual_seed(0)
        self.model = MixedMLP()
        self.params = dict(self.model.named_parameters())
        self.masters = {f: p.detach().float().clone().requires_grad_(True)
                        for f, p in self.params.items()}
        self.cfg = cfg
        self.opt = torch.optim.AdamW(list(self.masters.values()), lr=cfg.lr, betas=cfg.betas,
                                     eps=cfg.eps, weight_decay=cfg.weight_decay)

    def step(self, step: int, world_size: int, micro_batches: int,
             skips: list[list[frozenset[str]]]) -> None:
        grads: dict[str, torch.Tensor] = {}
        for rank in range(world_size):
            for micro in range(micro_batches):
                for p in self.params.values():
                    p.grad = None
                loss = mlp_loss(self.model, step, rank, micro, skips[rank][micro])
                (loss / micro_batches).backward()
                for f, p in self.params.items():
                    if p.grad is not None:
                        grads[f] = grads.get(f, 0) + p.grad.float() / world_size
        for f, m in self.masters.items():
            m.grad = grads.get(f)  # None on every rank: torch leaves the param alone
        if self.cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(list(self.masters.values()), self.cfg.max_grad_norm)
        self.opt.step()
        self.copy_back()

    def copy_back(self) -> None:
        with torch.no_grad():
            for f, p in self.params.items():
                p.copy_(self.masters[f])

    def steps(self) -> dict[str, int]:
        return {f: int(self.opt.state[m]["step"]) if m in self.opt.state else 0
                for f, m in self.masters.items()}


def mlp_train_step(model: MixedMLP, opt: DistributedOptimizer, step: int, rank: int,
               skips: list[frozenset[str]]) -> None:
    """One step; micro-batches but the last run under ``no_sync``."""
    for micro, skip in enumerate(skips):
        loss = mlp_loss(model, step, rank, micro, skip) / len(skips)
        if micro < len(skips) - 1:
            with opt.no_sync():
                loss.backward()
        else:
            loss.backward()
    opt.step()
    opt.zero_grad()
