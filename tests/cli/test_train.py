"""The reference job's parts: model, synthetic data, LR schedule, and exact resume of ``train.run``.

Multi-rank runs go through ``helpers.dist.run_distributed`` (fork server, no fresh
interpreters), so a whole interrupted-and-resumed run at a different DP size takes a few seconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers.dist import run_distributed
from shardopt import checkpoint
from shardopt.recipes.data import BatchPlan, MarkovTask, local_batches
from shardopt.recipes.model import GPT, PRESETS, build_model, count_params, model_config, no_decay
from shardopt.recipes.train import TrainConfig, lr_lambda, run

# ------------------------------------------------------------------------------------ model


def test_params_are_interleaved_bf16_and_fp32():
    model = build_model(PRESETS["tiny"], seed=0)
    dtypes = {fqn: p.dtype for fqn, p in model.named_parameters()}
    fp32 = [fqn for fqn, d in dtypes.items() if d == torch.float32]
    assert fp32 and all(("norm" in f) or (".router." in f) for f in fp32)
    assert any(".router." in f for f in fp32), "the tiny preset must have an MoE block"
    assert all(d == torch.bfloat16 for f, d in dtypes.items() if f not in fp32)
    # Interleaved in registration order, not one dtype after the other.
    order = [dtypes[f] for f in dtypes]
    changes = sum(a != b for a, b in zip(order, order[1:]))
    assert changes >= 4


def test_init_is_deterministic_per_seed():
    a, b = build_model(PRESETS["tiny"], seed=3), build_model(PRESETS["tiny"], seed=3)
    c = build_model(PRESETS["tiny"], seed=4)
    for (fqn, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), fqn
        if pa.ndim >= 2:
            assert not torch.equal(pa, pc), fqn


def test_forward_backward_in_mixed_dtypes_on_cpu():
    cfg = PRESETS["tiny"]
    model = build_model(cfg, seed=0)
    tokens = torch.randint(cfg.vocab_size, (2, cfg.seq_len))
    loss = model(tokens, tokens.roll(-1, dims=1))
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5  # near-uniform predictions at init
    loss.backward()
    for fqn, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, fqn
    assert model(tokens).shape == (2, cfg.seq_len, cfg.vocab_size)


def test_preset_sizes():
    def numel(preset: str) -> int:
        with torch.device("meta"):
            return count_params(GPT(PRESETS[preset]))

    assert numel("tiny") < 200_000
    assert 1.2e9 < numel("1b") < 1.4e9
    big = PRESETS["1b"]
    assert (big.d_model, big.num_layers, big.seq_len) == (2048, 24, 1024)


def test_model_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="num_heads"):
        model_config("tiny", num_heads=5)
    with pytest.raises(ValueError, match="unknown model preset"):
        model_config("huge")


def test_no_decay_for_vectors():
    model = build_model(PRESETS["tiny"], seed=0)
    for fqn, p in model.named_parameters():
        assert no_decay(fqn, p) == ({} if p.ndim >= 2 else {"weight_decay": 0.0})


# ------------------------------------------------------------------------------------- data


def test_samples_depend_only_on_their_index():
    task = MarkovTask(vocab_size=32, seq_len=16, seed=1)
    whole = task.samples(0, 10)
    assert whole.shape == (10, 17)
    assert torch.equal(task.samples(4, 3), whole[4:7])
    assert torch.equal(MarkovTask(vocab_size=32, seq_len=16, seed=1).samples(0, 10), whole)
    assert not torch.equal(MarkovTask(vocab_size=32, seq_len=16, seed=2).samples(0, 10), whole)
    # Every transition is one the chain allows.
    succ = task.successors
    for seq in whole:
        for a, b in zip(seq[:-1].tolist(), seq[1:].tolist()):
            assert b in succ[a].tolist()
    assert 0 < task.entropy_rate() < math.log(4)


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4, 6])
def test_ranks_split_the_same_global_batch(dp_size):
    task = MarkovTask(vocab_size=32, seq_len=8, seed=0)
    start = 5 * 12
    pieces = []
    for rank in range(dp_size):
        plan = BatchPlan(global_batch_size=12, dp_size=dp_size, dp_rank=rank, micro_batch_size=12 // dp_size)
        (x, y), = local_batches(task, plan, start)
        pieces.append(torch.cat([x, y[:, -1:]], dim=1))
    assert torch.equal(torch.cat(pieces), task.samples(start, 12))


def test_micro_batches_and_divisibility():
    plan = BatchPlan(global_batch_size=12, dp_size=2, dp_rank=1, micro_batch_size=2)
    assert plan.num_micro_batches == 3 and plan.local_range(24) == (30, 6)
    with pytest.raises(ValueError, match="not divisible by the DP size"):
        BatchPlan(global_batch_size=12, dp_size=5, dp_rank=0, micro_batch_size=1)
    with pytest.raises(ValueError, match="micro-batch"):
        BatchPlan(global_batch_size=12, dp_size=2, dp_rank=0, micro_batch_size=4)


# ---------------------------------------------------------------------------------- schedule


def test_lr_schedule_warmup_then_cosine():
    fn = lr_lambda(TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1))
    assert fn(0) == pytest.approx(0.1) and fn(9) == pytest.approx(1.0)
    assert fn(10) == pytest.approx(1.0)
    assert fn(55) == pytest.approx(0.55)
    assert fn(100) == pytest.approx(0.1) and fn(150) == pytest.approx(0.1)
    values = [fn(e) for e in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_train_config_validation():
    with pytest.raises(ValueError, match="stop-at"):
        TrainConfig(steps=5, stop_at=6)
    with pytest.raises(ValueError, match="needs --ckpt-dir"):
        TrainConfig(resume=True)


# ------------------------------------------------------------------------------ train.run


def _losses(log: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, log.read_text().splitlines())}


def _cfg(tmp: Path, log: str, **kw) -> TrainConfig:
    base = dict(steps=8, batch_size=12, ckpt_dir=str(tmp / "ckpt"), log_file=str(tmp / log),
                progress=False, lr=3e-3)
    return TrainConfig(**{**base, **kw})


def test_interrupted_run_resumes_bitwise_on_one_rank(tmp_path):
    ref = run(_cfg(tmp_path, "ref.jsonl", ckpt_dir=None))
    run(_cfg(tmp_path, "run.jsonl", save_every=3, stop_at=5))  # killed after 5, last save at 3
    assert checkpoint.latest(tmp_path / "ckpt").endswith("step_00000003")
    out = run(_cfg(tmp_path, "run.jsonl", save_every=3, resume=True, low_memory_resume=True))
    assert out["step"] == 8 and out["loss"] == ref["loss"]
    # The log lost steps 4-5 of the killed run, then got them again from the resumed run.
    resumed, reference = _losses(tmp_path / "run.jsonl"), _losses(tmp_path / "ref.jsonl")
    assert list(resumed) == list(range(1, 9))
    assert resumed == reference
    rows = [json.loads(r) for r in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert {"step", "loss", "lr", "tokens_per_s", "host_peak_rss_bytes"} <= set(rows[0])
    ref_rows = [json.loads(r) for r in (tmp_path / "ref.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == [r["lr"] for r in ref_rows]
    # --resume with nothing to do is not an error.
    assert run(_cfg(tmp_path, "run.jsonl", resume=True))["step"] == 8


def test_async_saves_resume_like_synchronous_ones(tmp_path):
    """--async-save: the run waits for its last save; resuming from it continues the same
    curve as an uninterrupted run."""
    ref = run(_cfg(tmp_path, "ref.jsonl", ckpt_dir=None))
    run(_cfg(tmp_path, "run.jsonl", save_every=2, stop_at=5, keep_last=2, async_save=True))
    assert checkpoint.latest(tmp_path / "ckpt").endswith("step_00000004")
    out = run(_cfg(tmp_path, "run.jsonl", save_every=2, resume=True, async_save=True))
    assert out["step"] == 8 and out["loss"] == ref["loss"]
    assert _losses(tmp_path / "run.jsonl") == _losses(tmp_path / "ref.jsonl")
    assert checkpoint.latest(tmp_path / "ckpt").endswith("step_00000008")


def test_async_save_snapshot_choices_are_the_checkpoint_ones(tmp_path):
    """``--async-save host`` reaches ``CheckpointConfig(snapshot=...)``; the CLI takes every
    choice of the library's and refuses another."""
    from shardopt import cli
    parser = cli.build_parser()
    for snapshot in checkpoint.SNAPSHOTS:
        assert parser.parse_args(["train", "--async-save", snapshot]).async_save == snapshot
    with pytest.raises(cli.CommandLineError, match="--async-save: invalid choice: 'disk'"):
        parser.parse_args(["train", "--async-save", "disk"])
    out = run(_cfg(tmp_path, "run.jsonl", save_every=2, stop_at=3, async_save=True,
                   async_snapshot="host"))
    assert out["step"] == 3 and checkpoint.latest(tmp_path / "ckpt").endswith("step_00000002")
    with pytest.raises(ValueError, match="--async-save takes one of host, got 'disk'"):
        _cfg(tmp_path, "x.jsonl", async_save=True, async_snapshot="disk")


def test_keep_last_and_fresh_start_with_empty_ckpt_dir(tmp_path):
    out = run(_cfg(tmp_path, "a.jsonl", steps=4, save_every=1, keep_last=2, resume=True))
    assert out["step"] == 4
    names = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*"))
    assert names == ["step_00000003", "step_00000004"]


def test_resume_rejects_a_checkpoint_of_another_model(tmp_path):
    run(_cfg(tmp_path, "a.jsonl", steps=1))
    with pytest.raises(ValueError):
        run(_cfg(tmp_path, "b.jsonl", steps=2, preset="small", resume=True))


def _train_rank(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    return run(cfg)


def test_resume_on_a_different_dp_size_follows_the_same_curve(tmp_path):
    cfg = dict(steps=6, save_every=3)
    run_distributed(_train_rank, 2, _cfg(tmp_path, "ref.jsonl", steps=6, ckpt_dir=None), tmp_path=tmp_path)
    run_distributed(_train_rank, 2, _cfg(tmp_path, "run.jsonl", stop_at=3, **cfg), tmp_path=tmp_path)
    run_distributed(_train_rank, 3, _cfg(tmp_path, "run.jsonl", resume=True, low_memory_resume=True, **cfg),
                    tmp_path=tmp_path)
    resumed, reference = _losses(tmp_path / "run.jsonl"), _losses(tmp_path / "ref.jsonl")
    assert list(resumed) == list(range(1, 7))
    for step in range(1, 4):
        assert resumed[step] == reference[step], step  # same ranks, same data: bitwise
    for step in range(4, 7):
        # Reductions over 3 ranks instead of 2: equal up to bf16 rounding, not bitwise.
        assert resumed[step] == pytest.approx(reference[step], rel=1e-2), step
    assert resumed[6] < resumed[1] - 0.2  # and it learns


def test_gradient_accumulation_matches_the_full_batch(tmp_path):
    run(_cfg(tmp_path, "full.jsonl", steps=4, ckpt_dir=None))
    run(_cfg(tmp_path, "micro.jsonl", steps=4, ckpt_dir=None, micro_batch_size=3))  # 4 micro-batches
    full, micro = _losses(tmp_path / "full.jsonl"), _losses(tmp_path / "micro.jsonl")
    assert full[1] == pytest.approx(micro[1], abs=1e-5)
    assert micro == pytest.approx(full, rel=1e-3)
