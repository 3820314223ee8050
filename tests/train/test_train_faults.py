"""Faults the trainer must survive without losing a run (in-process runs of the tiny model, 6 steps).

Each test injects a fault (a truncated or overwritten checkpoint file, a checksum that no longer matches, a second
trainer on the workdir, a torn metrics line, a crash during the metrics rewrite, a finished run started again) and
asserts the final state: the run finishes with the losses of an uninterrupted run, or stops with a one-line error
and leaves what was there untouched.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
from tiny_run import TRAIN_FLAGS

from lpt.train import config as config_lib
from lpt.train import metrics
from lpt.train import workdir as workdir_lib
from lpt.train.__main__ import main

ARGS = ["--config", "tiny_cpu", *TRAIN_FLAGS, "--config.train.eval_every=6"]
ROOT_DOCS = Path(__file__).resolve().parents[2] / "docs"


class Crash(Exception):
    """Raised by a hook: the process dies after a step (its pending checkpoint is completed on the way out)."""


def run(workdir, crash_after=None) -> int:
    def hook(step, ckpt):
        if step == crash_after:
            raise Crash(step)

    try:
        return main([*ARGS, "--workdir", str(workdir), "--config.train.steps=6"], hooks=[hook])
    except Crash:
        return -1


def losses(workdir) -> dict:
    return {r["step"]: r.get("loss", r.get("eval_loss")) for r in metrics.read_jsonl(Path(workdir) / "metrics.jsonl")}


def records(workdir) -> list:
    return metrics.read_jsonl(Path(workdir) / "metrics.jsonl")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    w = tmp_path_factory.mktemp("ref")
    assert run(w) == 0
    return w


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """A run that crashed after step 5: checkpoints 2 and 4, metrics of steps 1-5 (tests fault copies of it)."""
    w = tmp_path_factory.mktemp("crashed")
    assert run(w, crash_after=5) == -1
    return w


def _largest_state_file(workdir, step) -> Path:
    files = [p for p in (Path(workdir) / "checkpoints" / str(step) / "state").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def _snapshot(workdir, step) -> dict:
    root = Path(workdir) / "checkpoints" / str(step)
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("fault", ["truncate", "overwrite", "checksum"])
def test_damaged_newest_checkpoint_is_moved_aside_and_the_run_continues(crashed, reference, tmp_path, fault, caplog):
    shutil.copytree(crashed, tmp_path, dirs_exist_ok=True)  # checkpoints 2 and 4 written, then a crash
    before = _snapshot(tmp_path, 2)
    if fault == "truncate":
        f = _largest_state_file(tmp_path, 4)
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif fault == "overwrite":
        f = _largest_state_file(tmp_path, 4)
        data = bytearray(f.read_bytes())
        data[len(data) // 3 : len(data) // 3 + 4000] = os.urandom(4000)[: len(data) - len(data) // 3]
        f.write_bytes(bytes(data))
    else:  # the arrays read fine but one no longer matches the checksum saved with it
        meta = next((tmp_path / "checkpoints" / "4" / "metadata").glob("*"))
        m = json.loads(meta.read_text())
        key = sorted(m["checksums"])[0]
        m["checksums"][key] = "0" * 16
        meta.write_text(json.dumps(m))
    assert run(tmp_path) == 0
    damaged = list((tmp_path / "checkpoints_damaged").iterdir())
    assert [d.name.split("-")[0] for d in damaged] == ["4"]  # kept, not deleted
    assert any("checkpoint step 4 is unreadable" in r.message and "moved it to" in r.message for r in caplog.records)
    assert losses(tmp_path) == losses(reference)  # steps 3-4 re-run from step 2: the same numbers
    assert _snapshot(tmp_path, 2) == before  # the good checkpoint is untouched
    assert sorted(int(d.name) for d in (tmp_path / "checkpoints").iterdir() if d.name.isdigit()) == [2, 4, 6]


def test_checksums_detect_any_changed_bit_and_ignore_nothing():
    import jax.numpy as jnp
    import numpy as np

    from lpt.train.checkpoint import checksums

    tree = {
        "w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
        "b": jnp.ones(5, jnp.bfloat16),
        "n": jnp.asarray(3, jnp.int32),
        "u": jnp.arange(4, dtype=jnp.uint32),
    }
    base = checksums(tree)
    assert len(base) == 4 and all(len(v) == 16 for v in base.values())
    for name, x in tree.items():
        host = np.asarray(x).reshape(-1)
        bits = host.view(np.uint8).copy()
        bits[-1] ^= 1  # one bit of the last byte
        changed = dict(tree, **{name: jnp.asarray(bits.view(host.dtype).reshape(x.shape))})
        assert checksums(changed)[name] != base[name], name
    swapped = dict(tree, w=tree["w"].reshape(-1)[::-1].reshape(3, 4))  # same values, other positions
    assert checksums(swapped)["w"] != base["w"]


def test_a_second_trainer_on_the_workdir_fails_at_once(tmp_path, capsys):
    with workdir_lib.WorkdirLock(tmp_path):  # another trainer holds the workdir
        rc = run(tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: ") and "is in use by another trainer" in err[-1]
    assert f"pid {os.getpid()}" in err[-1] and "started 20" in err[-1]
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    assert run(tmp_path, crash_after=1) == -1  # the lock was released with its holder: this run starts


def test_the_trainer_that_loses_the_race_for_a_new_workdir_removes_nothing(tmp_path, monkeypatch, capsys):
    """Two trainers start on a workdir that does not exist yet: the winner creates it and takes the lock while the
    loser is between finding it missing and locking it. The loser exits 2 naming the holder and leaves the winner's
    directory and lock in place, so a third trainer is refused too."""
    new = tmp_path / "runs" / "new"
    real, winner = workdir_lib.first_missing, []

    def late(workdir):
        found = real(workdir)  # the loser finds the directory missing...
        if not winner:
            winner.append(workdir_lib.WorkdirLock(new).__enter__())  # ...and the winner creates and locks it
        return found

    monkeypatch.setattr(workdir_lib, "first_missing", late)
    try:
        assert run(new) == 2
        assert "is in use by another trainer" in capsys.readouterr().err.strip().splitlines()[-1]
        assert (new / "lpt.lock").is_file()  # the winner's directory and lock are still there
        assert run(new) == 2  # a third trainer is refused
        assert "is in use by another trainer" in capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        winner[0].__exit__(None, None, None)


def test_a_failed_run_keeps_a_new_parent_that_another_trainer_uses(tmp_path):
    """A run that failed before writing anything removes the directories it created, unless another trainer's
    workdir (here only its lock, held or left) appeared in them meanwhile."""
    parent = tmp_path / "runs"
    mine = parent / "a"
    created = workdir_lib.first_missing(mine)
    assert created == parent
    with workdir_lib.WorkdirLock(mine) as lock, workdir_lib.WorkdirLock(parent / "b"):
        workdir_lib.remove_if_unused(created, own_lock=lock.path)
        assert (parent / "b" / "lpt.lock").is_file() and (mine / "lpt.lock").is_file()
    workdir_lib.remove_if_unused(created, own_lock=mine / "lpt.lock")  # b's lock file is still there
    assert (parent / "b" / "lpt.lock").is_file()
    (parent / "b" / "lpt.lock").unlink()
    workdir_lib.remove_if_unused(created, own_lock=mine / "lpt.lock")
    assert not parent.exists()


def test_workdir_that_is_a_file_is_a_one_line_error(tmp_path, capsys):
    f = tmp_path / "not_a_dir"
    f.write_text("keep me")
    rc = run(f)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == f"error: --workdir {str(f)!r} is a file; give a directory (it is created if missing)"
    assert f.read_text() == "keep me"


@pytest.mark.parametrize("workdir", ["", " "])
def test_an_empty_workdir_is_a_one_line_error(tmp_path, monkeypatch, capsys, workdir):
    """``--workdir "$UNSET"`` must not train into (and write config.json over) the current directory."""
    monkeypatch.chdir(tmp_path)
    rc = main([*ARGS, "--workdir", workdir])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        rc == 2
        and err[-1] == f"error: --workdir {workdir!r} is empty; give the run's directory (it is created if missing)"
    )
    assert list(tmp_path.iterdir()) == []


def test_torn_metrics_line_is_skipped_and_a_finished_run_is_left_alone(crashed, reference, tmp_path, caplog):
    shutil.copytree(crashed, tmp_path, dirs_exist_ok=True)
    path = tmp_path / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 5, "loss": 1.2')  # a crash mid-write
    assert run(tmp_path) == 0
    assert any("torn last line" in r.message and "metrics.jsonl" in r.message for r in caplog.records)
    assert losses(tmp_path) == losses(reference)
    first = (path.read_bytes(), (tmp_path / "summary.json").read_bytes())
    assert run(tmp_path) == 0  # finished: nothing appended, the summary kept
    assert (path.read_bytes(), (tmp_path / "summary.json").read_bytes()) == first
    assert json.loads(first[1])["tokens_per_sec"] > 0


def test_a_damaged_line_inside_the_metrics_names_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not a JSON record"):
        metrics.read_jsonl(path)


def test_metrics_rewrite_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    old = '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
    path.write_text(old)

    def crash(*a):
        raise KeyboardInterrupt  # killed between writing the temp file and the rename

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        metrics.rewrite_jsonl(path, [{"step": 1, "loss": 2.0}])
    assert path.read_text() == old


def test_ctrl_c_saves_and_exits_cleanly_and_the_run_resumes(reference, tmp_path, caplog):
    import signal

    def interrupt(step, ckpt):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    handler = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN in a background job
    rc = main([*ARGS, "--workdir", str(tmp_path), "--config.train.steps=6"], hooks=[interrupt])
    assert rc == 0 and any("SIGINT received" in r.message for r in caplog.records)
    assert (tmp_path / "checkpoints" / "3").is_dir() and not (tmp_path / "summary.json").exists()
    assert run(tmp_path) == 0
    assert losses(tmp_path) == losses(reference)
    assert signal.getsignal(signal.SIGINT) is handler  # the handler is given back


def test_load_params_returns_the_runs_params_and_config(reference):
    import numpy as np
    import orbax.checkpoint as ocp

    import lpt.train

    params, cfg = lpt.train.load_params(reference)
    assert cfg.train.steps == 6 and cfg.model.d_model == 32
    raw = ocp.StandardCheckpointer().restore(Path(reference).resolve() / "checkpoints" / "6" / "state")["params"]
    flat = lambda t: {"/".join(map(str, p)): np.asarray(v) for p, v in jax_flatten(t)}
    got, want = flat(params), flat(raw)
    assert got.keys() == want.keys() and len(got) > 5
    assert all(np.array_equal(got[k], want[k]) for k in got)
    params4, _ = lpt.train.load_params(reference, step=4)
    assert not all(np.array_equal(flat(params4)[k], got[k]) for k in got)
    with pytest.raises(ValueError, match=r"step=5 is not a checkpoint in .*; available: \[2, 4, 6\]"):
        lpt.train.load_params(reference, step=5)


def jax_flatten(tree):
    import jax

    return [(tuple(getattr(k, "key", k) for k in path), v) for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_run_records_config_wall_time_and_compile_time(reference):
    cfg = json.loads((reference / "config.json").read_text())
    assert cfg["train"]["steps"] == 6 and cfg["model"]["d_model"] == 32  # the resolved config, overrides applied
    recs = records(reference)
    assert all(isinstance(r["wall_time"], float) for r in recs)
    assert [r["wall_time"] for r in recs] == sorted(r["wall_time"] for r in recs)
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["compile_seconds"] > 0 and summary["tokens_per_sec"] > 0
    events = list((reference / "tensorboard").glob("events.out.tfevents.*"))
    assert events and any(b"config" in e.read_bytes() and b"d_model" in e.read_bytes() for e in events)


def test_profile_steps_write_a_trace(tmp_path):
    # the 6-step run of the other tests: the same compiled step
    rc = main([*ARGS, "--workdir", str(tmp_path), "--config.train.steps=6", "--config.train.profile_steps=2,3"])
    assert rc == 0
    assert list((tmp_path / "profile").rglob("*.xplane.pb")), "no jax.profiler trace"
    for bad in ("3,2", "0,1", "5", "a,b"):
        with pytest.raises(ValueError, match="train.profile_steps"):
            config_lib.parse_args([*ARGS, "--workdir", str(tmp_path), f"--config.train.profile_steps={bad}"])


def test_sigterm_during_start_up_exits_cleanly(tmp_path, monkeypatch, caplog):
    import signal

    from lpt.train import loop

    real = loop.program

    def program_then_sigterm(cfg, mesh):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the program is being built
        return real(cfg, mesh)

    monkeypatch.setattr(loop, "program", program_then_sigterm)
    assert run(tmp_path) == 0
    assert any("stopped during start-up, before step 1" in r.message for r in caplog.records)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is given back


def _files(workdir) -> dict:
    """Every file of a run but the lock (rewritten by each trainer that takes the workdir)."""
    return {
        p.relative_to(workdir): p.read_bytes() for p in Path(workdir).rglob("*") if p.is_file() and p.name != "lpt.lock"
    }


@pytest.mark.parametrize(
    "change, keys",
    [
        (
            ["--config.model.n_heads=8", "--config.model.n_kv_heads=4"],
            ["model.n_heads=4 -> 8", "model.n_kv_heads=2 -> 4"],
        ),
        (["--config.precision.param_dtype=bfloat16"], ["precision.param_dtype='float32' -> 'bfloat16'"]),
        (["--config.train.global_batch=16"], ["train.global_batch=8 -> 16"]),
        (["--config.train.seed=1"], ["train.seed=0 -> 1"]),  # every step's randomness (stochastic rounding, PQT)
    ],
    ids=["heads", "param_dtype", "global_batch", "seed"],
)
def test_a_checkpoint_of_another_model_or_recipe_never_resumes(reference, tmp_path, capsys, change, keys):
    """The same array shapes (n_heads 4 -> 8 with n_kv_heads 2 -> 4 at the same width; f32 master weights viewed in
    bf16) or another data position: one error line naming every changed key, and the run's files byte-identical."""
    work = tmp_path / "run"
    shutil.copytree(reference, work)
    before = _files(work)
    rc = main([*ARGS, "--workdir", str(work), "--config.train.steps=6", *change])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: checkpoint step 6 ") and "another model" in err[-1], err[-3:]
    for key in keys:
        assert key in err[-1]
    assert _files(work) == before and not (work / "checkpoints_damaged").exists()


def test_knobs_that_keep_the_state_resume_and_a_longer_schedule_is_announced(reference, tmp_path, caplog):
    work = tmp_path / "run"
    shutil.copytree(reference, work)
    knobs = ["--config.train.log_every=2", "--config.model.remat=true", "--config.train.diagnostics_every=3"]
    with caplog.at_level("WARNING"):
        assert main([*ARGS, "--workdir", str(work), "--config.train.steps=8", *knobs]) == 0
    assert json.loads((work / "summary.json").read_text())["final_step"] == 8
    warning = [r.getMessage() for r in caplog.records if "learning-rate schedule differs" in r.getMessage()]
    assert len(warning) == 1 and "train.steps 6 -> 8" in warning[0] and "lr at step 7" in warning[0]


def test_a_changed_worker_count_resumes_exactly_and_moves_nothing(crashed, reference, tmp_path):
    """data.worker_count is a performance knob: the run resumes at its step with the same batches (the data position
    is the step), every checkpoint stays where it is and metrics.jsonl keeps its history."""
    shutil.copytree(crashed, tmp_path, dirs_exist_ok=True)  # checkpoints 2 and 4, then a crash
    steps = []
    hook = lambda step, ckpt: steps.append(step)  # noqa: E731
    argv = [*ARGS, "--workdir", str(tmp_path), "--config.train.steps=6", "--config.data.worker_count=1"]
    assert main(argv, hooks=[hook]) == 0 and steps == [5, 6]  # resumed from step 4
    assert not (tmp_path / "checkpoints_damaged").exists()
    assert losses(tmp_path) == losses(reference)  # resume: the same program on the same batches, bit for bit


@pytest.mark.parametrize("steps", [4, 5])
def test_a_finished_run_rerun_with_fewer_steps_is_left_alone(reference, tmp_path, capsys, steps):
    """summary.json, metrics.jsonl and the checkpoints of the 6-step run stay byte-identical (the model is at step 6,
    so nothing may be recorded as step 4 or 5)."""
    work = tmp_path / "run"
    shutil.copytree(reference, work)
    before = _files(work)
    assert main([*ARGS, "--workdir", str(work), f"--config.train.steps={steps}"]) == 0
    assert _files(work) == before


def test_an_unfinished_run_past_a_smaller_step_count_is_an_error(crashed, tmp_path, capsys):
    shutil.copytree(crashed, tmp_path, dirs_exist_ok=True)  # checkpoints 2 and 4, no summary
    before = _files(tmp_path)
    rc = main([*ARGS, "--workdir", str(tmp_path), "--config.train.steps=3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        rc == 2
        and err[-1].startswith("error: the newest checkpoint in ")
        and "is step 4, past train.steps=3" in err[-1]
    )
    assert _files(tmp_path) == before


def _fail_to_compile(monkeypatch):
    """The train step raises while it is traced: a config that does not compile."""
    import jax

    from lpt.train import loop

    def broken(*args, **kwargs):
        def step(state, batch):
            raise ValueError("the train step does not compile")

        return jax.jit(step)

    monkeypatch.setattr(loop.step_lib, "make_train_step", broken)


def test_a_run_that_fails_before_its_first_step_rewrites_nothing(crashed, tmp_path, monkeypatch, capsys):
    """An unfinished run started again with a config that does not compile: config.json, metrics.jsonl, the
    TensorBoard files and the checkpoints stay byte-identical. In a new workdir, the directories the run created
    (its parent included) are removed again."""
    shutil.copytree(crashed, tmp_path, dirs_exist_ok=True)
    before = _files(tmp_path)
    _fail_to_compile(monkeypatch)
    rc = main([*ARGS, "--workdir", str(tmp_path), "--config.train.steps=6", "--config.train.log_every=2"])
    assert rc == 2 and capsys.readouterr().err.strip().splitlines()[-1] == "error: the train step does not compile"
    assert _files(tmp_path) == before
    new = tmp_path / "runs" / "new"
    assert main([*ARGS, "--workdir", str(new)]) == 2
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config.train.seed=99999999999999999999"], "config key train.seed=99999999999999999999 must be a seed in"),
        (["--config.data.shuffle_seed=-1"], "config key data.shuffle_seed=-1 must be a seed in [0, 2**63)"),
        (["--workdir", "x" * 256], "cannot be created: File name too long"),
        (["--process_id", "5", "--num_processes", "2", "--coordinator", "localhost:1"], "--process_id=5 must be in"),
        (["--num_processes", "2"], "--coordinator, --num_processes and --process_id must be given together"),
    ],
    ids=["seed", "shuffle_seed", "long_name", "process_id", "num_processes"],
)
def test_bad_seeds_and_names_are_one_error_line_and_create_nothing(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    rc = main([*ARGS, "--workdir", str(tmp_path / "runs" / "w"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: ") and message in err[-1], err[-3:]
    assert list(tmp_path.iterdir()) == []


def test_a_dangling_symlink_workdir_names_its_target(tmp_path, capsys):
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "gone")
    rc = main([*ARGS, "--workdir", str(link)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == (
        f"error: --workdir {str(link)!r} is a symlink to {str(tmp_path / 'gone')!r}, which does not exist; create "
        "that directory or give another --workdir"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and link.is_symlink()


@pytest.mark.parametrize("damage", ["directory", "not_json"])
def test_a_finished_runs_damaged_summary_is_named_and_left_alone(reference, tmp_path, capsys, damage):
    work = tmp_path / "run"
    shutil.copytree(reference, work)
    summary = work / "summary.json"
    summary.unlink()
    if damage == "directory":
        summary.mkdir()
    else:
        summary.write_text('{"final_step": 6, "eval_')
    before = _files(work)
    rc = main([*ARGS, "--workdir", str(work), "--config.train.steps=6"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith(f"error: {summary} is not ") and "\n" not in err[-1], err[-3:]
    assert _files(work) == before and summary.exists()


def test_a_full_disk_mid_save_is_one_error_line_and_exit_3(tmp_path, capsys):
    """The write of checkpoint 4 fails (orbax reports a full disk as a ValueError from TensorStore): an I/O failure,
    exit 3 and not 2 (bad input), one line naming the step; checkpoint 2 stays complete and the run resumes."""

    def full_disk(step, ckpt):
        if step == 3:

            def save(*args, **kwargs):
                raise ValueError('RESOURCE_EXHAUSTED: Error writing local file "_sharding": No space left on device')

            ckpt.manager.save = save

    rc = main([*ARGS, "--workdir", str(tmp_path), "--config.train.steps=6"], hooks=[full_disk])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 3 and err[-1].startswith("error: could not write checkpoint step 4 in "), err[-3:]
    assert "No space left on device" in err[-1] and "run again to resume" in err[-1]
    steps = []
    assert (
        main([*ARGS, "--workdir", str(tmp_path), "--config.train.steps=6"], hooks=[lambda s, c: steps.append(s)]) == 0
    )
    assert steps == [3, 4, 5, 6]


def test_a_checkpoint_without_checksums_resumes_with_one_warning(reference, tmp_path, capsys):
    work = tmp_path / "run"
    shutil.copytree(reference, work)
    (work / "summary.json").unlink()  # an unfinished run at step 6: resumes, evaluates, finishes
    meta_file = work / "checkpoints" / "6" / "metadata" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["checksum"], meta["checksums"]  # what an lpt without checksums saved
    meta_file.write_text(json.dumps(meta))
    assert main([*ARGS, "--workdir", str(work), "--config.train.steps=6"]) == 0
    err = capsys.readouterr().err
    assert err.count("has no checksums") == 1 and "restored unverified" in err
    assert "_CHECKPOINT_METADATA" not in err  # orbax's warning on every resume is not printed


def test_checkpoint_metadata_without_lpts_keys_is_one_error_line(reference, tmp_path, capsys):
    work = tmp_path / "run"
    shutil.copytree(reference, work)
    (work / "checkpoints" / "6" / "metadata" / "metadata").write_text("{}")
    before = _files(work)
    rc = main([*ARGS, "--workdir", str(work), "--config.train.steps=8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: checkpoint step 6 in ") and "metadata without lpt's keys" in err[-1]
    assert _files(work) == before and not (work / "checkpoints_damaged").exists()


@pytest.mark.parametrize(
    "lost, change",
    [("directory", []), ("directory", ["--config.model.d_model=48"]), ("steps", [])],
    ids=["rm_checkpoints", "rm_checkpoints_other_model", "rm_every_step"],
)
def test_a_finished_run_whose_checkpoints_are_gone_is_never_trained_over(reference, tmp_path, capsys, lost, change):
    """``rm -r checkpoints`` (or every step in it) after a finished run: the same command, or one for another model,
    is one error line and leaves metrics.jsonl, summary.json and config.json byte-identical."""
    work = tmp_path / "run"
    shutil.copytree(reference, work)
    if lost == "directory":
        shutil.rmtree(work / "checkpoints")
    else:
        for step in (work / "checkpoints").iterdir():
            shutil.rmtree(step)
    before = _files(work)
    rc = main([*ARGS, "--workdir", str(work), "--config.train.steps=6", *change])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "holds a run's history (config.json, metrics.jsonl, summary.json" in err[-1], err[-3:]
    assert _files(work) == before and (work / "checkpoints").exists() == (lost == "steps")


def test_a_run_killed_before_its_first_checkpoint_starts_again(reference, tmp_path):
    assert run(tmp_path, crash_after=1) == -1  # config.json and step 1's record written, no checkpoint yet
    assert (tmp_path / "config.json").is_file() and not any((tmp_path / "checkpoints").iterdir())
    assert run(tmp_path) == 0
    assert losses(tmp_path) == losses(reference)


@pytest.mark.parametrize(
    "name, kind",
    [
        ("checkpoints", "file"),
        ("config.json", "directory"),
        ("metrics.jsonl", "directory"),
        ("loss.png", "directory"),
        ("tensorboard", "file"),
    ],
)
def test_run_files_of_the_wrong_kind_stop_the_run_before_it_writes(reference, tmp_path, capsys, name, kind):
    """An unfinished run (summary.json removed) whose checkpoints/ or tensorboard/ is a file, or whose config.json,
    metrics.jsonl or loss.png is a directory: one error line naming it, before anything is written or cut."""
    work = tmp_path / "run"
    shutil.copytree(reference, work)
    (work / "summary.json").unlink()
    path = work / name
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    path.mkdir() if kind == "directory" else path.write_text("mine")
    before = _files(work)
    rc = main([*ARGS, "--workdir", str(work), "--config.train.steps=6"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith(f"error: {path} is not a "), err[-3:]
    assert _files(work) == before and sorted(p.name for p in work.iterdir()) == sorted(
        p.name for p in reference.iterdir() if p.name != "summary.json"
    )


def test_when_every_checkpoint_is_damaged_the_history_goes_aside_with_them(crashed, reference, tmp_path, capsys):
    """Both checkpoints of an unfinished run truncated: they are moved aside and the run's records go with them,
    byte-identical; the next run starts from step 0 in a clean workdir and reproduces the reference."""
    shutil.copytree(crashed, tmp_path, dirs_exist_ok=True)  # checkpoints 2 and 4, metrics of steps 1-5
    for step in (2, 4):
        f = _largest_state_file(tmp_path, step)
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    history = {n: (tmp_path / n).read_bytes() for n in ("config.json", "metrics.jsonl")}
    assert run(tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "none of the checkpoints" in err[-1] and "the run history that went with them is in" in err[-1]
    aside = list((tmp_path / "checkpoints_damaged").glob("history-*"))
    assert len(aside) == 1 and {n: (aside[0] / n).read_bytes() for n in history} == history
    assert not (tmp_path / "metrics.jsonl").exists()
    assert run(tmp_path) == 0
    assert losses(tmp_path) == losses(reference)
    assert {n: (aside[0] / n).read_bytes() for n in history} == history  # kept, never truncated


def test_a_changed_corpus_behind_the_same_paths_never_resumes(tmp_path, capsys):
    """A text run crashed after step 5 (checkpoints 2 and 4); then a file is added and another deleted under the same
    data.paths glob: the next run is one error line naming both changes, and the run's files stay byte-identical.
    With the corpus restored it resumes."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = (ROOT_DOCS / "optim.md").read_text()
    for i, name in enumerate(("a.txt", "b.txt", "c.txt")):
        (corpus / name).write_text(text[i * 3000 : (i + 1) * 3000 + 20_000])
    work = tmp_path / "run"
    data = ["--config.data.source=text", f"--config.data.paths={corpus}/*.txt"]
    data.append(f"--config.data.cache_dir={tmp_path / 'cache'}")
    argv = [*ARGS, "--workdir", str(work), "--config.train.steps=6", *data]

    def crash(step, ckpt):
        if step == 5:
            raise Crash(step)

    with pytest.raises(Crash):
        main(argv, hooks=[crash])
    before = _files(work)
    kept = (corpus / "c.txt").read_bytes()
    (corpus / "c.txt").unlink()
    (corpus / "d.txt").write_text(text[:5000])
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: checkpoint step 4 in ") and "saved on another corpus" in err[-1], err[-3:]
    assert "file d.txt added" in err[-1] and "file c.txt deleted" in err[-1]
    assert _files(work) == before
    (corpus / "d.txt").unlink()
    (corpus / "c.txt").write_bytes(kept)
    steps = []
    assert main(argv, hooks=[lambda s, c: steps.append(s)]) == 0 and steps == [5, 6]
