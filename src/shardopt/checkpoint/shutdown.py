"""Shutdown: the order in which the checkpoint layer's threads, process and process groups end.

An optimizer's asynchronous saves (:class:`.background.Saves`) start three things beside
training, in each training process:

* the save's background thread (:mod:`.background`), one save at a time;
* the coordination process group, a gloo group over the DP ranks
  (:meth:`.background.Saves.coordination_group`) on which that thread exchanges with the other
  ranks; torch runs it on two worker threads and an I/O thread of its own;
* the writer process (:mod:`.writer_process`), which writes the snapshot's files.

They end in this order, each before what it depends on, and none outlives the job's process
groups:

1. **The save in flight** finishes (commits or fails) at :meth:`~.background.SaveHandle.wait`,
   at the next ``save``, at ``checkpoint.load``, and at the latest when the interpreter exits: the
   thread is not a daemon, so Python waits for it before any exit handler runs. A failed save's
   error is kept until someone sees it, without the objects its frames held (the group among
   them).
2. **At** ``torch.distributed.destroy_process_group()`` the coordination groups go with the
   job's own groups. The library holds them only weakly: torch's registry of groups keeps them
   while the job's process groups exist and drops them in that call, which frees them and joins
   their threads, while the interpreter is whole.
3. **When the optimizer is collected, or at interpreter exit** if it lives until then, its
   :meth:`~.background.Saves.close` (:func:`close_with`) waits for the save in flight and logs an
   error nobody has seen, closes the writer process (it reads the end of its socket and exits
   0), and destroys the coordination groups that are still registered (a job that never called
   ``destroy_process_group``).

Why the order matters: a gloo group whose threads are still running when the interpreter
finalises can abort a finished job. A worker thread that releases the last reference to a tensor
Python made (every ``all_gather_object`` leaves some, and so does a collective still in flight)
takes the GIL to do it; once finalisation has begun, CPython ends a thread that asks for the GIL
(or is still waiting for it) by unwinding it, and the unwinding through torch's destructors
(``noexcept``) calls ``std::terminate``: ``terminate called without an active exception``,
SIGABRT, exit status 134 after the job's work was done. Step 2 makes sure no group of the library
outlives the job's; the job's own default group needs the same, so a job ends with
``destroy_process_group()`` as torch asks (``shardopt train`` does). ``tests/test_exit.py`` runs
jobs that exit through the interpreter and checks both: no thread is left after
``destroy_process_group()``, and every process exits 0.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable


def close_with(owner: object, close: Callable[[], None]) -> None:
    """Run ``close`` once: when ``owner`` is collected, or at interpreter exit (after the
    non-daemon threads, a save's among them, have ended)."""
    weakref.finalize(owner, close)
