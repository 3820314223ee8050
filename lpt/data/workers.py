"""Data worker processes die with their trainer, also when it is SIGKILLed.

grain's ``mp_prefetch`` (``data.worker_count > 0``) spawns each worker with ``multiprocessing``'s "spawn" method, and
nothing in grain or multiprocessing stops a worker whose parent died without running its cleanup (SIGKILL, the OOM
killer, a segfault): the worker keeps prefetching into a queue that nobody reads, and keeps multiprocessing's
resource tracker (a second child of the trainer, which exits once every holder of its pipe has closed it) alive with
it, both for as long as the machine runs.

:func:`exit_with_parent` is the ``worker_init_fn`` that :func:`lpt.data.make_train_iterator` hands grain; grain calls
it in each worker before the worker reads any data. It starts one daemon thread that blocks on the worker's parent
sentinel (``multiprocessing.parent_process().sentinel``: on POSIX the read end of a pipe whose only write end is
held by the trainer process, so the kernel closes it when the trainer dies, however it dies) and ends the worker with
``os._exit(1)`` as soon as that pipe reports end-of-file. If the trainer died before the thread started, the wait
returns at once. Multiprocessing's resource tracker then sees its pipe closed by every holder and exits by itself
(within about a second; it unlinks the semaphores the dead trainer left, with a "leaked semaphore" warning). The
thread does not touch the data, so the batches do not change. It uses only the standard library and works wherever
multiprocessing gives the child a parent sentinel (any start method, any OS; tested on Linux); in a process that has
no multiprocessing parent it does nothing.

Why not ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: Linux sends that signal when the *thread* that forked the child exits,
not the process. grain starts a worker from its thread-prefetch thread, and it stops that thread and starts a new one
on ``set_state`` while the worker lives on: the worker would be killed under a live trainer (and the next batch
would never come).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from multiprocessing import connection


def exit_with_parent(worker_index: int = 0, worker_count: int = 1) -> None:
    """In a multiprocessing child: exit this process (``os._exit(1)``) as soon as its parent process is gone.

    The signature is grain's ``worker_init_fn(worker_index, worker_count)``; both arguments are unused. A no-op in a
    process without a multiprocessing parent."""
    del worker_index, worker_count
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is None:
        return
    threading.Thread(target=_exit_when_closed, args=(sentinel,), name="lpt-exit-with-parent", daemon=True).start()


def _exit_when_closed(sentinel) -> None:
    connection.wait([sentinel])  # readable only at end-of-file: the parent process closed its end or died
    os._exit(1)
