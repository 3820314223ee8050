"""A run whose workdir is object storage (``gs://BUCKET/PATH``), on a local fake of Google Cloud Storage.

No bucket is reachable from the tests, so :func:`fake_gcs` maps every ``gs://BUCKET/PATH`` to ``<root>/BUCKET/PATH``
at the three places where lpt and orbax reach the store, and the code above them runs its ``gs://`` code path:

* ``etils.epath``'s backend for ``gs://`` (the API of gcsfs through epath) is a local directory that refuses to
  append to a file or open one for update, as an object store does: lpt's files (metrics.jsonl, TensorBoard,
  config.json, summary.json, loss.png) and orbax's own file operations go through it;
* TensorStore gets a ``file`` kvstore where orbax asks for the ``gcs`` driver (orbax's ``get_kvstore_for_gcs``), and
  so does lpt's lease (:func:`lpt.train.paths.kvstore_spec`); the file driver's conditional writes keep the
  generation contract of GCS's ``ifGenerationMatch``;
* orbax's check for a hierarchical-namespace bucket (a call to google-cloud-storage) answers no, and lpt's check
  that gcsfs and google-cloud-storage are installed is skipped.

Orbax sees a ``gs://`` path, so it takes its GCS route: a step is written in place and finalized by its
``commit_success.txt``, not renamed. What the fake does not exercise: gcsfs, TensorStore's gcs driver and GCS itself
(network errors, retries, latency), a store where directories do not exist (the fake has real, empty directories),
and clocks that differ between hosts.

Done when (issue 25): a run with an object-storage workdir (the fake) trains, resumes bitwise (a SIGKILL after step 3,
then a resume, equals an uninterrupted local run in every loss and parameter) and is refused a second writer.
"""

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from cpu_devices import cpu_env
from etils.epath import testing as epath_testing
from run_records import flat, losses, trainer_log
from tiny_run import TRAIN_FLAGS

from lpt.train import checkpoint, paths
from lpt.train import workdir as workdir_lib
from lpt.train.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
URL = "gs://fake-bucket/runs/tiny"
ARGS = ["--config", "tiny_cpu", *TRAIN_FLAGS, "--config.train.steps=6", "--config.train.eval_every=2"]


@contextlib.contextmanager
def fake_gcs(root: Path):
    """Within it, ``gs://BUCKET/PATH`` is ``<root>/BUCKET/PATH`` for lpt, etils.epath, orbax and TensorStore (see
    the module docstring)."""
    from orbax.checkpoint._src.path import gcs_utils

    root = Path(root)
    prefix = str(root) + os.sep

    def local(p) -> str:
        s = os.fspath(p)
        return str(root / s[len("gs://") :]) if s.startswith("gs://") else s

    def remote(p) -> str:
        s = os.fspath(p)
        return "gs://" + s[len(prefix) :] if s.startswith(prefix) else s

    def one(original, path, *args, **kwargs):
        return original(local(path), *args, **kwargs)

    def two(original, src, dst, *args, **kwargs):
        return original(local(src), local(dst), *args, **kwargs)

    def open_(original, path, mode):
        if os.fspath(path).startswith("gs://") and ("a" in mode or "+" in mode):
            raise OSError(f"object storage cannot open {path} with mode {mode!r}: objects are written whole")
        return original(local(path), mode)

    def glob(original, pattern):
        return [remote(p) for p in original(local(pattern))]

    def walk(original, top, **kwargs):
        for r, dirs, files in original(local(top), **kwargs):
            yield remote(r), dirs, files

    backend = dict(exists=one, isdir=one, listdir=one, makedirs=one, mkdir=one, rmtree=one, remove=one, stat=one)
    backend.update(open=open_, glob=glob, walk=walk, rename=two, replace=two, copy=two)
    with contextlib.ExitStack() as stack:
        stack.enter_context(epath_testing.mock_epath(**backend))
        stack.enter_context(
            mock.patch.object(gcs_utils, "get_kvstore_for_gcs", lambda p: {"driver": "file", "path": local(p)})
        )
        stack.enter_context(mock.patch.object(gcs_utils, "is_hierarchical_namespace_enabled", lambda p: False))
        stack.enter_context(mock.patch.object(paths, "missing_packages", lambda s: []))
        spec = lambda p: {"driver": "file", "path": local(str(p).rstrip("/")) + "/"}
        stack.enter_context(mock.patch.object(paths, "kvstore_spec", spec))
        yield root


def stored(root: Path, url: str = URL) -> Path:
    """Where the fake keeps ``url``."""
    return Path(root) / url[len("gs://") :]


def run(workdir, *extra, hooks=()) -> int:
    return main([*ARGS, "--workdir", str(workdir), *extra], hooks=hooks)


def params(workdir, step) -> dict:
    return flat(checkpoint.load_params(workdir, step)[0])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same 6 steps, uninterrupted, in a local workdir."""
    w = tmp_path_factory.mktemp("local")
    assert run(w) == 0
    return w


@pytest.fixture(scope="module")
def gcs_run(tmp_path_factory):
    """The fake bucket's root after a run in ``URL``: SIGKILLed after step 3 (a subprocess, checkpoint 2 complete),
    then resumed to step 6 in this process. Returns (root, the resume's log records)."""
    root, tmp = tmp_path_factory.mktemp("gcs"), tmp_path_factory.mktemp("tmp")  # tmp: where metrics are staged
    code = (
        "import sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/..']; "
        "import fault_runner, test_object_storage as t; "
        "from lpt.train.__main__ import main; "
        "ctx = t.fake_gcs(sys.argv[2]); ctx.__enter__(); "
        "sys.exit(main([*t.ARGS, '--workdir', t.URL], hooks=fault_runner.hooks(kill_at=3)))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "tests" / "train"), str(root)],
        cwd=ROOT,
        env=cpu_env(1, TMPDIR=str(tmp)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == -9, p.stderr[-3000:]
    run_dir = stored(root)
    killed = {
        "lease": json.loads((run_dir / "lpt.lock").read_text()),  # the dead holder's lease is left behind
        "steps": sorted(d.name for d in (run_dir / "checkpoints").iterdir()),
        "train": losses(run_dir / "metrics.jsonl")[0],
        "staged": sorted(p.name for p in tmp.iterdir()),  # the killed trainer's staging directory
    }
    with trainer_log() as messages, fake_gcs(root), mock.patch("tempfile.tempdir", str(tmp)):
        assert run(URL) == 0
    killed["staged_after_resume"] = sorted(p.name for p in tmp.iterdir())
    return root, killed, messages


def test_a_gs_workdir_trains_and_resumes_bitwise_after_a_sigkill(reference, gcs_run):
    root, killed, messages = gcs_run
    run_dir = stored(root)
    assert killed["steps"] == ["2"]  # orbax's GCS route: step 2 written in place, finalized by its commit file
    pid = killed["lease"]["pid"]
    assert [n.rsplit("-", 1)[-1] for n in killed["staged"] if n.startswith("lpt-metrics-")] == [str(pid)]
    assert killed["staged_after_resume"] == []  # the resumed run removed the killed one's staging, then its own
    assert killed["lease"]["pid"] != os.getpid() and set(killed["train"]) >= {1, 2}  # synced before checkpoint 2
    assert any("taking over the stale lease" in m and f"pid {killed['lease']['pid']}" in m for m in messages)
    assert losses(run_dir / "metrics.jsonl") == losses(reference / "metrics.jsonl")  # every loss, bit for bit
    with fake_gcs(root):
        assert losses(f"{URL}/metrics.jsonl") == losses(reference / "metrics.jsonl")  # read through epath too
        got, want = params(URL, 6), params(reference, 6)
        assert checkpoint.steps(URL) == [2, 4, 6]
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    assert all((run_dir / "checkpoints" / s / "commit_success.txt").is_file() for s in ("2", "4", "6"))
    assert not (run_dir / "lpt.lock").exists()  # released at the end
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 6
    assert json.loads((run_dir / "config.json").read_text())["train"]["steps"] == 6
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one per process that wrote


def test_eval_generate_and_export_read_a_gs_run(gcs_run, tmp_path, capsys):
    from lpt import eval as eval_lib
    from lpt import export, generate

    root = gcs_run[0]
    summary = json.loads((stored(root) / "summary.json").read_text())
    with fake_gcs(root):
        assert eval_lib.main(["--workdir", URL]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert generate.main(["--workdir", URL, "--prompt", "The", "--max-new-tokens", "3", "--temperature", "0"]) == 0
        assert export.main(["--workdir", URL, "--out", str(tmp_path / "hf")]) == 0
    assert result["step"] == 6 and result["loss"] == summary["eval_loss"]
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_fine_tune_starts_from_a_gs_run(gcs_run, tmp_path):
    with fake_gcs(gcs_run[0]):
        assert run(tmp_path, f"--config.init_from.workdir={URL}", "--config.train.steps=1") == 0
    assert json.loads((tmp_path / "summary.json").read_text())["init_from"] == {"workdir": URL, "step": 6}


def test_a_new_gs_run_that_fails_before_its_first_step_leaves_nothing(tmp_path, capsys):
    with fake_gcs(tmp_path):
        assert run(URL, "--config.data.tokenizer=/nonexistent/tokenizer.json") == 2
    assert "error: " in capsys.readouterr().err
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # no object: not even the lease
    assert not stored(tmp_path).exists()  # nor the fake's empty directories of the run (checkpoints/)


def test_a_second_writer_is_refused_while_the_lease_is_fresh(tmp_path, capsys):
    with fake_gcs(tmp_path):
        with workdir_lib.WorkdirLock(URL):  # another trainer holds the workdir
            held = json.loads((stored(tmp_path) / "lpt.lock").read_text())
            rc = run(URL)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and err[-1].startswith("error: ") and "is in use by another trainer" in err[-1]
        assert f"pid {os.getpid()}" in err[-1] and "last heartbeat 0 s ago" in err[-1]
        files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
        assert files == []  # the holder released its lease; the refused run wrote nothing
        assert held["pid"] == os.getpid() and held["host"]


def _write_lease(root, **holder) -> None:
    record = {"host": "elsewhere", "pid": 1, "started": "2026-01-01T00:00:00+00:00", "token": "x", **holder}
    path = stored(root) / "lpt.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))


def test_a_fresh_lease_of_another_host_is_refused_and_a_stale_one_is_taken_over(tmp_path, caplog):
    with fake_gcs(tmp_path):
        _write_lease(tmp_path, heartbeat=time.time() - workdir_lib.LEASE_SECONDS + 30)
        with pytest.raises(ValueError, match=r"in use by another trainer \(host elsewhere, pid 1, .*heartbeat 2\d\d s"):
            workdir_lib.WorkdirLock(URL).__enter__()
        _write_lease(tmp_path, heartbeat=time.time() - workdir_lib.LEASE_SECONDS - 1)
        with workdir_lib.WorkdirLock(URL):
            mine = json.loads((stored(tmp_path) / "lpt.lock").read_text())
        assert mine["pid"] == os.getpid()
        assert any("taking over the stale lease of host elsewhere, pid 1" in r.message for r in caplog.records)
        _write_lease(tmp_path, heartbeat="garbage")  # unreadable: taken over too
        with workdir_lib.WorkdirLock(URL):
            pass
        assert any("an unreadable holder" in r.message for r in caplog.records)
        assert not (stored(tmp_path) / "lpt.lock").exists()


def test_a_trainer_whose_lease_was_taken_over_stops_before_its_next_checkpoint(tmp_path, capsys):
    def take_over(step, ckpt):
        if step == 1:  # another trainer (which judged this one's lease stale) takes the workdir
            _write_lease(tmp_path, heartbeat=time.time())

    with fake_gcs(tmp_path):
        rc = run(URL, hooks=[take_over])
        assert checkpoint.steps(URL) == []
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "this trainer's lease was taken over by host elsewhere, pid 1" in err[-1]
    assert not (stored(tmp_path) / "checkpoints" / "2").exists()  # no checkpoint over the new holder's
    assert json.loads((stored(tmp_path) / "lpt.lock").read_text())["host"] == "elsewhere"  # its lease is left alone


def test_of_trainers_that_start_together_exactly_one_gets_the_lease(tmp_path):
    with fake_gcs(tmp_path):
        start, won, refused = threading.Barrier(8), [], []

        def contend():
            lease = workdir_lib.Lease(paths.run_path(URL))
            start.wait()
            try:
                won.append(lease.acquire())
            except ValueError as e:
                refused.append(str(e))

        threads = [threading.Thread(target=contend) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(refused) == 7, refused
        assert all("in use by another trainer" in e or "being taken" in e for e in refused)
        won[0].release()
        assert not (stored(tmp_path) / "lpt.lock").exists()


def test_the_holder_renews_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(workdir_lib, "HEARTBEAT_SECONDS", 0.05)
    with fake_gcs(tmp_path), workdir_lib.WorkdirLock(URL):
        first = json.loads((stored(tmp_path) / "lpt.lock").read_text())["heartbeat"]
        time.sleep(0.5)
        later = json.loads((stored(tmp_path) / "lpt.lock").read_text())["heartbeat"]
    assert later > first + 0.2


@pytest.mark.parametrize(
    "workdir, message",
    [
        ("s3://bucket/run", "lpt cannot write runs to s3:// URLs; give a local path or gs://BUCKET/PATH"),
        ("memory://run", "lpt cannot write runs to memory:// URLs"),
        ("gs://bucket", "names no directory in a bucket; give gs://BUCKET/PATH"),
        ("gs://bucket/run", "needs lpt_absent_module, which cannot be imported: pip install 'lpt[gcs]'"),
    ],
)
def test_a_workdir_url_lpt_cannot_use_is_one_error_line(tmp_path, monkeypatch, capsys, workdir, message):
    monkeypatch.setitem(paths.PACKAGES, "gs", ("lpt_absent_module",))  # gcsfs may be installed
    monkeypatch.chdir(tmp_path)
    assert run(workdir) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: --workdir {workdir!r}") and message in err[-1], err
    assert list(tmp_path.iterdir()) == []  # nothing written, no directory named like the URL


def test_gs_needs_gcsfs_and_google_cloud_storage():
    assert paths.PACKAGES["gs"] == ("gcsfs", "google.cloud.storage")
    assert paths.run_path("runs/x") == Path("runs/x") and not paths.is_remote(Path("runs/x"))
    assert paths.kvstore_spec("gs://b/runs/x") == {"driver": "gcs", "bucket": "b", "path": "runs/x/"}
