"""How an lpt command starts jax on a machine without accelerators: on the CPU alone, and quietly.

On a machine with no accelerator device node and ``JAX_PLATFORMS`` unset, jax would try each installed plugin (the
CUDA plugin and libtpu of the dev extras) and print their failed start-ups, and importing jax loads jaxlib's CUDA
modules and its CUDA plugin, whose stub prints "Could not find cuda drivers on your machine" through absl (8 lines
per process). :func:`cpu_only` makes that decision; :func:`_start_quietly` acts on it before jax is imported: it
sets ``JAX_PLATFORMS=cpu`` and keeps jaxlib's CUDA modules and the CUDA plugin unimported, so jax runs as a
CPU-only jaxlib does.

``lpt/__init__.py`` calls :func:`start_command`, which calls :func:`_start_quietly` when the process is one of lpt's
commands (``python -m lpt.train``, ``lpt.generate``, ``lpt.eval``, ``lpt.export``, ``lpt.data.prepare``, ...), except
``lpt.train.compile``, which compiles for GPUs through the CUDA plugin. A program that imports lpt as a library is
left as it is. This module imports no jax.
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys

__all__ = ["ACCELERATOR_DEVICES", "command", "cpu_only"]

ACCELERATOR_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/accel0", "/dev/vfio", "/dev/kfd")  # CUDA, TPU, ROCm
# jaxlib's CUDA extensions and jax's CUDA PJRT plugins (which jax imports and initializes even with JAX_PLATFORMS=cpu)
_CUDA_MODULES = (
    "jax_cuda12_plugin",
    "jax_cuda13_plugin",
    "jaxlib.cuda",
    "jax_plugins.xla_cuda12",
    "jax_plugins.xla_cuda13",
)
_NOT_QUIET = ("lpt.train.compile",)  # commands that compile for accelerators through their plugins


def cpu_only() -> bool:
    """True when jax should run on the CPU alone: no accelerator device node, and nobody chose the platforms."""
    if os.environ.get("JAX_PLATFORMS"):
        return False
    return not any(os.path.exists(path) for path in ACCELERATOR_DEVICES)


def command() -> str | None:
    """The lpt module this process runs as a command (``python -m lpt.X ...``), else None."""
    argv = getattr(sys, "orig_argv", [])
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m":
            name = argv[i + 1]
            return name if name == "lpt" or name.startswith("lpt.") else None
    return None


class _NoCudaExtensions(importlib.abc.MetaPathFinder):
    """Import finder that reports jaxlib's CUDA modules as absent (jax then skips them, as on a CPU-only jaxlib)."""

    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in _CUDA_MODULES):
            raise ModuleNotFoundError(f"No module named {name!r} (lpt: no accelerator on this machine)", name=name)
        return None


def _start_quietly() -> bool:
    """On a CPU-only machine (:func:`cpu_only`) and before jax is imported: ``JAX_PLATFORMS=cpu`` and no CUDA
    extension modules. True if it did so."""
    if "jax" in sys.modules or not cpu_only():
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"
    if not any(isinstance(f, _NoCudaExtensions) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoCudaExtensions())
        # jax's plugin discovery reports each advertised plugin it cannot import: the ones kept out above
        logging.getLogger("jax._src.xla_bridge").addFilter(_not_a_kept_out_plugin)
    return True


def _not_a_kept_out_plugin(record: logging.LogRecord) -> bool:
    return not any(m in record.getMessage() for m in _CUDA_MODULES)


def start_command() -> None:
    """:func:`_start_quietly` if this process is an lpt command other than those that compile for accelerators."""
    name = command()
    if name is not None and name not in _NOT_QUIET:
        _start_quietly()
