"""The steps of ``d2h_stall.py``: :data:`PLAN` (every step, most wanted first), the named
groups of ``--ways`` and :func:`plan`, which turns ``--ways`` into steps. A step is (part,
way, read kind or reads in the iteration, GiB at most); the parts and read kinds are those of
``d2h_stall.py``'s docstring."""

from __future__ import annotations

from typing import Any

from _d2h_copies import STRATEGIES

# (part, strategy, read kind or reads in the iteration, GiB at most (0: all)), most wanted
# first: the budget skips from the end.
PLAN: list[tuple[str, str, Any, float]] = [
    ("idle", "queued_256m", "item", 0), ("idle", "queued_4g", "item", 0),
    ("idle", "thread_16m", "item", 0), ("idle", "uva_256m", "item", 0),
    ("idle", "kernel_16", "item", 0), ("idle", "d2d+kernel_16", "item", 0),
    ("idle", "queued_256m", "pinned", 0), ("idle", "queued_256m", "sync", 0),
    ("iter", "queued_256m", True, 0), ("iter", "queued_4g", True, 0),
    ("iter", "thread_16m", True, 0), ("iter", "uva_256m", True, 0),
    ("iter", "kernel_16", True, 0), ("iter", "d2d_only", True, 0),
    ("iter", "d2d+kernel_16", True, 0), ("iter", "queued_256m_high", True, 0),
    ("iter", "queued_256m", False, 0), ("idle", "queued_256m_high", "item", 0),
    ("idle", "thread_4m", "item", 0), ("idle", "thread_64m", "item", 0),
    ("idle", "thread_256m", "item", 0), ("idle", "queued_1g", "item", 0),
    ("idle", "queued_16m", "item", 0), ("idle", "queued_256m_4streams", "item", 0),
    *(("idle", f"kernel_{n}", "item", 4) for n in (4, 8, 32, 64)),
    ("idle", "d2d_only", "item", 0), ("idle", "d2dk_only", "item", 0),
    ("idle", "d2d+thread_64m", "item", 0), ("idle", "d2d+queued_4g", "item", 0),
    ("idle", "d2d+kernel_32", "item", 0), ("idle", "d2dk+kernel_16", "item", 0),
    ("idle", "thread_16m", "pinned", 0), ("idle", "thread_16m", "sync", 0),
    ("idle", "kernel_16", "pinned", 0),
    ("iter", "kernel_32", True, 0), ("iter", "d2d+kernel_32", True, 0),
    ("iter", "d2d+thread_64m", True, 0), ("iter", "d2d+queued_4g", True, 0),
    ("iter", "d2dk+kernel_16", True, 0), ("iter", "kernel_16", False, 0),
    ("iter", "thread_64m", True, 0), ("iter", "queued_1g", True, 0),
    ("iter", "queued_256m_4streams", True, 0),
    *(("iter", f"{first}paced_{mib}m_{k}", True, 0)
      for first in ("", "d2d+") for mib in (1, 2, 4) for k in (1, 2)),
    ("idle", "queued_256m", "high", 0),
]
# Named groups of ``--ways``. ``paced``: the read on a high-priority stream (a few seconds),
# then each paced drain from the source beside the same after a device copy, one in flight
# before two, so that a budget that runs out drops the least wanted.
GROUPS = {"paced": ["idle:queued_256m:high"] + [
    f"iter:{first}paced_{mib}m_{k}" for k in (1, 2) for mib in (1, 4, 2)
    for first in ("", "d2d+")]}
READ_KINDS = ("item", "pinned", "sync", "high")


def plan(ways: str) -> list[tuple[str, str, Any, float]]:
    """The steps ``--ways`` selects, in its order (all of ``PLAN`` if empty); raises
    ValueError naming an unknown way, part or read kind."""
    if not ways:
        return list(PLAN)
    steps: list[tuple[str, str, Any, float]] = []
    for item in (w for g in ways.split(",") if g for w in GROUPS.get(g, [g])):
        part, sep, rest = item.partition(":")
        if not sep:
            steps += [p for p in PLAN if p[1] == item] or [("iter", item, True, 0)]
            continue
        if part == "idle":
            name, _, mode = rest.partition(":")
            mode = mode or "item"
            if mode not in READ_KINDS:
                raise ValueError(f"{item}: read kind {mode!r} is not one of {READ_KINDS}")
        elif part == "iter":
            name, _, tail = rest.partition("/")
            if tail not in ("", "no_reads"):
                raise ValueError(f"{item}: an iteration step ends in /no_reads or nothing")
            mode = not tail
        else:
            raise ValueError(f"{item}: a step starts with idle: or iter:")
        gib = next((p[3] for p in PLAN if p[:3] == (part, name, mode)), 0)
        steps.append((part, name, mode, gib))
    unknown = sorted({p[1] for p in steps} - set(STRATEGIES))
    if unknown:
        raise ValueError(f"unknown ways {unknown}; have {', '.join(STRATEGIES)} "
                         f"and the groups {', '.join(GROUPS)}")
    return steps
