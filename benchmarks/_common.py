"""Helpers shared by the benchmark scripts: run metadata, statistics, memory probes, result files.

Every benchmark writes one JSON document that starts with :func:`run_header` (date, commit, GPU,
torch and peer versions, the exact command) so a number can always be traced to the run that produced it.
Repeated timings are summarised with :func:`stats` (min / median / max, never a mean alone).

Memory probes:

* :class:`HostRssSampler` — a thread sampling this process's resident set size (``/proc/self/statm``)
  every millisecond or so, for the peak host memory of a phase (e.g. a checkpoint load).
* :class:`MemoryTimeline` — GPU allocator figures at named events. Each event records the current
  allocated/reserved bytes and the peak of both since the previous event, then resets the peak, so
  the peak of a phase (an iteration, a load) is the max over its events: exactly what
  ``torch.cuda.reset_peak_memory_stats()`` at the phase start followed by ``max_memory_*()`` at its end
  would give. On CPU every GPU figure is 0 (smoke runs only check that the code paths work).

Models (``--model``): ``gpt``, the reference job's GPT (``shardopt.recipes``), and ``hf-llama``,
Hugging Face's ``LlamaForCausalLM`` built from a config (:data:`HF_LLAMA_PRESETS`; nothing is
downloaded), behind the same ``model(inputs, labels) -> loss`` call (:class:`HFLlama`), so
that a benchmark's loop runs either. :func:`build_model` and :func:`make_batches` pick by name.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

GIB = float(1 << 30)
MIB = float(1 << 20)
PEER_PACKAGES = ("megatron-core", "safetensors", "numpy", "xxhash", "triton")


# ----------------------------------------------------------------------------- metadata
def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    if name == "megatron-core":  # a --target install without dist-info still has package_info
        try:
            from megatron.core import package_info  # type: ignore[import-not-found]

            return str(package_info.__version__)
        except Exception:  # noqa: BLE001 - absent or broken: reported as missing
            return None
    return None


def command_line() -> str:
    """The exact command that started this process, as it could be pasted into a shell."""
    env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("PYTHONPATH",) if k in os.environ)
    cmd = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    return f"{env} {cmd}".strip()


def device_description(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"type": device.type, "name": platform.processor() or platform.machine(),
                "count": 1}
    props = torch.cuda.get_device_properties(device)
    return {
        "type": "cuda",
        "name": props.name,
        "count": torch.cuda.device_count(),
        "memory_gib": round(props.total_memory / GIB, 2),
        "capability": f"{props.major}.{props.minor}",
        "driver_cuda": torch.version.cuda,
    }


def commit() -> str | None:
    """The code a run measures: ``SHARDOPT_COMMIT`` if set (for a copy of the tree whose git
    metadata is missing or stale), else ``git describe --always --dirty`` of this checkout,
    else None."""
    if os.environ.get("SHARDOPT_COMMIT"):
        return os.environ["SHARDOPT_COMMIT"]
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def run_header(device: torch.device, config: dict[str, Any]) -> dict[str, Any]:
    """What every result file starts with."""
    import shardopt

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "command": command_line(),
        "device": device_description(device),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "shardopt": getattr(shardopt, "__version__", None),
            **{p: _package_version(p) for p in PEER_PACKAGES},
        },
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "config": config,
    }


# ----------------------------------------------------------------------------- statistics
def timed_parts(owner: Any, names: Iterable[str], log: list, also: Iterable[Any] = ()) -> None:
    """Wrap ``owner``'s functions ``names`` (a module or a class) so that each call appends
    ``(name, start, end)`` (``time.perf_counter``) to ``log``; modules in ``also`` that
    imported one of them by name get the wrapper too."""
    for name in names:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                log.append((_name, t0, time.perf_counter()))
        setattr(owner, name, timed)
        for other in also:
            if getattr(other, name, None) is fn:
                setattr(other, name, timed)


def cuda_time_ms(fn, repeats: int, warmup: int = 3) -> dict[str, float]:
    """``stats`` of ``repeats`` calls of ``fn`` on the current CUDA device, each timed alone by
    CUDA events (it starts on an idle GPU), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return stats(times)


def stats(values: Sequence[float]) -> dict[str, float]:
    """min / median / max (and the count) of repeated measurements."""
    if not values:
        raise ValueError("no measurements to summarise")
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "n": len(values)}


def within(value: float, limit: float, tolerance: float = 0.01) -> bool:
    """``value <= limit`` allowing ``tolerance`` (relative) of measurement noise."""
    return value <= limit * (1.0 + tolerance)


# ----------------------------------------------------------------------------- files
def write_json(path: str | os.PathLike, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj)
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")


def format_table(rows: Iterable[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain-text table (right-aligned numbers), for the summary printed at the end of a run."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if n and _numeric(c) else c.ljust(w)
                               for c, w in zip(row, widths)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return "-" if v is None else str(v)


def _numeric(s: str) -> bool:
    try:
        float(s.rstrip("%x"))
        return True
    except ValueError:
        return False


# ----------------------------------------------------------------------------- host memory
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def host_rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc``; falls back to ru_maxrss)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class HostRssSampler:
    """Peak host RSS while the ``with`` block runs, sampled by a thread every ``interval_s``.

    ``growth_bytes`` is the peak minus the RSS at entry. Sampling can miss a spike shorter than
    the interval; ``ru_maxrss`` (the lifetime peak, which only rises) is recorded beside it as a
    cross-check: if it rose during the block, the block's true peak is at least that.
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.start_bytes = 0
        self.peak_bytes = 0
        self.end_bytes = 0
        self.ru_maxrss_before = 0
        self.ru_maxrss_after = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> HostRssSampler:
        self.ru_maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.start_bytes = self.peak_bytes = host_rss_bytes()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = host_rss_bytes()
            self.samples += 1
            if rss > self.peak_bytes:
                self.peak_bytes = rss
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.end_bytes = host_rss_bytes()
        self.peak_bytes = max(self.peak_bytes, self.end_bytes)
        self.ru_maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if self.ru_maxrss_after > self.ru_maxrss_before:
            # The lifetime peak was set inside the block: the block peaked at least that high.
            self.peak_bytes = max(self.peak_bytes, self.ru_maxrss_after)

    @property
    def growth_bytes(self) -> int:
        return self.peak_bytes - self.start_bytes

    def as_dict(self) -> dict[str, int]:
        return {"start_bytes": self.start_bytes, "peak_bytes": self.peak_bytes,
                "end_bytes": self.end_bytes, "growth_bytes": self.growth_bytes,
                "samples": self.samples}


# ----------------------------------------------------------------------------- GPU memory
@dataclass
class MemoryEvent:
    """Allocator figures at one event; ``peak_*`` is the peak since the previous event."""

    phase: str
    event: str
    t_s: float
    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int


@dataclass
class MemoryTimeline:
    """Named events of one process on one device (see the module docstring)."""

    device: torch.device
    events: list[MemoryEvent] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def mark(self, phase: str, event: str = "end") -> MemoryEvent:
        """Record the figures for ``event`` of ``phase``; starts a new peak window."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            ev = MemoryEvent(phase, event, time.perf_counter() - self.t0,
                             torch.cuda.memory_allocated(self.device),
                             torch.cuda.memory_reserved(self.device),
                             torch.cuda.max_memory_allocated(self.device),
                             torch.cuda.max_memory_reserved(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            ev = MemoryEvent(phase, event, time.perf_counter() - self.t0, 0, 0, 0, 0)
        self.events.append(ev)
        return ev

    def reset_window(self) -> None:
        """Start a new peak window without recording (e.g. after untimed setup)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def phase_peaks(self) -> dict[str, dict[str, int]]:
        """Peak allocated/reserved of every phase, in the order phases first appear."""
        out: dict[str, dict[str, int]] = {}
        for ev in self.events:
            p = out.setdefault(ev.phase, {"peak_allocated": 0, "peak_reserved": 0,
                                          "end_allocated": 0, "end_reserved": 0})
            p["peak_allocated"] = max(p["peak_allocated"], ev.peak_allocated)
            p["peak_reserved"] = max(p["peak_reserved"], ev.peak_reserved)
            p["end_allocated"], p["end_reserved"] = ev.allocated, ev.reserved
        return out

    def as_list(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.events]


def cuda_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- models
MODELS = ("gpt", "hf-llama")

# LlamaConfig fields per preset. "1b": 1,345,423,360 params (1.35B; 64 layers: 3.37B), bf16,
# SDPA attention, untied embeddings, as a Llama of that size is trained.
HF_LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "1b": {"hidden_size": 2048, "intermediate_size": 5504, "num_hidden_layers": 24,
           "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000,
           "max_position_embeddings": 1024},
    "tiny": {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 64,
             "max_position_embeddings": 64},
}


class HFLlama(torch.nn.Module):
    """A ``LlamaForCausalLM`` (``self.lm``) called as the benchmarks call a model:
    ``model(input_ids, labels)`` returns the loss. Labels are the inputs, as for any Hugging
    Face causal LM (it shifts them itself). With ``attention_mask`` (the default) every call
    passes an all-ones mask, as a tokenizer's batches carry one: the model then checks on the
    host whether the mask can be skipped (``padding_mask.all()`` in ``masking_utils``, a read
    of a GPU value early in every forward), as a training loop over real data does."""

    def __init__(self, lm: torch.nn.Module, attention_mask: bool = True) -> None:
        super().__init__()
        self.lm = lm
        self.attention_mask = attention_mask
        self._masks: dict[tuple, torch.Tensor] = {}  # not state: no buffer, no param

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = None
        if self.attention_mask:
            key = (tuple(input_ids.shape), input_ids.device)
            if key not in self._masks:
                self._masks[key] = torch.ones_like(input_ids)
            mask = self._masks[key]
        return self.lm(input_ids=input_ids, attention_mask=mask, labels=labels).loss


def hf_llama_config(preset: str, num_layers: int | None = None):
    """The ``LlamaConfig`` of ``preset`` (``num_layers`` replaces its layers)."""
    from transformers import LlamaConfig

    if preset not in HF_LLAMA_PRESETS:
        raise ValueError(f"no hf-llama preset {preset!r}; have {sorted(HF_LLAMA_PRESETS)}")
    fields = dict(HF_LLAMA_PRESETS[preset])
    if num_layers:
        fields["num_hidden_layers"] = num_layers
    return LlamaConfig(**fields, tie_word_embeddings=False, attn_implementation="sdpa")


def build_hf_llama(preset: str, device: torch.device, seed: int = 0,
                   num_layers: int | None = None, attention_mask: bool = True) -> HFLlama:
    """:class:`HFLlama` of ``preset``, bf16, its weights drawn on ``device`` (Hugging Face's
    own initialisation) from ``seed``."""
    from transformers import LlamaForCausalLM

    config = hf_llama_config(preset, num_layers)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy first
    try:
        with torch.device(device):
            lm = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return HFLlama(lm, attention_mask)


def build_model(model: str, preset: str, device: torch.device, seed: int = 0,
                num_layers: int | None = None) -> torch.nn.Module:
    """The benchmark model ``model`` (one of :data:`MODELS`) of ``preset`` on ``device``."""
    if model == "hf-llama":
        return build_hf_llama(preset, device, seed, num_layers)
    if model != "gpt":
        raise ValueError(f"unknown model {model!r}; have {MODELS}")
    import _peers

    return _peers.build_gpt(preset, device, seed,
                            **({"num_layers": num_layers} if num_layers else {}))


def make_batches(model: str, preset: str, rank: int, world: int, micro_batch: int, num: int,
                 device: torch.device, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num`` micro-batches ``(inputs, labels)`` of this rank for ``model``: the Markov task
    of ``_peers`` over the model's vocabulary and sequence length (for ``hf-llama`` the labels
    are the inputs: the model shifts them)."""
    import _peers

    if model == "gpt":
        return _peers.make_batches(preset, rank, world, micro_batch, num, device, seed)
    config = hf_llama_config(preset)
    pairs = _peers.markov_batches(config.vocab_size, config.max_position_embeddings, rank,
                                  world, micro_batch, num, device, seed)
    return [(x, x) for x, _ in pairs]


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
