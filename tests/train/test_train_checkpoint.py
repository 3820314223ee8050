"""Checkpoint fallback on a corrupt latest step, and the NaN guard keeping the last good checkpoint (in-process)."""

import json
import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from lpt.train import guard
from lpt.train.__main__ import main
from lpt.train.checkpoint import Checkpointer
from lpt.train.state import TrainState

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.py")
SMALL = [
    "--config.model.d_model=32",
    "--config.model.n_layers=1",
    "--config.model.n_heads=2",
    "--config.model.n_kv_heads=1",
    "--config.model.d_ff=64",
    "--config.model.max_seq_len=32",
    "--config.data.seq_len=32",
    "--config.train.global_batch=4",
    "--config.train.eval_batches=1",
    "--config.train.log_every=1",
]


def _state(v: float) -> TrainState:
    return TrainState(
        step=jnp.asarray(int(v), jnp.int32),
        params={"w": jnp.full((4, 3), v, jnp.float32)},
        rest={},
        opt_state=({"mu": jnp.full((4, 3), -v, jnp.float32)},),
        guard=guard.init(),
    )


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path):
    ck = Checkpointer(tmp_path, keep=3)
    for s in (1, 2):
        ck.save(s, _state(float(s)), {"step": s}, force=True)
    ck.close()
    # corrupt every data file of step 2's state (a torn write the commit marker did not catch)
    files = [f for f in (tmp_path / "checkpoints" / "2" / "state").rglob("*") if f.is_file()]
    assert files
    for f in files:
        f.write_bytes(b"\x00garbage")
    ck = Checkpointer(tmp_path, keep=3)
    restored, meta = ck.restore_latest(_state(0.0))
    assert [d.name.split("-")[0] for d in (tmp_path / "checkpoints_damaged").iterdir()] == ["2"]  # kept
    assert meta["step"] == 1 and meta["verified"] and ck.steps() == [1]
    np.testing.assert_array_equal(restored.params["w"], np.full((4, 3), 1.0, np.float32))
    np.testing.assert_array_equal(restored.opt_state[0]["mu"], np.full((4, 3), -1.0, np.float32))
    # and if nothing is readable, a clear error instead of silently starting over
    for f in (tmp_path / "checkpoints" / "1" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match=r"none of the checkpoints .* could be read; they were moved to"):
        ck.restore_latest(_state(0.0))
    assert ck.restore_latest(_state(0.0)) is None and ck.steps() == []  # the next run starts over
    ck.close()


def test_checkpoint_of_another_config_is_a_clear_error_and_is_not_moved(tmp_path):
    ck = Checkpointer(tmp_path, keep=3)
    ck.save(1, _state(1.0), {"step": 1}, force=True)
    ck.wait()
    other = _state(0.0).replace(params={"w": jnp.zeros((4, 5), jnp.float32)})
    with pytest.raises(
        ValueError, match=r"step 1 .* holds 3 arrays that do not match the 3 arrays of the current config"
    ):
        ck.restore_latest(other)
    assert ck.steps() == [1] and not (tmp_path / "checkpoints_damaged").exists()
    ck.close()


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    # lr = 1e30 with no warmup: update 1 makes params ~1e30 (finite, checkpointed at step 1); the logits at step 2
    # overflow, so loss 2 is NaN/inf and the run must stop without writing a checkpoint for step 2.
    argv = [
        "--config",
        TINY,
        "--workdir",
        str(tmp_path),
        *SMALL,
        "--config.train.steps=4",
        "--config.optim.lr=1e30",
        "--config.optim.warmup_steps=0",
        "--config.optim.schedule=constant",
        "--config.optim.grad_clip=0",
        "--config.train.checkpoint_every=1",
        "--config.train.eval_every=100",
    ]
    seen: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("lpt.train").addHandler(handler)
    try:
        rc = main(argv)
    finally:
        logging.getLogger("lpt.train").removeHandler(handler)
    assert rc == 1
    msg = " ".join(seen)
    assert "non-finite training state at step 2" in msg and "newest checkpoint is step 1" in msg
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [1]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1]  # the NaN step is not logged as a normal record
