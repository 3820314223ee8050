"""The trainer's stderr: library failure reports one line each, orbax's after-the-fact noise silenced, the rest kept."""

import asyncio
import gc
import logging
import os
import re
import subprocess
import sys

import pytest
from tiny_run import TRAIN_FLAGS

from lpt.train import console


@pytest.fixture
def passed(monkeypatch):
    """What the trainer's hooks pass on to the hooks that were installed before them (which would print it)."""
    seen = {"unraisable": [], "exceptions": []}
    monkeypatch.setattr(sys, "unraisablehook", seen["unraisable"].append)
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: seen["exceptions"].append(exc))
    console.setup()
    yield seen
    absl = logging.getLogger("absl")
    for f in [f for f in absl.filters if isinstance(f, console._OneLine)]:
        absl.removeFilter(f)


def _suspended_read(filename: str):
    """A coroutine shaped like orbax's array read (``except BaseException: raise Exception(...) from e``), defined
    in ``filename`` and suspended at its await, so that closing it raises."""
    source = (
        "async def read(fut):\n"
        "    try:\n"
        "        await fut\n"
        "    except BaseException as e:\n"
        "        raise Exception('Encountered error while reading array index: ().') from e\n"
    )
    scope = {}
    exec(compile(source, filename, "exec"), scope)

    class Pending:
        def __await__(self):
            yield

    coro = scope["read"](Pending())
    coro.send(None)
    return coro


@pytest.mark.parametrize(
    "filename, printed", [("/site-packages/orbax/checkpoint/serialization.py", False), ("/x/mine.py", True)]
)
def test_abandoned_orbax_reads_are_silent_and_others_are_not(passed, filename, printed):
    coro = _suspended_read(filename)
    del coro
    gc.collect()
    errors = [str(u.exc_value) for u in passed["unraisable"]]
    assert any("Encountered error while reading" in e for e in errors) == printed


def test_a_closed_event_loop_from_a_late_callback_is_silent(passed):
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError:
        sys.excepthook(*sys.exc_info())  # what PyErr_Print does with a TensorStore callback's exception
    try:
        raise RuntimeError("Event loop is closed")  # the same message raised anywhere else is passed on
    except RuntimeError:
        sys.excepthook(*sys.exc_info())
    assert [str(e) for e in passed["exceptions"]] == ["Event loop is closed"]
    assert passed["exceptions"][0].__traceback__.tb_frame.f_code.co_name.startswith("test_")


def test_absl_errors_with_tracebacks_are_one_line(passed):
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    absl = logging.getLogger("absl")
    handler = Keep()
    absl.addHandler(handler)
    try:
        try:
            raise ValueError("RESOURCE_EXHAUSTED: Error writing\nsecond line. See full TensorStore details: {...}")
        except ValueError:
            absl.exception("save thread raised: %s", "RESOURCE_EXHAUSTED")
    finally:
        absl.removeHandler(handler)
    assert records == ["save thread raised: RESOURCE_EXHAUSTED"]


@pytest.mark.skipif(
    any(os.path.exists(p) for p in console.ACCELERATOR_DEVICES), reason="an accelerator is present: its plugin starts"
)
def test_a_run_on_a_machine_without_accelerators_prints_only_lpts_lines(tmp_path):
    """With JAX_PLATFORMS unset and jax's CUDA plugin and libtpu installed (the dev extras), lpt's commands start jax
    on the CPU alone and quietly: every stderr line of a run and of an eval of it is lpt's own (its log lines and its
    progress bar). Without lpt.startup each process printed 8 lines from the CUDA stub ("Could not find cuda drivers"),
    without lpt.train.console ~30 (failed plugin start-ups), and the eval two orbax notes on reading read-only."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE")}
    argv = ["--config", "tiny_cpu", "--workdir", str(tmp_path), *TRAIN_FLAGS, "--config.train.steps=6"]
    ours = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) |train: |\{)")
    stderr = {}
    for command in (["lpt.train", *argv], ["lpt.eval", "--workdir", str(tmp_path), "--batches", "1"]):
        p = subprocess.run([sys.executable, "-m", *command], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        stderr[command[0]] = p.stderr
        foreign = [ln for ln in re.split(r"[\r\n]+", p.stderr) if ln.strip() and not ours.match(ln)]
        assert not foreign, (command[0], foreign)
    assert "INFO done: validation loss" in stderr["lpt.train"]
