"""Shutdown: the order in which an optimizer's asynchronous saves end their background thread,
coordination group (gloo, :meth:`.background.Saves.coordination_group`) and writer process
(:mod:`.writer_process`), each before what it depends on, none after the job's process groups:

1. **The save in flight** finishes (commits or fails) at :meth:`~.background.SaveHandle.wait`,
   at the next ``save``, at ``checkpoint.load``, and at the latest when the interpreter exits:
   the thread is not a daemon, so Python waits for it before any exit handler runs. A failed
   save's error is kept without the objects its frames held (the group among them).
2. **At** ``torch.distributed.destroy_process_group()`` the coordination groups go with the
   job's own: the library holds them weakly, so torch frees them in that call and joins their
   threads while the interpreter is whole.
3. **When the optimizer is collected, or at interpreter exit**, :func:`close_with` runs its
   :meth:`~.background.Saves.close`: it logs a save's error nobody has seen, closes the writer
   process (which exits 0 at the end of its socket) and destroys the coordination groups torch
   still has (a job that never called ``destroy_process_group``).

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
