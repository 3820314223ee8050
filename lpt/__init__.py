"""lpt: low-precision transformer training in JAX/Flax.

Subpackages are imported lazily by name (``lpt.optim``, ``lpt.numerics``, ``lpt.fp8``, ``lpt.attention``,
``lpt.pqt``) so that ``import lpt`` stays cheap.
"""

import importlib

from lpt import startup

__version__ = "0.1.0"

startup.start_command()  # python -m lpt.<command> on a machine without accelerators: jax on the CPU, quietly

_SUBPACKAGES = ("numerics", "optim", "fp8", "attention", "pqt", "kernels", "models", "data", "train", "lab")


def __getattr__(name):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"lpt.{name}")
    raise AttributeError(f"module 'lpt' has no attribute {name!r}")
