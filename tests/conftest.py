"""Test session setup: computation on the CPU, compile-only TPU/GPU targets available (lpt.targets), and one
persistent compilation cache for the whole run.

The environment is set before jax initializes a backend; xdist workers and subprocess tests inherit it. The cache
(a fresh temporary directory per run, removed at exit) lets the many tests that train the same tiny model compile
each step once; a cached executable is the one the compiler produced, so results are unchanged.
"""

import atexit
import os
import shutil
import tempfile

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process of the run: workers inherit its directory
    _cache = tempfile.mkdtemp(prefix="lpt-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

from lpt import targets  # noqa: E402  (jax reads the cache settings at import)

targets.compile_only_environment()
