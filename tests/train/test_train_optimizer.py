"""The trainer's optimizer: 16-bit recipes keep Adam's moments with lpt's rounding, "kahan" is the fused step."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lpt.optim
import lpt.optim.fused_adamw
from lpt.train import config as config_lib
from lpt.train import optimizer

ROOT = Path(__file__).resolve().parents[2]
B2 = 0.999  # 0.999 * v rounds back to v in bf16 (8 significant bits): round-to-nearest moments cannot decay


def _cfg(**overrides):
    base = {"precision.param_dtype": "bfloat16", "optim.b2": str(B2), "optim.warmup_steps": "0"}
    base.update({"optim.schedule": "constant", "optim.grad_clip": "0", "optim.weight_decay": "0"})
    return config_lib.apply_overrides(
        config_lib.load_config_file(ROOT / "configs" / "tiny_cpu.py"), {**base, **overrides}
    )


def _second_moment(state):
    """Mean second moment (f32) of the single leaf ``w``, wherever the optimizer keeps it."""
    found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "nu") or hasattr(x, "moments"))]
    for s in found:
        if isinstance(s, lpt.optim.KahanAdamWState):
            return float(jnp.mean(lpt.optim.fused_adamw.kahan_adamw_moments(s)[1]["w"]))
        if hasattr(s, "nu"):
            return float(jnp.mean(s.nu["w"].astype(jnp.float32)))  # moment dtype -> f32
    raise AssertionError(f"no Adam state in {state}")


def _decay(tx, steps: int = 300):
    """Second moment after one step with g = 1 and ``steps`` steps with g = 0, relative to the f32 EMA b2^steps."""
    params = {"w": jnp.full((4096,), 1.0, jnp.bfloat16)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    ones, zeros = jax.tree.map(jnp.ones_like, params), jax.tree.map(jnp.zeros_like, params)
    _, state = update(ones, state, params)
    v0 = _second_moment(state)
    for _ in range(steps):
        _, state = update(zeros, state, params)
    return _second_moment(state) / (v0 * B2**steps)


@pytest.mark.parametrize("rule", ["kahan", "nearest", "stochastic"])
def test_bf16_second_moment_decays_like_f32(rule):
    # optax.adamw (what the trainer used before) stores bf16 moments by rounding to nearest: v never moves
    assert _decay(optax.adamw(1e-3, b2=B2)) > 1.0 / B2**300 * 0.99  # stuck at v0: 1.35x the f32 EMA
    # lpt's moments are computed in f32 and stored by unbiased stochastic rounding: the mean follows the f32 EMA
    assert abs(_decay(optimizer.make_optimizer(_cfg(**{"precision.update_rule": rule}))) - 1.0) < 0.02


def test_kahan_rule_is_the_fused_step_with_diagnostics():
    tx = optimizer.make_optimizer(_cfg(**{"precision.update_rule": "kahan", "optim.grad_clip": "1.0"}))
    params = {"w": jnp.full((8, 8), 1.0, jnp.bfloat16), "b": jnp.zeros((8,), jnp.float32)}
    state = tx.init(params)
    fused = lambda x: isinstance(x, lpt.optim.KahanAdamWState)
    assert sum(map(fused, jax.tree.leaves(state, is_leaf=fused))) == 1  # clip -> kahan_adamw, not optax.adamw
    grads = {"w": jnp.full((8, 8), -1e-3, jnp.bfloat16), "b": jnp.ones((8,), jnp.float32)}
    updates, state = jax.jit(tx.update)(grads, state, params)
    diag = optimizer.optimizer_diagnostics(state)
    # Adam's first step is lr = 3e-3 upwards from 1.0, where the bf16 ulp is 2^-7: below half an ulp, so every
    # weight update is cancelled (Kahan keeps it in the compensation); the f32 leaf moves by -lr
    assert float(diag["update/cancelled_fraction"]) == pytest.approx(64 / 72)  # all 64 bf16 elements, not the 8 f32
    assert float(jnp.abs(lpt.optim.find_compensation(state)["w"].astype(jnp.float32)).min()) > 2e-3  # bf16 -> f32
    np.testing.assert_allclose(np.asarray(updates["b"]), -3e-3, rtol=1e-4)


def test_unknown_moment_rounding_is_rejected_with_the_allowed_values():
    with pytest.raises(ValueError, match=r"precision.moment_rounding.*'exact'.*stochastic, nearest"):
        _cfg(**{"precision.moment_rounding": "exact"})


def test_update_impl_pallas_runs_the_kernel_with_the_xla_numbers():
    params = {"w": (0.02 * jax.random.normal(jax.random.key(0), (64, 128), jnp.float32)).astype(jnp.bfloat16)}
    grads = {"w": (1e-3 * jax.random.normal(jax.random.key(1), (64, 128), jnp.float32)).astype(jnp.bfloat16)}
    out = {}
    for impl in ("xla", "pallas"):
        tx = optimizer.make_optimizer(_cfg(**{"precision.update_rule": "kahan", "precision.update_impl": impl}))
        state, p = tx.init(params), params
        if impl == "pallas":  # the kernel itself is in the step (interpreted on this CPU)
            assert "pallas_call" in str(jax.make_jaxpr(tx.update)(grads, state, p))
        for _ in range(2):
            updates, state = jax.jit(tx.update)(grads, state, p)
            p = lpt.optim.apply_updates(p, updates)
        out[impl] = (p["w"], lpt.optim.find_compensation(state)["w"])
    for a, b in zip(out["xla"], out["pallas"], strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))  # bf16 -> f32
    assert float(jnp.abs(out["xla"][0].astype(jnp.float32) - params["w"].astype(jnp.float32)).max()) > 0


def test_update_impl_pallas_needs_the_bf16_kahan_recipe():
    with pytest.raises(ValueError, match=r"update_impl='pallas'.*update_rule='kahan'.*got 'nearest'"):
        config_lib.build(_cfg(**{"precision.update_rule": "nearest", "precision.update_impl": "pallas"}))


def _state_bytes_per_param(tx, n: int = 4096) -> float:
    state = tx.init({"w": jnp.zeros((n,), jnp.bfloat16)})
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if x.size >= n) / n


@pytest.mark.parametrize("rule", ["kahan", "stochastic"])
def test_moment_dtype_knob_sets_the_stored_moments(rule):
    """precision.moment_dtype: "auto" keeps bf16 moments for bf16 params (4 B/param, plus 2 of compensation for
    Kahan); "float32" stores them in f32 (8 B/param) and they still decay like the f32 EMA."""
    base = {"precision.update_rule": rule}
    extra = 2 if rule == "kahan" else 0  # the bf16 compensation
    auto = optimizer.make_optimizer(_cfg(**base))
    f32 = optimizer.make_optimizer(_cfg(**base, **{"precision.moment_dtype": "float32"}))
    assert _state_bytes_per_param(auto) == 4 + extra
    assert _state_bytes_per_param(f32) == 8 + extra
    assert abs(_decay(f32) - 1.0) < 1e-3  # f32 moments: the EMA itself, up to f32 round-off over 300 steps


def test_moment_dtype_outside_lpt_adamw_is_rejected():
    with pytest.raises(ValueError, match=r"precision.moment_dtype='bfloat16' needs 16-bit params.*'f32_master'"):
        _cfg(**{"precision.update_rule": "f32_master", "precision.moment_dtype": "bfloat16"})
    with pytest.raises(ValueError, match=r"precision.moment_dtype='float8_e4m3fn' needs 16-bit params"):
        _cfg(**{"precision.moment_dtype": "float8_e4m3fn"})  # 8-bit moments: lpt's AdamW only
    with pytest.raises(ValueError, match=r"precision.moment_dtype.*'int8'.*auto, float32, bfloat16"):
        _cfg(**{"precision.moment_dtype": "int8"})
