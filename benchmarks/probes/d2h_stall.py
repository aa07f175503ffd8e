"""Why a small host read waits behind an asynchronous save's device-to-host copies, and which
way of copying avoids it.

A read of a GPU value on the host (``.item()``, ``if mask.any():``, Hugging Face's check of
the attention mask in every forward) is a 1-byte copy to pageable host memory on the current
stream, then a stream synchronize. While a save's snapshot copies gigabytes to page-locked
host memory on a side stream, such a read can wait for much of that copy, and training waits
with it. This probe copies ``--gib`` GiB (18 by default, a 1.3B model's optimizer state at
DP 1) from a device buffer into one page-locked host buffer of the kind the snapshot uses
(``shardopt.pinned.PinnedBuffer``, shared memfd, ``cudaHostRegister``; allocated once, as is
the source and a spare device buffer of the same size) by each way of ``_d2h_copies`` and
measures, ``--reps`` times each (5; medians with min and max):

* ``idle``: on an otherwise idle GPU, host reads one after another (1 ms apart) for as long
  as the copy runs: the latency of the first read (queued right behind the whole copy), of
  the longest, their sum (``blocked_s``), and the copy's GB/s and seconds on the GPU (CUDA
  events from its start to its last byte; with a device copy first, that and the drain
  apart). Read kinds: ``item`` (pageable, as ``.item()``), ``pinned`` (a 1-element copy into
  page-locked memory on the current stream, then a stream synchronize: whether the copy
  engine's queue is what waits), ``sync`` (a small kernel and a stream synchronize, no copy:
  whether the training stream itself is held up), ``high`` (as ``item``, the read's kernel and
  copy on a stream of the highest priority: whether a priority reaches the copy engine).
* ``iter``: Hugging Face's ``LlamaForCausalLM`` of 1.35B params (``_common.build_hf_llama``:
  bf16, SDPA, an all-ones attention mask, whose check reads the GPU on the host early in
  every forward), ``--accumulate`` micro-batches of ``--micro-batch`` x 1024 tokens
  (forward, backward; no optimizer step: the copy's source is a buffer of its own), each
  micro-batch led by an explicit ``if (input_ids < 0).any():``. Every iteration starts on an
  idle GPU and ends when the training stream has run all of it (as a loop that reads its loss
  waits; the copy may go on). Each repetition runs one iteration without a copy and one that
  starts the copy first, as a save called at the iteration's start does; the slowdown is the
  iteration with the copy minus the median of those without. Every host read of a GPU value
  in the iteration is timed (``Tensor.__bool__`` and ``Tensor.item`` wrapped): each read's
  wait (``read_waits_s``), the first, the longest and their sum; and the copy's GB/s and
  seconds from its start to its last byte (with a device copy first, the drain's apart).
  ``/no_reads``: no mask and no explicit read, for the slowdown the copy costs by bandwidth
  alone.

Every repetition fills the source with a new pattern and checks the host copy at 80 places
(``data_ok``). Steps run in the order of ``_d2h_plan.PLAN`` (most wanted first), or of
``--ways``: way names (each with its steps in ``PLAN``, or its iteration step where it has none),
groups (``paced``: the paced drains during the iteration and the high-priority read) or single
steps as the result names them (``idle:queued_256m:high``, ``iter:paced_1m_1``,
``iter:kernel_16/no_reads``); a step whose estimated time does not fit in what is left of
``--budget-s`` is skipped and listed in ``skipped``.
The result (``d2h_stall_1gpu<--tag>.json`` in ``--out``) records the date, commit, command, GPU,
driver, copy engines (``asyncEngineCount`` through cuda-bindings or cupy where installed),
stream priorities and torch version; a table is printed at the end.

GPU (one H200; about 4 minutes, most of it the model iterations)::

    PYTHONPATH=src python3 benchmarks/probes/d2h_stall.py --out benchmarks/results

The paced drains during the iteration, from the source and after a device copy, and a read on
a high-priority stream (one H200, about 2 minutes with setup)::

    PYTHONPATH=src python3 benchmarks/probes/d2h_stall.py --ways paced --budget-s 105 \
        --tag _drain --out benchmarks/results

CPU (code paths only, the copy kernel in Triton's interpreter; the numbers mean nothing)::

    PYTHONPATH=src python benchmarks/probes/d2h_stall.py --device cpu --tiny --reps 2 --out /tmp
    PYTHONPATH=src python benchmarks/probes/d2h_stall.py --dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import _common  # noqa: E402
import _d2h_copies as copies  # noqa: E402
from _d2h_copies import GIB, MIB, Strategy  # noqa: E402
from _d2h_plan import GROUPS, PLAN, plan  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Reader:
    """One host read of a GPU value of ``kind`` (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.flag = torch.zeros(1 << 10, device=device)
        self.pinned = torch.empty(1, dtype=torch.bool, pin_memory=device.type == "cuda")
        self.high = copies.side_stream(device, "high")

    def read(self, kind: str) -> None:
        if kind == "high":
            with copies.on(self.high):
                bool((self.flag != 0).any())
            return
        hit = (self.flag != 0).any()
        if kind == "item":
            bool(hit)
        elif kind == "pinned":
            self.pinned.copy_(hit.view(1), non_blocking=True)
            _stream_sync(self.device)
        else:
            _stream_sync(self.device)


def _stream_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class _ReadTimer:
    """Times every ``Tensor.__bool__`` and ``Tensor.item`` of a tensor on ``device`` while
    ``log`` is a list."""

    def __init__(self, device: torch.device) -> None:
        self.log: list[float] | None = None
        self.saved = {k: torch.Tensor.__dict__.get(k) for k in ("__bool__", "item")}
        for name in self.saved:
            orig = getattr(torch.Tensor, name)

            def timed(t, *a, _orig=orig):
                if self.log is None or t.device.type != device.type:
                    return _orig(t, *a)
                t0 = time.perf_counter()
                try:
                    return _orig(t, *a)
                finally:
                    self.log.append(time.perf_counter() - t0)
            setattr(torch.Tensor, name, timed)

    def remove(self) -> None:
        for name, orig in self.saved.items():
            if orig is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, orig)


class Probe:
    def __init__(self, a: argparse.Namespace, device: torch.device, kernels: bool) -> None:
        from shardopt.pinned import PinnedBuffer

        self.a, self.device, self.seed = a, device, 0
        self.nbytes = int(a.gib * GIB) // MIB * MIB
        t0 = time.perf_counter()
        self.src = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        spare = None if a.no_d2d else torch.empty_like(self.src)
        self.pinned = PinnedBuffer(self.nbytes, torch.uint8, shared=True)
        view, self.view_how = copies.cuda_view(self.pinned.tensor, device)
        self.buf = copies.Buffers(self.src, self.pinned.tensor, spare, view)
        self.alloc_s = time.perf_counter() - t0
        self.model = _common.build_hf_llama("tiny" if a.tiny else "1b", device)
        self.batches = _common.make_batches("hf-llama", "tiny" if a.tiny else "1b", 0, 1,
                                            a.micro_batch, a.accumulate, device)
        self.reader, self.timer = _Reader(device), _ReadTimer(device)
        self.kernel_check = self._kernel_warmup() if kernels else "no copy kernel planned"
        copies.STRATEGIES["queued_256m"].start(self.buf, device).wait()  # every page written once
        for _ in range(2):
            self._iteration(True)
        self.iter_s = statistics.median(self._timed_iteration(True) for _ in range(3))
        self.gbps: dict[str, float] = {}

    def _kernel_warmup(self) -> str:
        """Compile the copy kernel and check it on 1 MiB, device to host and device to device."""
        if copies.triton_kernel() is None:
            return "no Triton"
        n = min(MIB, self.nbytes)
        copies.fill(self.src[:n], 7)
        for dst in (self.buf.dst_view, self.buf.spare):
            if dst is not None:
                copies.kernel_copy(dst[:n], self.src[:n], 4)
        _sync(self.device)
        ok = copies.check(self.buf.dst[:n], 7) if self.buf.dst_view is not None else None
        ok_d2d = (torch.equal(self.buf.spare[:n].cpu(), self.src[:n].cpu())
                  if self.buf.spare is not None else None)
        return f"to host ok: {ok}, device to device ok: {ok_d2d}"

    def _iteration(self, reads: bool) -> None:
        self.model.attention_mask = reads
        for x, y in self.batches:
            if reads and (x < 0).any():
                raise ValueError("negative token ids")
            (self.model(x, y) / len(self.batches)).backward()
        self.model.zero_grad(set_to_none=True)

    def _timed_iteration(self, reads: bool) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        self._iteration(reads)
        _stream_sync(self.device)
        return time.perf_counter() - t0

    def buffers(self, gib: float) -> copies.Buffers:
        if not gib or gib * GIB >= self.nbytes:
            return self.buf
        n = int(gib * GIB)
        cut = lambda t: None if t is None else t[:n]  # noqa: E731
        return copies.Buffers(self.src[:n], self.buf.dst[:n], cut(self.buf.spare),
                              cut(self.buf.dst_view))

    def _start(self, s: Strategy, buf: copies.Buffers):
        self.seed += 1
        copies.fill(buf.src, self.seed)
        _sync(self.device)
        t0 = time.perf_counter()
        run = s.start(buf, self.device)
        return run, t0, time.perf_counter() - t0

    def _finish(self, run, buf: copies.Buffers, row: dict) -> dict:
        run.wait()
        copy = buf.dst if run.s.how != "none" else buf.spare  # d2d_only: no drain
        row.update(run.timings(), data_ok=copies.check(copy, self.seed), kernel=run.kernel)
        row["gbps"] = buf.src.numel() / row["copy_s"] / 1e9 if row["copy_s"] > 0 else None
        return row

    def idle_rep(self, s: Strategy, kind: str, buf: copies.Buffers) -> dict:
        run, t0, call_s = self._start(s, buf)
        reads = []
        while True:
            done = run.done()
            r0 = time.perf_counter()
            self.reader.read(kind)
            reads.append(time.perf_counter() - r0)
            if done:
                break
            time.sleep(1e-3)
        row = {"call_s": call_s, "first_read_s": reads[0], "max_read_s": max(reads),
               "blocked_s": sum(reads), "reads": len(reads)}
        row = self._finish(run, buf, row)
        row["wall_s"] = time.perf_counter() - t0
        return row

    def iter_rep(self, s: Strategy, reads: bool, buf: copies.Buffers) -> dict:
        quiet = self._timed_iteration(reads)
        run, t0, call_s = self._start(s, buf)
        self.timer.log = []
        self._iteration(reads)
        _stream_sync(self.device)  # the training stream only, as a loop reading its loss
        iter_s = time.perf_counter() - t0
        log, self.timer.log = self.timer.log, None
        row = {"quiet_iter_s": quiet, "iter_s": iter_s, "call_s": call_s,
               "copy_done_in_iter": run.done(), "reads": len(log), "read_waits_s": log,
               "first_read_s": log[0] if log else None,
               "max_read_s": max(log) if log else None, "reads_s": sum(log)}
        return self._finish(run, buf, row)


def _summary(rows: list[dict], keys: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(rows), "data_ok": all(r["data_ok"] for r in rows),
                           "kernel": rows[0]["kernel"]}
    for k in keys:
        values = [r[k] for r in rows if r.get(k) is not None]
        if values:
            out[k] = _common.stats(values)
    return out


def _estimate(probe: Probe, part: str, name: str, gib: float) -> float:
    nbytes = min(probe.nbytes, gib * GIB) if gib else probe.nbytes
    gbps = probe.gbps.get(name) or probe.gbps.get(name.removeprefix("d2d+"), 15.0)
    copy_s = nbytes / (gbps * 1e9) + 0.05
    per_rep = copy_s if part == "idle" else 2 * probe.iter_s + max(0.0, copy_s - probe.iter_s)
    return probe.a.reps * (per_rep + 0.1)


def _reps(rep, reps: int, deadline: float) -> list[dict]:
    """``reps`` repetitions of ``rep()``, fewer if the next would end past ``deadline``
    (``time.perf_counter``): a way slower than estimated is cut short, not the run."""
    rows: list[dict] = []
    while len(rows) < reps:
        t0 = time.perf_counter()
        rows.append(rep())
        if time.perf_counter() + (time.perf_counter() - t0) > deadline:
            break
    return rows


def run(a: argparse.Namespace, device: torch.device, started: float) -> dict[str, Any]:
    steps = plan(a.ways)
    probe = Probe(a, device, any(copies.STRATEGIES[p[1]].how == "kernel" for p in steps))
    out: dict[str, Any] = {"setup_s": time.perf_counter() - started, "alloc_s": probe.alloc_s,
                           "copy_bytes": probe.nbytes, "dst_view": probe.view_how,
                           "kernel_check": probe.kernel_check, "quiet_iter_s": probe.iter_s,
                           "parameters": _common.param_count(probe.model),
                           "idle": {}, "iter": {}, "skipped": []}
    for part, name, mode, gib in steps:
        s = copies.STRATEGIES[name]
        if a.tiny:  # the same number of pieces as at 18 GiB
            s = dataclasses.replace(s, piece=max(4096, s.piece * probe.nbytes // (18 * GIB)
                                                 // 4096 * 4096))
        key = name if part == "idle" and mode == "item" else (
            f"{name}:{mode}" if part == "idle" else name + ("" if mode else "/no_reads"))
        left = a.budget_s - (time.perf_counter() - started)
        est = _estimate(probe, part, name, gib)
        if s.d2d and probe.buf.spare is None or s.how == "uva" and probe.buf.dst_view is None:
            out["skipped"].append({"step": f"{part}:{key}", "why": "needs spare memory or "
                                   "the CUDA view of pinned memory"})
            continue
        if est > left:
            out["skipped"].append({"step": f"{part}:{key}", "estimated_s": est, "left_s": left})
            continue
        buf = probe.buffers(gib)
        rep = probe.idle_rep if part == "idle" else probe.iter_rep
        try:
            rows = _reps(lambda: rep(s, mode, buf), a.reps, a.budget_s + started)
            if part == "idle":
                res = _summary(rows, ("first_read_s", "max_read_s", "blocked_s", "copy_s",
                                      "d2d_s", "drain_s", "gbps", "call_s", "wall_s"))
                probe.gbps.setdefault(name, res["gbps"]["median"])
            else:
                quiet = statistics.median(r["quiet_iter_s"] for r in rows)
                for r in rows:
                    r["slowdown_s"] = r["iter_s"] - quiet
                res = _summary(rows, ("slowdown_s", "iter_s", "quiet_iter_s", "first_read_s",
                                      "max_read_s", "reads_s", "copy_s", "d2d_s", "drain_s",
                                      "gbps", "call_s"))
                probe.gbps.setdefault(name, res["gbps"]["median"])
                res["slowdown_fraction"] = res["slowdown_s"]["median"] / quiet
                res["copy_done_in_iter"] = sum(r["copy_done_in_iter"] for r in rows)
                res["reads_per_iter"] = rows[0]["reads"]
        except Exception as e:  # noqa: BLE001 - a way that fails is a result; the rest go on
            probe.timer.log = None
            _sync(device)  # nothing of it runs into the next way
            out[part][key] = {"error": f"{type(e).__name__}: {e}"}
            print(f"[{part}:{key}] FAILED: {e!r}", flush=True)
            continue
        res.update(strategy=dataclasses.asdict(s), gib=buf.src.numel() / GIB, rows=rows,
                   cut_short=len(rows) < a.reps)
        out[part][key] = res
        print(f"[{part}:{key}] " + _line(part, res), flush=True)
    probe.timer.remove()
    return out


def _ms(stat: dict | None) -> str:
    if not stat:
        return "-"
    return f"{1e3 * stat['median']:.1f} [{1e3 * stat['min']:.1f}-{1e3 * stat['max']:.1f}]"


def _line(part: str, r: dict) -> str:
    gbps = f"{r['gbps']['median']:.1f} GB/s" if "gbps" in r else "-"
    if part == "idle":
        return (f"{gbps}, copy {_ms(r.get('copy_s'))} ms, first read {_ms(r.get('first_read_s'))}"
                f" ms, longest read {_ms(r.get('max_read_s'))} ms")
    return (f"slowdown {_ms(r.get('slowdown_s'))} ms ({100 * r['slowdown_fraction']:.1f}%), "
            f"reads: first {_ms(r.get('first_read_s'))}, longest {_ms(r.get('max_read_s'))}, "
            f"summed {_ms(r.get('reads_s'))} ms; {gbps}, copy {_ms(r.get('copy_s'))} ms, "
            f"drain {_ms(r.get('drain_s'))} ms")


def _table(out: dict[str, Any]) -> str:
    names = list(dict.fromkeys([*out["idle"], *out["iter"]]))
    rows = []
    for k in names:
        i, t = out["idle"].get(k, {}), out["iter"].get(k, {})
        rows.append([k, f"{i['gbps']['median']:.1f}" if "gbps" in i else "-",
                     _ms(i.get("first_read_s")), _ms(i.get("max_read_s")),
                     _ms(t.get("slowdown_s")),
                     f"{100 * t['slowdown_fraction']:.1f}%" if "slowdown_fraction" in t else "-",
                     _ms(t.get("first_read_s")), _ms(t.get("max_read_s")),
                     _ms(t.get("reads_s")),
                     f"{t['gbps']['median']:.1f}" if "gbps" in t else "-",
                     _ms(t.get("copy_s")), _ms(t.get("d2d_s") or i.get("d2d_s"))])
    return _common.format_table(rows, ["way", "idle GB/s", "idle 1st read ms",
                                       "idle longest ms", "iter slowdown ms", "of iter",
                                       "iter 1st read ms", "iter longest ms",
                                       "iter reads ms", "iter GB/s", "iter copy ms", "d2d ms"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true",
                   help="the tiny Llama and 16 MiB of copies (CPU checks of the code paths)")
    p.add_argument("--gib", type=float, default=None, help="GiB copied (18; 1/64 with --tiny)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=None, help="sequences (8; 2 with --tiny)")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per iteration")
    p.add_argument("--budget-s", type=float, default=270.0,
                   help="seconds for the whole run, setup included; steps that would not "
                        "fit are skipped")
    p.add_argument("--ways", "--only", dest="ways", default="",
                   help="comma-separated ways, steps (idle:NAME[:KIND], iter:NAME[/no_reads]) "
                        f"or groups ({', '.join(GROUPS)}) to run, in that order (default: all)")
    p.add_argument("--tag", default="", help="suffix of the result file's name")
    p.add_argument("--no-d2d", action="store_true", help="no spare device buffer")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args(argv)
    a.gib = a.gib if a.gib is not None else (1 / 64 if a.tiny else 18.0)
    a.micro_batch = a.micro_batch or (2 if a.tiny else 8)
    if a.reps < 1:
        p.error("--reps must be at least 1")
    try:
        steps = plan(a.ways)
    except ValueError as e:
        p.error(str(e))
    if a.dry_run:
        for part, name, mode, gib in steps:
            print(part, name, mode, f"{gib} GiB" if gib else "", copies.STRATEGIES[name])
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; use --device cpu --tiny for a check of the code paths")
    if a.device == "cpu":  # the copy kernel runs in Triton's interpreter (set before import)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    started = time.perf_counter()
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = run(a, device, started)
    doc = {**_common.run_header(device, vars(a)), "benchmark": "d2h_stall", "world_size": 1,
           "hardware": {**_common.device_description(device),
                        **copies.device_facts(device), "host_cpus": os.cpu_count()},
           "model": {"name": "hf-llama", "preset": "tiny" if a.tiny else "1b",
                     "micro_batch": a.micro_batch, "accumulate": a.accumulate},
           **out, "wall_s": time.perf_counter() - started}
    name = f"d2h_stall_{'1gpu' if device.type == 'cuda' else 'cpu'}{a.tag}.json"
    _common.write_json(Path(a.out) / name, doc)
    print(_table(out))
    print(f"skipped: {[s['step'] for s in out['skipped']]}")
    print(f"wrote {Path(a.out) / name} after {doc['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
