"""DistributedOptimizer against ``torch.optim.AdamW`` on a full replica.

Every rank trains the same model on its own slice of a global batch; the
parent process replays the whole global batch through a plain model and
``torch.optim.AdamW`` and compares parameters after every step. Ranks also
return their params so the parent can check that they are bit-identical.

Each spawned scenario checks many things at once (clipping, param groups,
accumulation, scheduler, unused and tied params) to keep process starts down.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from _dist import device_for, require_world_size, run_distributed
from shardopt import DistributedOptimizer, OptimizerConfig, kernels

VOCAB, DIM, HIDDEN, SEQ = 37, 12, 20, 5

# fp32 everywhere; summation order differs between the sharded and the full
# replica run, so results agree to rounding, not bitwise.
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
# GPU kernels (TF32 is off by default for matmul, but reductions differ more).
CUDA_TOL = dict(rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------- model

class ToyLM(nn.Module):
    """A tiny language model with odd-sized params (a 0-d and a zero-size one among them),
    an optional branch and an unused layer."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.branch = nn.Linear(DIM, DIM)  # used on some (rank, micro-batch, step) only
        self.unused = nn.Linear(3, 7)  # never used: its grad never exists
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.empty = nn.Parameter(torch.zeros(0, DIM))
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.emb(tokens)
        z = self.down(self.norm(torch.tanh(self.up(h))))
        if use_branch:
            z = z + self.branch(z)
        logits = self.head(h + self.scale * z + self.empty.sum(0))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


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
        shape = (self.steps, self.micro_batches, self.world_size, self.batch_per_rank, SEQ)
        return torch.randint(VOCAB, shape, generator=g), torch.randint(VOCAB, shape, generator=g)

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


# ----------------------------------------------------------------- reference

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
        history.append(snapshot(model))
    return history, norms


# --------------------------------------------------------------------- ranks

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
        history.append(snapshot(model))
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


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so -0.0 != 0.0 and NaN == NaN compare as stored."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


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


# ----------------------------------------------------------------- scenarios

@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_plain_adamw_matches_reference(backend, world_size, tmp_path):
    require_world_size(backend, world_size)
    sc = Scenario(world_size=world_size)
    results = run_distributed(train_rank, world_size, sc, backend, backend=backend,
                              tmp_path=tmp_path)
    assert_matches_reference(sc, results, tol_for(backend))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_features_match_reference(backend, world_size, overlap, tmp_path):
    """Clipping, decay groups, accumulation, cosine LR, tied, unused and partly used params."""
    require_world_size(backend, world_size)
    # eps comparable to the grads makes the update depend on their scale (AdamW with a
    # tiny eps barely notices a sum where a mean belongs).
    sc = Scenario(world_size=world_size, steps=6, micro_batches=2, max_grad_norm=0.5, eps=1e-3,
                  groups="no_decay", scheduler="cosine", tied=True, branch=True,
                  overlap_grad_reduce=overlap, bucket_numel=100 + 37 * world_size,
                  align_numel=world_size, seed=world_size)
    results = run_distributed(train_rank, world_size, sc, backend, backend=backend,
                              tmp_path=tmp_path)
    assert_matches_reference(sc, results, tol_for(backend))
    _, norms = reference_run(sc)
    assert any(n > sc.max_grad_norm for n in norms), "clipping never engaged; lower max_grad_norm"
    for res in results:
        assert res["tie_kept"]
        decay = {g["weight_decay"] for g in res["groups"] if "norm.weight" in g["fqns"]}
        assert decay == {0.0}


def test_param_groups_lr_override_and_lambda_scheduler(tmp_path):
    sc = Scenario(world_size=2, steps=4, groups="lr_override", scheduler="lambda",
                  max_grad_norm=1.0, bucket_numel=64, align_numel=1)
    results = run_distributed(train_rank, 2, sc, "gloo", tmp_path=tmp_path)
    assert_matches_reference(sc, results, FP32_TOL)
    groups = results[0]["groups"]
    by_fqn = {fqn: g for g in groups for fqn in g["fqns"]}
    assert by_fqn["emb.weight"]["lr"] == pytest.approx(3e-3 / (1 + 0))  # before any step
    assert by_fqn["emb.weight"]["betas"] == (0.8, 0.9)
    assert by_fqn["emb.weight"]["weight_decay"] == 0.1
    assert by_fqn["up.bias"]["weight_decay"] == 0.0 and by_fqn["up.bias"]["lr"] == 1e-2
    assert by_fqn["up.weight"]["weight_decay"] == 0.1 and by_fqn["up.weight"]["eps"] == 1e-8
    assert len(groups) == 3
    emb_group = next(i for i, g in enumerate(groups) if "emb.weight" in g["fqns"])
    assert results[0]["lrs"][-1][emb_group] == pytest.approx(3e-3 / 5)


def test_world_size_one_without_process_group():
    """In-process: no torch.distributed initialisation at all."""
    assert not dist.is_initialized()
    sc = Scenario(world_size=1, steps=4, micro_batches=3, max_grad_norm=0.5, groups="no_decay",
                  scheduler="cosine", tied=True, branch=True, bucket_numel=120)
    result = train_rank(0, 1, sc, None)
    assert not result["dist_initialized"]
    assert_matches_reference(sc, [result], FP32_TOL)


def test_world_size_one_with_process_group(backend, tmp_path):
    sc = Scenario(world_size=1, steps=3, tied=True, branch=True, overlap_grad_reduce=False)
    results = run_distributed(train_rank, 1, sc, backend, backend=backend, tmp_path=tmp_path)
    assert results[0]["dist_initialized"]
    assert_matches_reference(sc, results, tol_for(backend))


# ------------------------------------------------- communication behaviour

def count_collectives(rank: int, world_size: int, overlap: bool,
                      grad_mode: str) -> dict[str, Any]:
    """How many collectives backward issues, inside and outside ``no_sync``."""
    calls = {"n": 0}
    for name in ("all_reduce", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
                 "reduce_scatter", "broadcast"):
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            calls["n"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    sc = Scenario(world_size=world_size, bucket_numel=100, overlap_grad_reduce=overlap)
    model = sc.model()
    opt = DistributedOptimizer(model, dataclasses.replace(sc.config(), grad_mode=grad_mode))
    tokens, targets = sc.batches()
    out = {}
    opt.zero_grad()
    before = calls["n"]
    with opt.no_sync():
        model(tokens[0, 0, rank], targets[0, 0, rank], False).backward()
    out["no_sync_backward"] = calls["n"] - before
    before = calls["n"]
    model(tokens[1, 0, rank], targets[1, 0, rank], False).backward()
    out["sync_backward"] = calls["n"] - before
    out["grads_after_backward"] = {f: None if p.grad is None else p.grad.clone()
                                   for f, p in model.named_parameters()}
    before = calls["n"]
    opt.step()
    out["step"] = calls["n"] - before
    out["grads_freed"] = all(p.grad is None for p in model.parameters())
    return out


def test_no_sync_and_overlap_schedule(tmp_path):
    """grad_mode='buffer': a no_sync backward issues nothing; with overlap, backward itself
    starts reductions, without it step() does; p.grad is None throughout."""
    with_overlap = run_distributed(count_collectives, 2, True, "buffer", tmp_path=tmp_path)
    without = run_distributed(count_collectives, 2, False, "buffer", tmp_path=tmp_path)
    for res in with_overlap + without:
        assert res["no_sync_backward"] == 0
        assert res["step"] > 0
        assert res["grads_freed"]
        assert all(g is None for g in res["grads_after_backward"].values())
    assert all(res["sync_backward"] > 0 for res in with_overlap)
    assert all(res["sync_backward"] == 0 for res in without)


def test_torch_grad_mode_averages_p_grad_inside_backward(tmp_path):
    """grad_mode='torch': a no_sync backward issues nothing; any other backward returns with
    p.grad averaged over the ranks (reductions overlapping it, or at its end without
    overlap), equal on every rank; an unused param's p.grad stays None; step() keeps them."""
    for overlap in (True, False):
        results = run_distributed(count_collectives, 2, overlap, "torch", tmp_path=tmp_path)
        for res in results:
            assert res["no_sync_backward"] == 0
            assert res["sync_backward"] > 0
            assert not res["grads_freed"]
            grads = res["grads_after_backward"]
            assert grads["unused.weight"] is None and grads["emb.weight"] is not None
            for fqn, g in grads.items():
                other = results[0]["grads_after_backward"][fqn]
                assert (g is None) == (other is None), fqn
                if g is not None:
                    assert torch.equal(bits(g), bits(other)), fqn


# ------------------------------------------------------- mixed precision

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


MIXED_STEPS = 12


def mixed_data(world_size: int, per_rank: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(world_size, per_rank, 10, generator=g)
    y = torch.sin(x.sum(-1)) + 0.5 * x[..., 0]
    return x, y


def mixed_config(**overrides: Any) -> OptimizerConfig:
    return OptimizerConfig(**{"lr": 1e-2, "weight_decay": 0.01, "max_grad_norm": 1.0,
                              "bucket_numel": 200, "align_numel": 8, **overrides})


def triton_device() -> torch.device | None:
    """Where the Triton step can run here: the GPU, else the CPU under Triton's interpreter."""
    for device in (torch.device("cuda", 0), torch.device("cpu")):
        if (device.type == "cpu" or torch.cuda.is_available()) and kernels.available(device):
            return device
    return None


def train_mixed_rank(rank: int, world_size: int, backend: str | None,
                     config_overrides: dict[str, Any] | None = None,
                     device: torch.device | None = None) -> dict[str, Any]:
    device = device or device_for(backend, rank)
    torch.manual_seed(0)
    model = MixedNet().to(device)
    dtypes = {fqn: p.dtype for fqn, p in model.named_parameters()}
    opt = DistributedOptimizer(model, mixed_config(**(config_overrides or {})))
    x, y = mixed_data(world_size)
    # Each step's gradients as backward produced them (before the optimizer takes them), so
    # a reference can apply exactly these: on a GPU two backward passes over differently laid
    # out params may round a near-zero grad to opposite signs, and Adam turns that into +-lr.
    grads: list[dict[str, torch.Tensor]] = []
    for fqn, p in model.named_parameters():
        p.register_hook(lambda g, f=fqn: grads[-1].__setitem__(
            f, grads[-1][f] + g.detach().cpu() if f in grads[-1] else g.detach().cpu()))
    losses, history, dtypes_ok = [], [], True
    for _ in range(MIXED_STEPS):
        opt.zero_grad()
        grads.append({})
        loss = F.mse_loss(model(x[rank].to(device)), y[rank].to(device))
        loss.backward()
        opt.step()
        losses.append(loss.detach().item())
        history.append(snapshot(model))
        dtypes_ok &= all(p.dtype == dtypes[f] for f, p in model.named_parameters())
    return {"losses": losses, "history": history, "dtypes_ok": dtypes_ok, "dtypes": dtypes,
            "grads": grads}


@pytest.mark.parametrize("world_size,grad_accum_fp32", [(1, True), (2, True), (3, True), (2, False)],
                         ids=["1-fp32_grads", "2-fp32_grads", "3-fp32_grads", "2-model_dtype_grads"])
def test_mixed_precision_trains_and_ranks_agree(backend, world_size, grad_accum_fp32, tmp_path):
    require_world_size(backend, world_size)
    results = run_distributed(train_mixed_rank, world_size, backend,
                              {"grad_accum_fp32": grad_accum_fp32},
                              backend=backend, tmp_path=tmp_path)
    assert_ranks_identical(results)
    for res in results:
        assert res["dtypes_ok"]
        assert set(res["dtypes"].values()) == {torch.bfloat16, torch.float16, torch.float32}
        assert all(res["history"][-1][f].dtype == d for f, d in res["dtypes"].items())
    first = sum(r["losses"][0] for r in results) / world_size
    last = sum(r["losses"][-1] for r in results) / world_size
    assert last < 0.6 * first, f"loss did not fall: {first:.4f} -> {last:.4f}"


@pytest.mark.parametrize("step_kernel", ["torch", "triton"])
@pytest.mark.parametrize("max_grad_norm,steps", [(None, MIXED_STEPS), (1.0, 5)],
                         ids=["no_clip", "clip"])
def test_mixed_precision_single_rank_matches_fp32_master_reference(max_grad_norm, steps,
                                                                  step_kernel):
    """One rank: AdamW on fp32 master copies, written back to the bf16/fp16/fp32 params.

    Clipping computes the global norm in a different order than
    ``clip_grad_norm_``; the last-bit difference flips a bf16 rounding now and
    then, and after that the runs drift apart chaotically, so with clipping
    only the first steps are compared. The same holds for the Triton step, whose fp32
    arithmetic differs from torch's (which does part of it in double) in the last bit.
    """
    device = torch.device("cpu")
    if step_kernel == "triton":
        # Compiled Triton runs on a GPU; on the CPU only its interpreter does (TRITON_INTERPRET=1,
        # which conftest sets only where there is no GPU), so a GPU host runs this case there.
        device = triton_device()
        if device is None:
            pytest.skip("Triton is not installed, or no GPU and TRITON_INTERPRET is not 1")
        steps = min(steps, 5)
    result = train_mixed_rank(0, 1, None, {"max_grad_norm": max_grad_norm,
                                           "step_kernel": step_kernel}, device=device)

    torch.manual_seed(0)
    model = MixedNet().to(device)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    cfg = mixed_config(max_grad_norm=max_grad_norm)
    opt = torch.optim.AdamW(masters, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    names = [fqn for fqn, _ in model.named_parameters()]
    for step in range(steps):
        # The grads the optimizer got (see train_mixed_rank); an idle expert has none: skipped.
        recorded = result["grads"][step]
        for fqn, m in zip(names, masters):
            m.grad = recorded[fqn].to(device).float() if fqn in recorded else None
        if cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(masters, cfg.max_grad_norm)
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        got = result["history"][step]
        for fqn, p in model.named_parameters():
            assert got[fqn].dtype == p.dtype
            torch.testing.assert_close(got[fqn], p.detach().cpu(), msg=lambda m, f=fqn, s=step:
                                       f"{f} after step {s}: {m}")


def test_float64_params_are_refused_by_name():
    # fp32 main params and fp32 state would silently train float64 params at fp32 precision.
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 1).double())
    with pytest.raises(ValueError, match=r"'1\.weight'.*float64"):
        DistributedOptimizer(model, OptimizerConfig())


def test_param_group_fn_with_unknown_key_raises():
    model = ToyLM(tied=False)
    with pytest.raises(ValueError, match="momentum"):
        DistributedOptimizer(model, OptimizerConfig(), param_group_fn=lambda f, p: {"momentum": 0.9})


def test_is_a_torch_optimizer():
    model = ToyLM(tied=True)
    opt = DistributedOptimizer(model, OptimizerConfig(lr=0.5))
    assert isinstance(opt, torch.optim.Optimizer)
    assert [g["lr"] for g in opt.param_groups] == [0.5]
    # A tied weight is one param, listed once.
    listed = [p for g in opt.param_groups for p in g["params"]]
    assert len(listed) == len({id(p) for p in listed}) == len(list(model.parameters()))


def test_param_unused_after_a_used_step_is_skipped_not_stale():
    """The grad buffer is not cleared between steps: a param that got a gradient in one step and
    none in the next is left alone (as torch does with ``grad=None``), never updated with the
    previous step's values, and resumes at its own step count."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    reference = copy.deepcopy(model)
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-2, weight_decay=0.01, bucket_numel=8))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for use_b in (True, False, False, True):
        x = torch.randn(3, 4)
        for net in (model, reference):
            y = net["a"](x)
            (net["b"](y) if use_b else y).square().mean().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for got, want in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert opt.param_steps == {"a.weight": 4, "a.bias": 4, "b.weight": 2, "b.bias": 2}
