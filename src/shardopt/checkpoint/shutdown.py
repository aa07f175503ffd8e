"""Shutdown: an optimizer's asynchronous saves end their background thread, coordination
group and writer process in this order, none after the job's process groups:

1. **The save in flight** finishes at :meth:`~.background.SaveHandle.wait`, the next
   ``save``, ``checkpoint.load``, or at the latest at interpreter exit (the thread is not a
   daemon); a failed save's error is kept without the objects its frames held.
2. **At** ``torch.distributed.destroy_process_group()`` the coordination groups, held
   weakly, go with the job's own.
3. **When the optimizer is collected, or at interpreter exit**, :func:`close_with` runs
   :meth:`~.background.Saves.close`: it logs an error nobody has seen, closes the writer
   process and destroys the coordination groups torch still has.

Why (a gloo group alive when the interpreter finalises aborts a finished job with SIGABRT):
docs/reliability.md, Shutdown; ``tests/checkpoint/test_exit.py`` checks it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable


def close_with(owner: object, close: Callable[[], None]) -> None:
    """Run ``close`` once: when ``owner`` is collected, or at interpreter exit (after the
    non-daemon threads, a save's among them, have ended)."""
    weakref.finalize(owner, close)
