"""``python tests/train/fault_runner.py [--sigterm-at K] [--kill-at K] [--fault-process P] <python -m lpt.train args>``

The trainer's entry point with fault-injection hooks (``lpt.train.loop.train(..., hooks=...)``):

* ``--sigterm-at K``: SIGTERM to itself after step K (only in process P if ``--fault-process P``); the trainer saves
  step K and exits cleanly;
* ``--kill-at K``: wait for the pending checkpoint, then SIGKILL itself after step K (a hard crash).
"""

import argparse
import os
import signal
import sys

import jax

from lpt.train.__main__ import main


def hooks(args) -> list:
    def sigterm(step, ckpt):
        if step == args.sigterm_at and args.fault_process in (None, jax.process_index()):
            os.kill(os.getpid(), signal.SIGTERM)

    def kill(step, ckpt):
        if step == args.kill_at:
            ckpt.wait()
            os.kill(os.getpid(), signal.SIGKILL)

    return [sigterm, kill]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sigterm-at", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--fault-process", type=int, default=None)
    args, rest = parser.parse_known_args()
    sys.exit(main(rest, hooks=hooks(args)))
