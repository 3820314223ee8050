"""Test session setup: computation on the CPU, compile-only TPU/GPU targets available (lpt.targets), one
persistent compilation cache for the whole run, and the tests that share a module-scoped fixture kept on one xdist
worker.

The environment is set before jax initializes a backend; xdist workers and subprocess tests inherit it. The cache
(a fresh temporary directory per run, removed at exit, unless ``JAX_COMPILATION_CACHE_DIR`` names one: .ci/run
shares one between the two tiers of a leg) lets the many tests that train the same tiny model compile each step
once; a cached executable is the one the compiler produced, so results are unchanged. Every program is
cached, however fast it compiled: the tiny models' programs compile in well under a second each, but the workers
and the subprocess runs compile them again and again.
"""

import atexit
import functools
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import slow_tier

# Python's bytecode caches are written even where PYTHONDONTWRITEBYTECODE is set (some images set it): the run starts
# many Python processes (the xdist workers, the trainer's subprocesses), and without the caches each one compiles
# every module it imports again (jax, flax, orbax, torch...: ~30 CPU-s per process in a venv installed with pip's
# --no-compile). Set before anything below imports them; the subprocesses inherit the environment.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process of the run: workers inherit its directory
    _cache = tempfile.mkdtemp(prefix="lpt-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# numpy's OpenBLAS would start a thread per core in each xdist worker: the workers already fill the cores, and the
# Mosaic GPU interpreter's small matmuls (one per wgmma) cost ~200x more CPU time with the threads than without
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from lpt import targets  # noqa: E402  (jax reads the cache settings at import)

targets.compile_only_environment()


@pytest.fixture
def torch():
    """The torch module, for the tests that compare with transformers' PyTorch models; they skip where torch is not
    installed (its CPU build is pinned for Python 3.11 only: pyproject's dev extras)."""
    return pytest.importorskip("torch", reason="torch is not installed (its CPU build is pinned for Python 3.11 only)")


@functools.cache
def _float16_compiles() -> bool:
    """Whether XLA:CPU can compile an f32 <-> f16 conversion here. Without F16C (a CPU before 2012, or
    ``XLA_FLAGS=--xla_cpu_max_isa=SSE4_2``) LLVM emits calls to ``__truncsfhf2`` / ``__extendhfsf2``, which XLA's
    JIT does not provide, and every program touching float16 fails to compile."""
    import jax
    import jax.numpy as jnp

    try:
        jax.block_until_ready(jax.jit(lambda x: x.astype(jnp.float16))(jnp.ones(2, jnp.float32)))
        return True
    except Exception:  # noqa: BLE001 -- jax raises JaxRuntimeError("INTERNAL: Failed to materialize symbols")
        return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a CPU where XLA cannot compile float16 at all, a test that fails only because a float16 program did not
    compile is reported as skipped, with that reason (it tested nothing here); everywhere else nothing changes."""
    outcome = yield
    report = outcome.get_result()
    if not (report.failed and call.excinfo is not None and report.when == "call"):
        return
    if "Failed to materialize symbols" in str(call.excinfo.value) and not _float16_compiles():
        report.outcome = "skipped"
        report.longrepr = (
            str(item.path),
            item.location[1] or 0,
            "XLA:CPU cannot compile float16 on this ISA (no F16C)",
        )


@pytest.hookimpl(tryfirst=True)  # before pytest's -m selection reads the marks
def pytest_collection_modifyitems(session, config, items):
    """Marks the tests that tests/slow_tests.txt names ``slow``, and keeps the ids of everything collected (for
    tests/test_slow_list.py, which checks that the list names only tests that exist)."""
    slow = set(slow_tier.entries())
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
    config.stash[slow_tier.COLLECTED] = frozenset(item.nodeid for item in items)


_MODULE_FIXTURE = re.compile(r"""scope=["']module["']""")


@functools.cache
def _has_module_fixture(path: Path) -> bool:
    return path.suffix == ".py" and path.is_file() and bool(_MODULE_FIXTURE.search(path.read_text("utf-8")))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``pytest -n N`` (xdist's default ``--dist load``): a test file that defines a module-scoped fixture (a training
    run, a built model) is one unit of work, run by one worker, so that the fixture is built once and not once per
    worker that gets some of its tests; every other test is a unit of its own. xdist sends the larger units first
    (``--loadscope-reorder``), so the run ends on single tests. Other ``--dist`` modes are left as they are."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return file if _has_module_fixture(config.rootpath / file) else nodeid

    return ModuleFixtureScheduling(config, log)
