"""CPU smoke runs of megatron-core: send its hard-coded CUDA calls to the CPU.

megatron-core's DDP and distributed optimizer allocate on ``torch.cuda.current_device()`` or
``device="cuda"``, check ``param.type() == "torch.cuda.BFloat16Tensor"``, and order work with CUDA
streams and events. This module, installed in a rank process that runs on the CPU (gloo), makes those
calls land on the CPU so the benchmark's megatron code paths (construction, step, sharded state dicts,
dist_checkpointing) can be exercised on a machine without a GPU. It changes process-global state
(a ``TorchFunctionMode`` that stays entered, patched ``torch.cuda`` functions and ``Tensor.type``)
and is never used on a GPU run. Numbers from a shimmed run mean nothing.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _to_cpu(d):
    if isinstance(d, int) and not isinstance(d, bool):
        return _CPU
    if isinstance(d, str) and d.startswith("cuda"):
        return _CPU
    if isinstance(d, torch.device) and d.type == "cuda":
        return _CPU
    return d


class _CpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            args = (args[0], *(_to_cpu(a) if isinstance(a, (str, torch.device)) else a
                               for a in args[1:]))
        return func(*args, **kwargs)


class _Stream:
    def __init__(self, *a, **k) -> None:
        pass

    def wait_stream(self, *a) -> None:
        pass

    def wait_event(self, *a) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *a, **k):
        return _Event()


class _Event:
    def __init__(self, *a, **k) -> None:
        pass

    def record(self, *a) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *a) -> None:
        pass

    def query(self) -> bool:
        return True


_installed = False


def install() -> None:
    """Idempotent; call in a CPU rank process before importing megatron."""
    global _installed
    if _installed:
        return
    c = torch.cuda
    c.current_device = lambda: "cpu"
    c.current_stream = lambda *a, **k: _Stream()
    c.default_stream = lambda *a, **k: _Stream()
    c.Stream = _Stream
    c.Event = _Event
    c.stream = lambda *a, **k: contextlib.nullcontext()
    c.synchronize = lambda *a, **k: None
    c.empty_cache = lambda: None
    c.device_count = lambda: 1
    c.set_device = lambda *a: None
    c.get_device_capability = lambda *a: (9, 0)
    orig_type = torch.Tensor.type

    def _type(self, *a, **k):
        r = orig_type(self, *a, **k)
        if not a and not k and isinstance(r, str) and not r.startswith("torch.cuda."):
            return "torch.cuda." + r[len("torch."):]
        return r

    torch.Tensor.type = _type
    _CpuMode().__enter__()  # stays entered for the life of the (throwaway) process
    _installed = True
