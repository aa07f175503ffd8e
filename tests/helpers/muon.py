"""The Muon tests' model, its training on each rank, and ``torch.optim.Muon`` beside
``torch.optim.AdamW`` as the reference.

:class:`MuonNet`: an embedding, square, tall and wide matrices (three of one shape, so the
update batches them), biases, a norm and an untied head, all fp32; ``branch`` gets a
gradient only on some ranks and steps, and none at all in step 1. :func:`groups` puts the
matrices in two Muon groups (the second with other settings) and the rest in AdamW.
:func:`train_muon` trains on each rank's slice of a global batch and records, per step, the
averaged gradients the step read (``grad_mode="torch"``: ``p.grad``) and the params after it;
:func:`replay` steps torch's optimizers on a full replica with those gradients, and
:func:`reference_run` with the full batch's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardopt
from helpers.checks import param_copies
from shardopt import DistributedOptimizer, OptimizerConfig, muon

VOCAB, DIM, WIDE, SEQ, BATCH = 24, 16, 40, 5, 12  # BATCH: every DP size tested divides it
SECOND = {"lr": 0.03, "momentum": 0.9, "nesterov": False, "weight_decay": 0.05, "ns_steps": 4,
          "adjust_lr_fn": "match_rms_adamw"}


class MuonNet(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, WIDE)  # tall 40 x 16, with a bias
        self.down = nn.Linear(WIDE, DIM, bias=False)  # wide 16 x 40
        self.mix = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.branch = nn.Linear(DIM, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, branch: bool) -> torch.Tensor:
        x = self.emb(tokens)
        x = x + self.down(F.gelu(self.up(x)))
        for m in self.mix:
            x = x + torch.tanh(m(x))
        if branch:
            x = x + self.branch(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


def groups(model: nn.Module, extra: dict[str, Any] | None = None):
    """``param_group_fn``: :func:`shardopt.muon_groups` with lr 0.02, the ``mix`` matrices in
    a second Muon group (:data:`SECOND`), no decay for norms and biases (AdamW)."""
    usual = shardopt.muon_groups(model, lr=0.02, **(extra or {}))

    def fn(fqn: str, p: nn.Parameter) -> dict[str, Any]:
        out = usual(fqn, p)
        if out and fqn.startswith("mix."):
            return {**out, **SECOND}
        return out or ({"weight_decay": 0.0} if p.dim() < 2 else {})
    return fn


def config(**overrides: Any) -> OptimizerConfig:
    return OptimizerConfig(**{"lr": 3e-3, "weight_decay": 0.1, "bucket_numel": 700,
                              "align_numel": 4, **overrides})


def uses_branch(step: int, rank: int) -> bool:
    """No rank uses ``branch`` in step 1; later, every other rank does, from rank ``step % 2``."""
    return step > 1 and (rank + step) % 2 == 0


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def local(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = batch(step)
    n = BATCH // world
    return tokens[rank * n:(rank + 1) * n], targets[rank * n:(rank + 1) * n]


def train_step(model: MuonNet, opt: DistributedOptimizer, step: int, rank: int,
               world: int) -> None:
    opt.zero_grad()
    model(*local(step, rank, world), uses_branch(step, rank)).backward()
    opt.step()


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + 0.5 * k))


def train_muon(rank: int, world: int, steps: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Train ``steps`` steps; per step the gradients the step read and the params after it,
    and how many matrices this rank orthogonalised in each step."""
    model = MuonNet()
    opt = DistributedOptimizer(model, config(**cfg), param_group_fn=groups(model))
    sched = scheduler(opt)
    counted: list[int] = []
    orthogonalise = muon.newton_schulz

    def counting(x: torch.Tensor, *args: Any) -> torch.Tensor:
        counted[-1] += 1 if x.dim() == 2 else x.shape[0]
        return orthogonalise(x, *args)
    muon.newton_schulz = counting
    grads, params = [], []
    try:
        for step in range(1, steps + 1):
            opt.zero_grad()
            model(*local(step, rank, world), uses_branch(step, rank)).backward()
            grads.append({f: None if p.grad is None else p.grad.clone()
                          for f, p in model.named_parameters()})
            counted.append(0)
            opt.step()
            sched.step()
            params.append(param_copies(model))
    finally:
        muon.newton_schulz = orthogonalise
    owned = sorted(s.fqn for s in opt.shard_state.shards if s.fqn in muon_fqns(opt))
    return {"grads": grads, "params": params, "counted": counted, "owned": owned,
            "steps": dict(opt.param_steps),
            "momentum": {f: opt.state[p]["momentum_buffer"].clone()
                         for f, p in model.named_parameters()
                         if "momentum_buffer" in opt.state[p]}}


def muon_fqns(opt: DistributedOptimizer) -> set[str]:
    return {f for f, names in opt.shard_state.moment_names.items()
            if names == (muon.MOMENTUM,)}


class Reference:
    """``torch.optim.Muon`` for the Muon groups and fused ``torch.optim.AdamW`` (the kernel
    the optimizer runs on CPU) for the rest, on a full replica, each with :func:`scheduler`."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.model = MuonNet()
        c = config(**cfg)
        fn = groups(self.model)
        muon_groups, adamw_groups = {}, {}
        for fqn, p in self.model.named_parameters():
            over = fn(fqn, p)
            if over.get("optimizer") == "muon":
                settings = muon.MuonSettings(**{k: v for k, v in over.items() if k != "optimizer"})
                key = tuple(sorted(settings.group().items()))
                muon_groups.setdefault(key, {"params": [], **{
                    k: getattr(settings, k) for k in muon.MUON_KEYS}})["params"].append(p)
            else:
                adamw_groups.setdefault(tuple(sorted(over.items())),
                                        {"params": [], **over})["params"].append(p)
        self.opts = [torch.optim.Muon(list(muon_groups.values())),
                     torch.optim.AdamW(list(adamw_groups.values()), lr=c.lr, betas=c.betas,
                                       eps=c.eps, weight_decay=c.weight_decay, fused=True)]
        self.scheds = [scheduler(o) for o in self.opts]
        self.max_norm = c.max_grad_norm

    def step(self) -> float | None:
        norm = None
        if self.max_norm:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm))
        for o in self.opts:
            o.step()
        for s in self.scheds:
            s.step()
        for o in self.opts:
            o.zero_grad()
        return norm

    def momentum(self) -> dict[str, torch.Tensor]:
        state = self.opts[0].state
        return {f: state[p]["momentum_buffer"] for f, p in self.model.named_parameters()
                if p in state}


def replay(grads: list[dict[str, torch.Tensor | None]], cfg: dict[str, Any]) -> tuple[
        list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The reference stepped with the given gradients: params after each step, momentum."""
    ref = Reference(cfg)
    history = []
    for step_grads in grads:
        for fqn, p in ref.model.named_parameters():
            p.grad = None if step_grads[fqn] is None else step_grads[fqn].clone()
        ref.step()
        history.append(param_copies(ref.model))
    return history, ref.momentum()


def reference_run(steps: int, world: int, cfg: dict[str, Any]) -> tuple[
        dict[str, torch.Tensor], list[float | None]]:
    """The reference on the full global batch (each rank's slice weighted ``1 / world``, as
    the ranks average): the params after ``steps`` steps and the grad norm of each step."""
    ref = Reference(cfg)
    norms = []
    for step in range(1, steps + 1):
        for rank in range(world):
            loss = ref.model(*local(step, rank, world), uses_branch(step, rank))
            (loss / world).backward()
        norms.append(ref.step())
    return param_copies(ref.model), norms


