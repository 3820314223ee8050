"""grain worker processes (``data.worker_count > 0``) live exactly as long as their trainer (lpt.data.workers).

The fault: a trainer run with ``--config.data.worker_count=1`` is SIGKILLed once its worker serves batches. Before
the fix its worker (~200 MB) and multiprocessing's resource tracker lived on, orphaned, until someone killed them.
Now every descendant of the trainer must be gone within seconds, and the watcher in the worker must not change the
batches (also across ``set_state``, which makes grain replace the thread that started the worker: a thread-bound
``PR_SET_PDEATHSIG`` would kill the worker there).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from cpu_devices import cpu_env
from tiny_run import OVERRIDES, ROOT

from lpt.data import pipeline as D
from lpt.data.workers import exit_with_parent

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")

RUN = {
    **OVERRIDES,
    "train.steps": "200",
    "train.eval_every": "200",
    "train.checkpoint_every": "200",
    "train.log_every": "1",
    "data.worker_count": "1",
}
GONE_WITHIN_S = 10.0


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a live or zombie process, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name in parentheses may contain spaces
    return int(fields[1]), fields[0], int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every live descendant of ``root``."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None and st[1] not in "ZX":
            parent_of[int(entry)] = (st[0], st[2])
    found, todo = {}, [root]
    while todo:
        p = todo.pop()
        for pid, (ppid, start) in parent_of.items():
            if ppid == p and pid not in found:
                found[pid] = start
                todo.append(pid)
    return found


def _alive(procs: dict[int, int]) -> dict[int, str]:
    """The processes of ``procs`` (pid -> start time, so a reused pid does not count) still running, with their
    command lines; a zombie counts as gone (it holds no memory and runs nothing)."""
    out = {}
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[1] not in "ZX":
            try:
                out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            except OSError:
                pass
    return out


def _wait_gone(procs: dict[int, int], within: float) -> dict[int, str]:
    deadline = time.monotonic() + within
    while (alive := _alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _kill_leftovers(procs: dict[int, int]) -> None:
    for pid in _alive(procs):  # only processes this test started (descendants of its trainer)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _start_trainer(workdir: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "lpt.train", "--config", str(ROOT / "configs" / "tiny_cpu.py")]
    argv += ["--workdir", str(workdir), *(f"--config.{k}={v}" for k, v in RUN.items())]
    with open(workdir.parent / "stderr.txt", "wb") as err:
        return subprocess.Popen(argv, cwd=ROOT, env=cpu_env(1), stdout=subprocess.DEVNULL, stderr=err)


def _stderr(workdir: Path) -> str:
    return (workdir.parent / "stderr.txt").read_text(errors="replace")[-3000:]


def _workers(procs: dict[int, int]) -> list[int]:
    return [pid for pid, cmd in _alive(procs).items() if "spawn_main" in cmd]


def _last_step(workdir: Path) -> int:
    try:
        lines = (workdir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines:
        try:
            steps.append(int(json.loads(line).get("step", 0)))
        except ValueError:  # a line still being written
            pass
    return max(steps)


@linux_only
def test_a_sigkilled_trainer_leaves_no_process_behind(tmp_path):
    workdir = tmp_path / "run"
    trainer = _start_trainer(workdir)
    procs: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 180
        while not (_workers(procs) and _last_step(workdir) >= 2):  # the worker has served batches
            assert trainer.poll() is None, _stderr(workdir)
            assert time.monotonic() < deadline, "the trainer did not reach step 2 with its worker"
            procs.update(_descendants(trainer.pid))
            time.sleep(0.1)
        procs.update(_descendants(trainer.pid))
        assert _last_step(workdir) < 200, "the run finished before it could be killed"
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        alive = _wait_gone(procs, GONE_WITHIN_S)
        assert not alive, f"alive {GONE_WITHIN_S:.0f} s after the trainer was SIGKILLed: {alive}"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        _kill_leftovers(procs)


def _take(it, n):
    return [next(it) for _ in range(n)]


@linux_only
def test_the_worker_watcher_changes_no_batch_and_survives_set_state():
    """worker_count=1 gives worker_count=0's batches, before and after ``set_state`` (grain then stops the thread
    that started the worker and starts another; the worker must live on)."""
    cfg = {"worker_count": 0}
    ref = D.make_train_iterator(cfg, seq_len=16, global_batch=4, seed=3)
    expected = _take(ref, 9)
    it = D.make_train_iterator({"worker_count": 1}, seq_len=16, global_batch=4, seed=3)
    try:
        got = _take(it, 5)
        state = it.get_state()
        _take(it, 2)
        it.set_state(state)
        time.sleep(0.5)  # the replaced thread has exited: a thread-bound death signal would have fired by now
        got += _take(it, 4)
    finally:
        it.close()
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g["inputs"], e["inputs"])
        np.testing.assert_array_equal(g["targets"], e["targets"])


def test_outside_a_worker_the_watcher_is_a_no_op():
    before = threading.active_count()
    exit_with_parent(0, 1)  # the test process has no multiprocessing parent
    assert threading.active_count() == before


@linux_only
def test_closing_the_iterator_stops_its_workers_without_killing_them():
    """A batch of 16 x 1024 int32 ids (two 64 KiB arrays) is larger than a pipe's buffer. The batch arrays must be
    contiguous, so grain's workers hand them over in shared memory: a view was pickled through the pipe instead, and
    a worker told to stop then waited at exit on a send nobody read until grain killed it (SIGKILL after 25 s, one
    worker after the other: about 100 s at the end of every run with 4 workers)."""
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    it = D.make_train_iterator({"worker_count": 2}, seq_len=1024, global_batch=16, seed=0)
    try:
        batches = _take(it, 3)
        workers = [p for p in multiprocessing.active_children() if p.pid not in before]
    finally:
        it.close()
    assert all(b[k].flags.c_contiguous for b in batches for k in ("inputs", "targets"))
    assert len(workers) == 2, workers
    assert [w.exitcode for w in workers] == [0, 0], "a worker did not exit when the iterator closed (killed: -9)"
