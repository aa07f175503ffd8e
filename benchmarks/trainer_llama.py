"""One Hugging Face Trainer run on a Llama built from a config: ``ShardoptTrainer`` against the
Trainer with torch's fused AdamW (``optim="adamw_torch_fused"``), iteration time and peak memory.

The model is ``LlamaForCausalLM`` with hidden size 2048, 24 layers, intermediate size 5632, 32
heads (32 key/value heads), vocabulary 32000: 1.36B params, built from the config with seed 0
(no download). ``--param-dtype fp32`` (default) keeps fp32 params and trains under the
Trainer's ``bf16=True`` (bf16 autocast, as most Trainer users do); ``bf16`` casts the params
to bf16 (torch's AdamW then updates bf16 params directly, shardopt keeps fp32 main params).
Both runs see the same random tokens (``--seq`` per sequence, ``--micro-batch`` sequences per
process and iteration), ``max_grad_norm=1.0`` (the Trainer's default clipping), no
accumulation unless ``--accum``. Each system runs in a fresh process; an iteration is the time
between the ends of two optimizer steps (a device synchronisation at each), over ``--iters``
timed iterations after ``--warmup``; peak memory is the allocator's peak over the timed
iterations and over the whole run (which includes the first step's allocation of the
optimizer state).

GPU, 1 H200::

    PYTHONPATH=src python3 benchmarks/trainer_llama.py --out benchmarks/results/trainer_llama_1gpu.json

Several GPUs: one system per ``torchrun`` (rank 0 writes the file)::

    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/trainer_llama.py --system shardopt --out /tmp/s.json

CPU smoke (checks the code path only)::

    PYTHONPATH=src python benchmarks/trainer_llama.py --tiny --device cpu --out /tmp/trainer_llama_tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

SYSTEMS = ("shardopt", "torch")
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=24, intermediate_size=5632,
                num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
LLAMA_TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=256)


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=("both", *SYSTEMS), default="both")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama (CPU smoke)")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--micro-batch", type=int, default=None, help="default 8 (tiny: 2)")
    p.add_argument("--seq", type=int, default=None, help="default 1024 (tiny: 32)")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results/trainer_llama_1gpu_fp32.json")
    p.add_argument("--child-out", help=argparse.SUPPRESS)  # one system's result (internal)
    a = p.parse_args(argv)
    a.micro_batch = a.micro_batch or (2 if a.tiny else 8)
    a.seq = a.seq or (32 if a.tiny else 1024)
    if a.iters < 5 and not a.tiny:
        p.error("--iters must be at least 5")
    if a.warmup < 1:
        p.error("--warmup must be at least 1 (the first timed iteration starts at its end)")
    return a


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _one_system(a: argparse.Namespace, system: str) -> dict[str, Any]:
    """Run ``system`` in this process (under torchrun: on every rank)."""
    import transformers

    from shardopt.recipes.integrations.transformers import ShardoptTrainer

    device = torch.device(a.device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    shape = LLAMA_TINY if a.tiny else LLAMA_1B
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **shape, max_position_embeddings=a.seq))
    if a.param_dtype == "bf16":
        model = model.to(torch.bfloat16)
    num_params = sum(p.numel() for p in model.parameters())
    steps = a.warmup + a.iters
    data = _Tokens(steps * a.accum * a.micro_batch * world_size, a.seq, shape["vocab_size"])

    class Clock(transformers.TrainerCallback):
        """The end of every optimizer step, and the allocator's peaks around the warm-up."""

        def __init__(self) -> None:
            self.ends: list[float] = []
            self.peak_warmup: dict[str, int] = {}

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            _common.cuda_sync(device)
            self.ends.append(time.perf_counter())
            if state.global_step == a.warmup and device.type == "cuda":
                self.peak_warmup = {"allocated": torch.cuda.max_memory_allocated(device),
                                    "reserved": torch.cuda.max_memory_reserved(device)}
                torch.cuda.reset_peak_memory_stats(device)

    clock = Clock()
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="trainer_llama_"), use_cpu=device.type == "cpu",
        bf16=True, max_steps=steps, per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=a.accum, learning_rate=3e-4, weight_decay=0.1,
        adam_beta2=0.95, max_grad_norm=1.0, warmup_steps=0, lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        dataloader_num_workers=0, optim="adamw_torch_fused")
    cls = ShardoptTrainer if system == "shardopt" else transformers.Trainer
    trainer = cls(model=model, args=args, train_dataset=data, callbacks=[clock])
    trainer.train()
    times = [b - e for b, e in zip(clock.ends[a.warmup:], clock.ends[a.warmup - 1:])]
    out: dict[str, Any] = {
        "system": system, "num_params": num_params,
        "iteration_s": _common.stats(times), "iteration_s_all": times,
        "tokens_per_s_per_process": a.accum * a.micro_batch * a.seq
        / _common.stats(times)["median"],
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "grad_norms": [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e],
    }
    if device.type == "cuda":
        timed = {"allocated": torch.cuda.max_memory_allocated(device),
                 "reserved": torch.cuda.max_memory_reserved(device)}
        out["peak_memory_bytes"] = {"timed": timed, "run": {
            k: max(v, clock.peak_warmup.get(k, 0)) for k, v in timed.items()}}
    return out


def _commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=Path(__file__).parent).stdout
        return head + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.child_out is not None:  # one system, in a fresh process
        result = _one_system(a, a.system)
        if int(os.environ.get("RANK", "0")) == 0:
            _common.write_json(a.child_out, result)
        return 0
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    systems = SYSTEMS if a.system == "both" else (a.system,)
    if world_size > 1 and len(systems) > 1:
        raise SystemExit("under torchrun pass --system shardopt or --system torch (one per run)")
    results: dict[str, Any] = {}
    for system in systems:
        if world_size > 1:
            results[system] = _one_system(a, system)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            child = Path(tmp) / "result.json"
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                   "--system", system, "--child-out", str(child)]
            proc = subprocess.run(cmd)
            results[system] = json.loads(child.read_text()) if proc.returncode == 0 and \
                child.exists() else {"error": f"exit status {proc.returncode}"}
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    doc = _common.run_header(torch.device(a.device), {
        "model": "LlamaForCausalLM", "shape": LLAMA_TINY if a.tiny else LLAMA_1B,
        "param_dtype": a.param_dtype, "autocast": "bf16", "seq": a.seq,
        "micro_batch": a.micro_batch, "accum": a.accum, "warmup": a.warmup, "iters": a.iters,
        "max_grad_norm": 1.0, "reference": "transformers.Trainer, optim=adamw_torch_fused"})
    doc.update(commit=_commit(), world_size=world_size, results=results)
    for v in ("transformers", "accelerate"):
        doc["versions"][v] = _common._package_version(v)
    ours, ref = results.get("shardopt", {}), results.get("torch", {})
    if "iteration_s" in ours and "iteration_s" in ref:
        doc["shardopt_over_torch"] = {
            "iteration_median": ours["iteration_s"]["median"] / ref["iteration_s"]["median"]}
        if "peak_memory_bytes" in ours and "peak_memory_bytes" in ref:
            for phase in ("timed", "run"):
                for kind in ("allocated", "reserved"):
                    doc["shardopt_over_torch"][f"peak_{kind}_{phase}"] = (
                        ours["peak_memory_bytes"][phase][kind] / ref["peak_memory_bytes"][phase][kind])
    _common.write_json(a.out, doc)
    rows = [(s, r.get("num_params"), *(r["iteration_s"][k] * 1e3 for k in ("median", "min", "max")),
             *(r.get("peak_memory_bytes", {}).get("timed", {}).get(k, 0) / _common.GIB
               for k in ("allocated", "reserved")))
            for s, r in results.items() if "iteration_s" in r]
    print(_common.format_table(rows, ("system", "params", "iter ms median", "min", "max",
                                      "peak alloc GiB", "peak reserved GiB")))
    print(f"wrote {a.out}")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
