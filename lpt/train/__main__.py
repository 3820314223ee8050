"""``python -m lpt.train --config configs/tiny_cpu.py --workdir runs/tiny [--config.key=value ...]``

Parses the command line, starts the processes of a multi-host run and calls :func:`lpt.train.loop.train`.
Exit codes: 0 done (or preempted and saved), 1 stopped on a non-finite training state, 2 bad input, 3 a checkpoint
could not be written (an I/O failure: the steps saved before it are complete).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import jax

from lpt.train import checkpoint, console, distributed, loop
from lpt.train import config as config_lib

log = logging.getLogger("lpt.train")


def main(argv: list[str] | None = None, *, hooks: Sequence[loop.Hook] = ()) -> int:
    console.setup()
    try:
        cfg, args = config_lib.parse_args(sys.argv[1:] if argv is None else argv)
        how = distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info("processes: %s; devices: %s", how, jax.devices())
    try:
        loop.train(cfg, args.workdir, hooks=hooks)
    except loop.NonFiniteLossError as e:
        log.error("%s", e)
        return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except checkpoint.CheckpointWriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
