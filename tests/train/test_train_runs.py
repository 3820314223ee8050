"""End-to-end runs of ``python -m lpt.train`` (tiny model, 6 steps): in subprocesses where a run needs a process
of its own (a SIGKILL, more than one device, two processes), in this process otherwise.

* exact resume: 6 steps straight == (crash by SIGKILL after step 3 in a subprocess, resume) + (SIGTERM at step 5:
  save, clean exit) + resume to 6, bitwise in the loss sequence, the validation loss and every parameter;
* the same losses on a 4-device CPU mesh with fsdp=4, and with data=2 x tensor=2 restored from the 1-device run's
  step-4 checkpoint (restore onto a different mesh);
* the same losses in a 2-process ``jax.distributed`` run on localhost, preempted (SIGTERM to one process) and
  resumed;
* the recipes with optimizer state or randomness of their own (tiny_cpu_bf16_kahan8, tiny_cpu_nvfp4): 4 steps
  straight == preempted (SIGTERM after step 3) and resumed, bitwise, in this process; their losses on a 2-device
  mesh follow the 1-device run.

The subprocesses and this process share the session's persistent compilation cache, so that runs of the same
program compile once.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import fault_runner
import numpy as np
import pytest
from cpu_devices import cpu_env
from run_records import losses, state_arrays, trainer_log

from lpt.train.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--config.model.d_model=32",
    "--config.model.n_layers=1",
    "--config.model.n_heads=2",
    "--config.model.n_kv_heads=2",
    "--config.model.d_ff=64",
    "--config.model.max_seq_len=32",
    "--config.data.seq_len=32",
    "--config.train.global_batch=8",
    "--config.train.steps=6",
    "--config.train.eval_every=3",
    "--config.train.eval_batches=1",
    "--config.train.log_every=1",
    "--config.train.checkpoint_every=2",
    "--config.train.keep_checkpoints=5",
    "--config.optim.warmup_steps=2",
]


@pytest.fixture(scope="module")
def cache_dir():
    """The session's persistent compilation cache (tests/conftest.py): the subprocesses and this process's runs of
    the same program compile it once."""
    return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])


def run(workdir, cache_dir, *extra, devices=1, faults=(), check=True, background=False, config="configs/tiny_cpu.py"):
    """``python -m lpt.train`` on the tiny model; ``faults`` (e.g. ``["--kill-at=3"]``) runs it through
    tests/train/fault_runner.py, which injects them with the loop's hooks."""
    e = cpu_env(
        devices,
        JAX_COMPILATION_CACHE_DIR=str(cache_dir),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    entry = [str(ROOT / "tests" / "train" / "fault_runner.py"), *faults] if faults else ["-m", "lpt.train"]
    cmd = [
        sys.executable,
        *entry,
        "--config",
        config,
        "--workdir",
        str(workdir),
        *TINY,
        *extra,
    ]
    if background:
        return subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    p = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def records(workdir) -> tuple[dict, dict]:
    """(train loss by step, eval loss by step); each step must appear once (a resume drops re-run steps)."""
    return losses(Path(workdir) / "metrics.jsonl")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """6 steps straight on one device, in this process."""
    w = tmp_path_factory.mktemp("ref")
    assert train_here(w, "configs/tiny_cpu.py") == 0
    return w


def test_reference_run_learns_and_writes_artifacts(reference):
    train, evals = records(reference)
    assert sorted(train) == [1, 2, 3, 4, 5, 6] and sorted(evals) == [3, 6]
    assert train[6] < train[1] - 0.3  # it learns (ln 256 = 5.55 at init)
    for name in ("loss.png", "summary.json", "checkpoints/6/metadata"):
        assert (reference / name).exists(), name
    assert list((reference / "tensorboard").glob("events.out.tfevents.*"))
    meta = json.loads(next((reference / "checkpoints" / "6" / "metadata").glob("*")).read_text())
    assert meta["step"] == 6 and meta["process_count"] == 1 and meta["config"]["train"]["steps"] == 6
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["final_step"] == 6 and f"{os.cpu_count()} cores" in summary["machine"]


def test_exact_resume_after_kill_and_sigterm(reference, tmp_path, cache_dir):
    p = run(tmp_path, cache_dir, faults=["--kill-at=3"], check=False)
    assert p.returncode == -9, p.stderr[-2000:]  # hard crash after step 3; newest checkpoint is step 2
    with trainer_log() as log:  # the preemption and the last resume in this process
        assert train_here(tmp_path, "configs/tiny_cpu.py", sigterm_at=5) == 0
    assert any("resumed from step 2" in m for m in log)
    assert any("preempted: saved checkpoint at step 5" in m for m in log)
    with trainer_log() as log:
        assert train_here(tmp_path, "configs/tiny_cpu.py", "--config.train.keep_checkpoints=2") == 0
    assert any("resumed from step 5" in m for m in log)
    assert sorted(int(d.name) for d in (tmp_path / "checkpoints").iterdir() if d.name.isdigit()) == [5, 6]
    assert records(tmp_path) == records(reference)  # bitwise: every train loss and both validation losses
    ref, got = state_arrays(reference, 6), state_arrays(tmp_path, 6)
    assert ref.keys() == got.keys() and len(ref) > 5
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def test_same_losses_on_4_device_meshes(reference, tmp_path, cache_dir):
    ref_train, ref_eval = records(reference)
    fsdp = tmp_path / "fsdp"
    run(fsdp, cache_dir, "--config.train.mesh.data=1", "--config.train.mesh.fsdp=4", devices=4)
    train, evals = records(fsdp)
    np.testing.assert_allclose([train[s] for s in range(1, 7)], [ref_train[s] for s in range(1, 7)], rtol=2e-5)
    np.testing.assert_allclose(evals[6], ref_eval[6], rtol=2e-5)
    # data x tensor, resuming from the 1-device run's step-4 checkpoint: restore onto a different mesh
    dt = tmp_path / "dt"
    shutil.copytree(reference / "checkpoints" / "4", dt / "checkpoints" / "4")
    p = run(dt, cache_dir, "--config.train.mesh.data=2", "--config.train.mesh.tensor=2", devices=4)
    assert "resumed from step 4 (saved on mesh {'data': 1, 'fsdp': 1, 'tensor': 1}" in p.stderr
    train, evals = records(dt)
    assert sorted(train) == [5, 6]
    np.testing.assert_allclose([train[5], train[6], evals[6]], [ref_train[5], ref_train[6], ref_eval[6]], rtol=2e-5)


def test_bad_batch_for_mesh_is_a_clear_error(tmp_path, cache_dir):
    p = run(
        tmp_path,
        cache_dir,
        "--config.train.global_batch=6",
        "--config.train.mesh.fsdp=4",
        "--config.train.mesh.data=1",
        devices=4,
        check=False,
    )
    assert p.returncode == 2
    assert "train.global_batch=6" in p.stderr and "not divisible by mesh data*fsdp = 1*4 = 4" in p.stderr


def test_two_process_distributed_matches_single_process(reference, tmp_path, cache_dir):
    """Two processes, one device each: preempted at step 3 (the signal reaches one process), resumed by two
    processes, and again with one process of two devices (the data position is the step, so the process count may
    change): the losses follow the single-process run."""

    def two_processes(faults=()):
        with socket.socket() as sock:
            sock.bind(("localhost", 0))
            port = sock.getsockname()[1]
        procs = [
            run(
                tmp_path,
                cache_dir,
                f"--coordinator=localhost:{port}",
                "--num_processes=2",
                f"--process_id={i}",
                background=True,
                faults=faults,
            )
            for i in range(2)
        ]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
        return outs

    # SIGTERM reaches only process 1 after step 3: both processes must save step 3 and exit cleanly
    outs = two_processes(["--sigterm-at=3", "--fault-process=1"])
    assert "explicit (localhost" in outs[1] and "mesh {'data': 2, 'fsdp': 1, 'tensor': 1}" in outs[0]
    assert all("preempted: saved checkpoint at step 3" in out for out in outs)
    outs = two_processes(["--sigterm-at=5", "--fault-process=0"])
    assert all("resumed from step 3" in out for out in outs)
    assert all("preempted: saved checkpoint at step 5" in out for out in outs)
    p = run(tmp_path, cache_dir, devices=2)  # one process now
    assert "resumed from step 5" in p.stderr and "1 process(es)" in p.stderr
    ref_train, ref_eval = records(reference)
    train, evals = records(tmp_path)
    np.testing.assert_allclose([train[s] for s in range(1, 7)], [ref_train[s] for s in range(1, 7)], rtol=2e-5)
    np.testing.assert_allclose(evals[6], ref_eval[6], rtol=2e-5)
    assert not (tmp_path / "checkpoints_damaged").exists() and not (tmp_path / "checkpoints" / "6" / "data").exists()


def train_here(workdir, config: str, *extra: str, **faults) -> int:
    """``python -m lpt.train`` on the tiny model in this process (one device); ``faults`` as
    :func:`fault_runner.hooks` takes them (``sigterm_at=3``)."""
    argv = ["--config", str(ROOT / config), "--workdir", str(workdir), *TINY, *extra]
    return main(argv, hooks=fault_runner.hooks(**faults))


def straight_and_resumed(tmp_path, config: str) -> tuple[Path, Path]:
    """4 steps of ``config`` in this process, straight and preempted (SIGTERM after step 3: step 3 saved, a clean
    exit) then resumed; asserts the preemption, the resume and bitwise equal losses. Returns the two workdirs."""
    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    assert train_here(ref, config, "--config.train.steps=4") == 0
    with trainer_log() as log:
        assert train_here(resumed, config, "--config.train.steps=4", sigterm_at=3) == 0
    assert any("preempted: saved checkpoint at step 3" in m for m in log)
    with trainer_log() as log:
        assert train_here(resumed, config, "--config.train.steps=4") == 0
    assert any("resumed from step 3" in m for m in log)
    assert records(resumed) == records(ref)  # bitwise: every train loss and the validation losses
    return ref, resumed


def test_bf16_kahan_recipe_resumes_exactly_and_runs_sharded(tmp_path, cache_dir):
    """The bf16 Kahan recipe with 8-bit moments (tiny_cpu_bf16_kahan8): its fused optimizer state (uint16 moment
    codes, complex64 block scales, bf16 compensation, count) is in the checkpoint and survives a preemption bit for
    bit; on a 2-device fsdp mesh (leaves not sequenced there, scales sharded like the params) the losses follow the
    1-device run."""
    config = "configs/tiny_cpu_bf16_kahan8.py"
    ref, resumed = straight_and_resumed(tmp_path, config)
    a, b = state_arrays(ref, 4), state_arrays(resumed, 4)
    assert a.keys() == b.keys() and all(v.dtype.name == "bfloat16" for v in a.values())
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    a, b = state_arrays(ref, 4, "opt_state"), state_arrays(resumed, 4, "opt_state")
    assert {"uint16", "complex64"} <= {v.dtype.name for v in a.values()}
    assert a.keys() == b.keys()
    for k in a:  # bitwise: the codes, the scales, the compensation and the count
        assert b[k].dtype == a[k].dtype and b[k].tobytes() == a[k].tobytes(), k
    sharded = tmp_path / "fsdp"
    mesh = ("--config.train.steps=4", "--config.train.mesh.data=1", "--config.train.mesh.fsdp=2")
    run(sharded, cache_dir, *mesh, devices=2, config=config)
    (ref_train, _), (train, _) = records(ref), records(sharded)
    np.testing.assert_allclose([train[s] for s in range(1, 5)], [ref_train[s] for s in range(1, 5)], rtol=1e-3)


def test_nvfp4_recipe_resumes_exactly_and_runs_sharded(tmp_path, cache_dir):
    """tiny_cpu_nvfp4 (its stochastic rounding and Hadamard signs come from each layer's step key): a preempted and
    resumed run is bitwise the straight one, losses and parameters; on a 2-device data mesh (tokens split, so dW
    adds the shards' partial sums) the losses follow the 1-device run."""
    config = "configs/tiny_cpu_nvfp4.py"
    ref, resumed = straight_and_resumed(tmp_path, config)
    a, b = state_arrays(ref, 4), state_arrays(resumed, 4)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    sharded = tmp_path / "data2"
    run(sharded, cache_dir, "--config.train.steps=4", "--config.train.mesh.data=2", devices=2, config=config)
    (ref_train, _), (train, _) = records(ref), records(sharded)
    np.testing.assert_allclose([train[s] for s in range(1, 5)], [ref_train[s] for s in range(1, 5)], rtol=1e-3)
