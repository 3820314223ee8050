"""``python tests/train/fault_runner.py [--sigterm-at K] [--kill-at K] [--fault-process P] <python -m lpt.train args>``

The trainer's entry point with fault-injection hooks (``lpt.train.loop.train(..., hooks=...)``):

* ``--sigterm-at K``: SIGTERM to itself after step K (only in process P if ``--fault-process P``); the trainer saves
  step K and exits cleanly;
* ``--kill-at K``: wait for the pending checkpoint, then SIGKILL itself after step K (a hard crash).

In-process runs take the same faults from :func:`hooks` (``main(argv, hooks=hooks(sigterm_at=3))``).
"""

import argparse
import os
import signal
import sys

import jax

from lpt.train.__main__ import main


def hooks(sigterm_at: int = -1, kill_at: int = -1, fault_process: int | None = None) -> list:
    """The loop hooks of ``--sigterm-at``, ``--kill-at`` and ``--fault-process`` (-1: no such fault)."""

    def sigterm(step, ckpt):
        if step == sigterm_at and fault_process in (None, jax.process_index()):
            os.kill(os.getpid(), signal.SIGTERM)

    def kill(step, ckpt):
        if step == kill_at:
            ckpt.wait()
            os.kill(os.getpid(), signal.SIGKILL)

    return [sigterm, kill]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sigterm-at", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--fault-process", type=int, default=None)
    args, rest = parser.parse_known_args()
    sys.exit(main(rest, hooks=hooks(args.sigterm_at, args.kill_at, args.fault_process)))
