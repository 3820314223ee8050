"""Test session setup: computation on the CPU, compile-only TPU/GPU targets available (lpt.targets).

The environment is set before jax initializes a backend; subprocess tests inherit it.
"""

from lpt import targets

targets.compile_only_environment()
