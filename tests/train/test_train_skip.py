"""train.bad_step="skip": a NaN batch and a loss-spike batch leave params and optimizer state bit for bit as they were
(bf16 Kahan recipe: compensation, stochastically rounded moments and the step count all in the state); the guard's
statistics; a real run counts its skips in metrics.jsonl and resumes them exactly."""

import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import tiny_config, train_tiny

from lpt import data as data_lib
from lpt.train import config as config_lib
from lpt.train import guard as guard_lib
from lpt.train import loop
from lpt.train import state as state_lib

LONGER = {"train.steps": "40", "train.global_batch": "8", "optim.warmup_steps": "5", "optim.lr": "3e-3"}


def _bits(tree) -> list[np.ndarray]:
    return [np.asarray(x).view(np.dtype(f"u{np.asarray(x).dtype.itemsize}")) for x in jax.tree.leaves(tree)]


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(_bits(a), _bits(b), strict=True))


def _program(bad_step: str):
    overrides = {**LONGER, "train.bad_step": bad_step, "train.spike_sigmas": "6"}
    cfg = config_lib.resolve(tiny_config(overrides, config="tiny_cpu_bf16_kahan"))
    prog = loop.program(cfg, loop.make_mesh(cfg))  # the trainer's own model, optimizer, layout and jitted step
    state = state_lib.create_state(cfg, prog.tx, prog.shardings)
    step = prog.train_step
    batches = data_lib.make_train_iterator(cfg.data, seq_len=32, global_batch=cfg.train.global_batch)
    return cfg, state, step, batches


def _copy(state):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), state)  # the step donates its input


def _warm(mode: str):
    """(cfg, state after 25 good steps, the step, the batch iterator) of the ``train.bad_step=mode`` program."""
    cfg, state, step, batches = _program(mode)
    for _ in range(25):
        state, m = step(state, next(batches))
        assert math.isfinite(float(m["loss"]))
    return cfg, state, step, batches


@pytest.fixture(scope="module")
def after_warmup():
    """``after_warmup(mode)``: :func:`_warm` of ``mode``, built the first time a test of the file asks for that mode
    (each mode is a program of its own, compiled for the tests that use it)."""
    built = {}

    def get(mode: str):
        if mode not in built:
            built[mode] = _warm(mode)
        return built[mode]

    return get


def _bad_batches(cfg, batch):
    vocab = cfg.model.vocab_size or 256
    nan = {**batch, "targets": np.full_like(batch["targets"], vocab)}  # out-of-vocab targets: the loss is NaN
    spike = {**batch, "targets": np.zeros_like(batch["targets"])}  # NUL bytes, which the text never has: ~8+ nats
    return {"nan": nan, "spike": spike}


@pytest.mark.parametrize("kind", ["nan", "spike"])
def test_a_bad_step_leaves_params_and_optimizer_state_bit_for_bit(after_warmup, kind):
    cfg, state, step, batches = after_warmup("skip")
    state = _copy(state)
    batch = _bad_batches(cfg, next(batches))[kind]
    before = _copy(state)
    after, m = step(state, batch)
    assert float(m["skipped"]) == 1.0 and float(m["skipped_in_a_row"]) == 1.0  # a flag and a count: exact
    if kind == "nan":
        assert not math.isfinite(float(m["loss"]))
    else:
        g = before.guard
        over = lambda x, mean, var: float(x) > float(mean) + 6 * math.sqrt(float(var))  # spike_sigmas = 6
        assert over(m["loss"], g.loss_mean, g.loss_var) or over(m["grad_norm"], g.norm_mean, g.norm_var)
    assert int(after.step) == int(before.step) + 1  # the step (and with it the data position) advances
    assert _same(after.params, before.params)
    assert _same(after.opt_state, before.opt_state)  # Kahan compensation, moments, the step count
    assert float(after.guard.loss_mean) == float(before.guard.loss_mean)  # a bad step does not move the bar
    # the next good step is applied as usual
    later, m2 = step(_copy(after), next(batches))
    assert float(m2["skipped"]) == 0.0 and float(m2["skipped_in_a_row"]) == 0.0  # a flag and a count: exact
    assert not _same(later.params, after.params) and not _same(later.opt_state, after.opt_state)


def test_the_update_is_a_conditional_a_bad_step_does_not_run(after_warmup):
    """The skip program runs the optimizer update under a ``cond`` on the guard's verdict (lpt.train.guard.if_good)
    whose outputs are the new params and optimizer state: a good step's state is the update's own output, not a select
    of the new and the old state (a pass over both), and a bad step runs no update."""
    cfg, state, step, batches = after_warmup("skip")
    jaxpr = step.trace(state, next(batches)).jaxpr.jaxpr
    while len(jaxpr.eqns) == 1 and "jaxpr" in jaxpr.eqns[0].params:  # the jitted body
        jaxpr = jaxpr.eqns[0].params["jaxpr"].jaxpr
    avals = lambda xs: [(tuple(x.shape), x.dtype) for x in xs]
    updated = avals(jax.tree.leaves((state.params, state.opt_state)))
    conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    assert [avals(v.aval for v in e.outvars) for e in conds] == [updated]


def test_with_stop_the_same_bad_step_changes_the_state(after_warmup):
    """The comparison the skip test rests on: without skipping, the NaN batch's step does change the state."""
    cfg, state, step, batches = after_warmup("stop")
    before = _copy(state)
    after, m = step(_copy(state), _bad_batches(cfg, next(batches))["nan"])
    assert "skipped" not in m and not math.isfinite(float(m["loss"]))
    assert not _same(after.opt_state, before.opt_state)


def test_guard_statistics_and_counters():
    g = guard_lib.init()
    good, g = guard_lib.judge(g, jnp.float32(2.0), jnp.float32(1.0), 3.0)
    # the first good step starts the mean at its value and the variance at 0 (a select, no arithmetic): exact
    assert bool(good) and float(g.loss_mean) == 2.0 and float(g.loss_var) == 0.0 and int(g.good) == 1
    for x in (2.1, 1.9) * 15:  # 31 good steps: past the warmup
        good, g = guard_lib.judge(g, jnp.float32(x), jnp.float32(1.0 + x / 100), 3.0)
        assert bool(good)
    mean, sd = float(g.loss_mean), math.sqrt(float(g.loss_var))
    assert abs(mean - 2.0) < 0.05 and 0.05 < sd < 0.15
    for loss, norm, ok in [
        (float("nan"), 1.0, False),
        (2.0, float("inf"), False),
        (mean + 3.5 * sd, 1.02, False),  # a loss spike
        (2.0, 5.0, False),  # a grad-norm spike
        (mean + 2.5 * sd, 1.02, True),
    ]:
        good, g2 = guard_lib.judge(g, jnp.float32(loss), jnp.float32(norm), 3.0)
        assert bool(good) == ok, (loss, norm)
        assert int(g2.in_a_row) == (0 if ok else 1) and int(g2.skipped) == (0 if ok else 1)
        if not ok:
            assert float(g2.loss_mean) == float(g.loss_mean) and float(g2.norm_var) == float(g.norm_var)
    good, _ = guard_lib.judge(g, jnp.float32(mean + 100 * sd), jnp.float32(1.0), 0.0)
    assert bool(good)  # spike_sigmas = 0: only non-finite steps are bad
    back = guard_lib.from_json(json.loads(json.dumps(guard_lib.to_json(g))))
    assert _same(back, g)  # the checkpoint metadata holds the guard exactly


def test_spike_threshold_must_not_be_negative():
    with pytest.raises(ValueError, match=r"train.spike_sigmas=-1.0 must be >= 0"):
        config_lib.apply_overrides(config_lib.defaults(), {"train.spike_sigmas": "-1"})
    with pytest.raises(ValueError, match=r"train.bad_step.*'retry'.*stop, skip"):
        config_lib.apply_overrides(config_lib.defaults(), {"train.bad_step": "retry"})


SKIPPING = {**LONGER, "train.checkpoint_every": "20", "train.eval_every": "40", "train.bad_step": "skip"}
SKIPPING.update({"train.spike_sigmas": "1e-6", "train.max_skips": "1000"})  # any value above its mean is a "spike"


def _train(workdir) -> None:
    train_tiny(workdir, SKIPPING)


def _records(workdir) -> dict:
    from lpt.train import metrics

    return {r["step"]: r for r in metrics.read_jsonl(Path(workdir) / "metrics.jsonl") if "loss" in r}


def test_a_run_counts_its_skips_and_resumes_them_exactly(tmp_path):
    """A run whose spike threshold is its running mean skips some steps after the warmup, finishes, and logs them
    (``skipped``, ``skipped_total``); resumed from its step-20 checkpoint (copied into a workdir of its own) it
    skips the same steps with the same losses, so the guard's statistics came back from the checkpoint exactly
    (with fresh ones it would judge nothing for another 20 steps)."""
    _train(tmp_path / "a")
    a = _records(tmp_path / "a")
    skipped = [s for s, r in a.items() if r["skipped"] == 1.0]  # a 0/1 flag: exact
    assert skipped and min(skipped) > guard_lib.WARMUP and a[40]["skipped_total"] == len(skipped)
    assert any(s > 20 for s in skipped) and json.loads((tmp_path / "a" / "summary.json").read_text())
    meta = json.loads((tmp_path / "a" / "checkpoints" / "20" / "metadata" / "metadata").read_text())
    assert meta["guard"]["good"] == 20 - sum(s <= 20 for s in skipped)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "20", tmp_path / "b" / "checkpoints" / "20")
    _train(tmp_path / "b")
    b = _records(tmp_path / "b")
    assert sorted(b) == list(range(21, 41))
    assert [(s, b[s]["loss"], b[s]["skipped"]) for s in range(21, 41)] == [
        (s, a[s]["loss"], a[s]["skipped"]) for s in range(21, 41)
    ]


def test_more_bad_steps_in_a_row_than_max_skips_stop_with_their_count(tmp_path):
    from types import SimpleNamespace

    from lpt.train import metrics

    cfg = config_lib.resolve(tiny_config({"train.bad_step": "skip", "train.max_skips": "2"}))
    ckpt = SimpleNamespace(manager=SimpleNamespace(latest_step=lambda: None), directory=tmp_path)
    logger = loop._Logger(cfg, metrics.MetricsWriter(tmp_path, enabled=False), ckpt, 0, disable=True)
    nan = float("nan")
    bad = {"loss": nan, "grad_norm": nan, "params_finite": 1.0, "skipped": 1.0, "skipped_total": 3.0}
    logger.add(5, {**bad, "skipped_in_a_row": 3.0}, False)
    with pytest.raises(loop.NonFiniteLossError, match=r"^step 5 is bad step 3 in a row .*more than train.max_skips=2"):
        logger.drain()
