"""Multi-process start-up and preemption signals.

``initialize(coordinator, num_processes, process_id)`` calls ``jax.distributed.initialize``:

* explicitly, when a coordinator address is given (``--coordinator host:port --num_processes N --process_id i``,
  e.g. several processes on one machine; see launch/local_multiprocess.sh);
* with auto-detection on a SLURM allocation with more than one task (``SLURM_NTASKS > 1``) and on a multi-host TPU
  slice (``TPU_WORKER_HOSTNAMES`` lists more than one host), where JAX reads the topology from the environment;
* not at all otherwise (one process, all local devices).

``PreemptionFlag`` turns SIGTERM (what SLURM, Kubernetes and TPU maintenance send before killing a job) into a flag
the loop polls; with several processes the flag is OR-ed across processes (every ``train.log_every`` steps) so that
all of them save the same step.
"""

from __future__ import annotations

import logging
import os
import signal

import jax
import numpy as np

log = logging.getLogger("lpt.train")


def _auto_detected() -> str | None:
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
        return "SLURM"
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if len([h for h in hosts.split(",") if h]) > 1:
        return "TPU pod"
    return None


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None):
    """Start ``jax.distributed`` if this is a multi-process run (see module docstring); return a description."""
    explicit = (coordinator, num_processes, process_id)
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise ValueError(f"--coordinator, --num_processes and --process_id must be given together, got {explicit}")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process_id={process_id} must be in [0, --num_processes={num_processes})")
        jax.distributed.initialize(coordinator, num_processes, process_id)
        return f"explicit ({coordinator}, process {process_id}/{num_processes})"
    where = _auto_detected()
    if where is not None:
        jax.distributed.initialize()
        return f"auto-detected {where} (process {jax.process_index()}/{jax.process_count()})"
    return "single process"


class PreemptionFlag:
    """Set by SIGTERM or a first SIGINT (Ctrl-C); ``requested()`` is True on every process once any process got one.

    The run then saves a checkpoint after the current step and exits cleanly. A second Ctrl-C aborts at once
    (KeyboardInterrupt), without saving.
    """

    def __init__(self):
        self._flag = False
        self._previous = {s: signal.signal(s, self._handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handler(self, signum, frame):
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self._flag:
            raise KeyboardInterrupt  # the second Ctrl-C
        log.warning("%s received: will save a checkpoint after the current step and exit (Ctrl-C again: abort)", name)
        self._flag = True

    def requested(self, step: int, sync_every: int = 1) -> bool:
        """Whether to stop after ``step``. With several processes the flags are OR-ed (an all-gather, which waits for
        the device queue) only every ``sync_every`` steps, so that all processes stop at the same step."""
        if jax.process_count() == 1:
            return self._flag
        if step % sync_every:
            return False
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(self._flag, np.int32))
        return bool(np.any(flags))

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
