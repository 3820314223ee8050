"""One finished tiny run per test session, for the tests that only read a run (test_eval, test_generate,
test_tool_errors, test_init_from): :data:`tiny_run.OVERRIDES` with two eval batches, 3 steps, checkpoints at steps
2 and 3.

The first test that asks for it trains it; under pytest-xdist the workers share it through a directory of the
session (``tmp_path_factory.getbasetemp().parent``, the pattern of xdist's documentation) and an exclusive lock on
a file there, so whichever worker comes first trains and the others wait for it and read its files. A test that
changes a run's files works on :func:`copy` of it.
"""

import fcntl
import json
import os
import shutil
from pathlib import Path

from tiny_run import train_tiny

OVERRIDES = {"train.eval_batches": "2"}


def _root(tmp_path_factory) -> Path:
    """The session's directory: the parent of each xdist worker's base temporary directory, or the base temporary
    directory itself without xdist (its parent holds the directories of earlier sessions)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_run(tmp_path_factory) -> tuple[Path, dict]:
    """(workdir, summary) of the session's run: trained by the first caller, read by the others. The workdir is
    ``<session>/tiny-run/workdir``: its parent holds nothing else."""
    root = _root(tmp_path_factory)
    workdir = root / "tiny-run" / "workdir"
    summary = workdir / "summary.json"
    with open(root / "tiny-run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not summary.is_file():
            shutil.rmtree(workdir.parent, ignore_errors=True)  # what a caller that failed mid-run left
            train_tiny(workdir, OVERRIDES)
    return workdir, json.loads(summary.read_text())


def copy(workdir: Path, to: Path) -> Path:
    """A copy of the run ``workdir`` at ``to/workdir`` (``to`` holds nothing else), for a test that changes it."""
    out = Path(to) / "workdir"
    shutil.copytree(workdir, out)
    return out
