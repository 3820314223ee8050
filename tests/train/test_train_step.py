"""The jitted train step: gradient accumulation over microbatches equals the full-batch step (in-process)."""

from pathlib import Path

import jax
import numpy as np
import pytest

from lpt.train import config as config_lib
from lpt.train import mesh as mesh_lib
from lpt.train import optimizer
from lpt.train import state as state_lib
from lpt.train import step as step_lib

ROOT = Path(__file__).resolve().parents[2]
SMALL = {
    "model.d_model": "32",
    "model.n_layers": "1",
    "model.n_heads": "2",
    "model.n_kv_heads": "2",
    "model.d_ff": "64",
    "model.max_seq_len": "16",
    "data.seq_len": "16",
    "train.global_batch": "8",
    "train.steps": "3",
    "optim.warmup_steps": "0",
    "optim.schedule": "constant",
}


def _run(microbatches: int, batches, **overrides):
    cfg = config_lib.apply_overrides(
        config_lib.load_config_file(ROOT / "configs" / "tiny_cpu.py"),
        {**SMALL, "optim.microbatches": str(microbatches), **overrides},
    )
    mesh = mesh_lib.make_mesh(cfg.train.mesh)
    tx = optimizer.make_optimizer(cfg)
    model_def = state_lib.make_model_def(cfg)
    shardings = state_lib.state_shardings(state_lib.abstract_state(cfg, tx), model_def, mesh)
    state = state_lib.create_state(cfg, tx, shardings)
    step = step_lib.make_train_step(cfg, model_def, tx, optimizer.make_schedule(cfg.optim, 3), mesh, shardings)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append((float(m["loss"]), float(m["grad_norm"])))
    return losses, jax.tree.leaves(state.params)


def test_microbatched_step_matches_full_batch():
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        tokens = rng.integers(0, 256, size=(8, 17), dtype=np.int32)
        batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    full_losses, full_params = _run(1, batches)
    micro_losses, micro_params = _run(4, batches)
    # loss and gradient are means over equal-size microbatches (gradients summed in f32 and divided by 4); the grad
    # norm catches a wrong scale that Adam's normalisation would hide in the params. The two steps add the same
    # positive terms in other orders: with independent roundings (Higham & Mary 2019) a sum of n positive f32 terms
    # errs by at most sqrt(n/3)·u relative in standard deviation, and 6σ per program bounds it except with
    # probability 2e-9: the loss averages 8·16 = 128 per-token cross entropies (12σ = 4.7e-6 < 1e-5, their f32
    # logits agreeing far closer), the grad norm is the square root of a sum of one square per parameter
    micro, full = np.asarray(micro_losses), np.asarray(full_losses)
    n_params = sum(p.size for p in full_params)
    np.testing.assert_allclose(micro[:, 0], full[:, 0], rtol=1e-5)
    np.testing.assert_allclose(micro[:, 1], full[:, 1], rtol=12 * np.sqrt(n_params / 3) * 2.0**-24 / 2)
    assert full_losses[2][0] < full_losses[0][0]  # the steps do update the model
    for a, b in zip(full_params, micro_params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_float8_params_get_float32_adam_moments():
    import jax.numpy as jnp

    cfg = config_lib.apply_overrides(
        config_lib.load_config_file(ROOT / "configs" / "tiny_cpu.py"),
        {"precision.param_dtype": "float8_e4m3fn", "precision.update_rule": "stochastic", "optim.warmup_steps": "0"},
    )
    tx = optimizer.make_optimizer(cfg)
    params = {"w": jnp.full((64, 8), 0.5, jnp.float8_e4m3fn)}
    grads = {"w": jnp.zeros((64, 8), jnp.float8_e4m3fn).at[:32].set(0.25)}  # zero rows: what fp8 grads underflow to
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)(grads, state, params)
    # Adam with e4m3 moments: eps = 1e-8 rounds to 0, so zero-gradient rows give 0/0 = NaN. On the f32 view every
    # update is finite, and rows with gradient move down on average (-lr per step, rounded stochastically)
    u = np.asarray(updates["w"], np.float32)
    assert np.isfinite(u).all()
    assert u[:32].mean() < 0


def test_float8_stored_params_get_float32_gradients():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, size=(8, 17), dtype=np.int32)
    batches = [{"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}] * 3
    fp8 = {"precision.param_dtype": "float8_e4m3fn", "precision.update_rule": "stochastic"}
    losses, params = _run(2, batches, **fp8)
    assert all(p.dtype == jax.numpy.float8_e4m3fn for p in params if p.ndim >= 2)  # still stored in fp8
    # differentiated through float32 views; float8 cotangents underflow and lose most of the gradient
    # (measured first-step grad norm: 0.717 through f32 views, 0.109 with fp8 cotangents)
    assert losses[0][1] > 0.4, losses
    assert losses[-1][0] < losses[0][0], losses


FP8 = {**SMALL, "model.d_model": "128", "model.d_ff": "256", "model.n_layers": "2", "model.scan_layers": "True"}
FP8 |= {f"precision.matmul.{k}": "fp8" for k in ("qkv", "out", "up", "down")}


def test_fp8_codes_made_once_per_step_train_as_each_microbatch_does():
    """optim.fp8_gather="step" (FP8 weights quantized once, before the microbatch loop; on a pod, gathered once):
    the same losses, gradient norms and params as quantizing in each of 4 microbatches, up to the f32 round-off of
    programs that XLA may fuse differently (the GEMMs take the same codes). The gather itself is counted in
    tests/kernels/test_kernels_sharded.py (one per step instead of one per microbatch)."""
    rng = np.random.default_rng(1)
    batches = []
    for _ in range(3):
        tokens = rng.integers(0, 256, size=(8, 17), dtype=np.int32)
        batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    each, each_params = _run(4, batches, **FP8)
    once, once_params = _run(4, batches, **FP8, **{"optim.fp8_gather": "step"})
    np.testing.assert_allclose(np.asarray(once), np.asarray(each), rtol=1e-6)
    for a, b in zip(each_params, once_params, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-7)


def test_fp8_codes_once_per_step_refuse_weight_noise():
    overrides = {**FP8, "optim.fp8_gather": "step", "precision.pqt.method": "gaussws"}
    overrides["precision.pqt.layers"] = "up,down"
    with pytest.raises(ValueError, match=r"optim.fp8_gather='step' quantizes each FP8 weight once per step"):
        config_lib.apply_overrides(config_lib.load_config_file(ROOT / "configs" / "tiny_cpu.py"), overrides)
