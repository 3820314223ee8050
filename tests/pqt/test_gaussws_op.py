"""gaussws / diffq: forward of Eq. 3, gradients of Eq. 4, same R in forward and backward, Lemma 1, keys."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lpt.pqt as pqt

BF16 = jnp.bfloat16
sample = jax.jit(pqt.pqn_sample, static_argnames=("method", "block", "compute_dtype"))


def padded_noise(key, shape, method, block=32):
    """R as the op draws it: at the shape padded to whole tiles, then sliced back."""
    m, n = shape[-2:]
    padded = tuple(shape[:-2]) + (-(-m // block) * block, -(-n // block) * block)
    return pqt.pqn_noise(key, padded, method)[..., :m, :n]


def tile_max(w, block=32):
    """max|w| per tile by explicit loops over the (possibly partial) tiles."""
    w_np = np.asarray(w, np.float32)
    m, n = w_np.shape[-2:]
    amax = np.zeros(w_np.shape[:-2] + (-(-m // block), -(-n // block)), np.float32)
    for i in range(amax.shape[-2]):
        for j in range(amax.shape[-1]):
            tile = w_np[..., i * block : (i + 1) * block, j * block : (j + 1) * block]
            amax[..., i, j] = np.abs(tile).max(axis=(-2, -1))
    return jnp.asarray(amax)


def reference(w, bt, r, amax, block=32):
    """Straightforward f32 Eq. 3: per-element gather of the tile's step; amax is a constant (∂max/∂w ≈ 0)."""
    m, n = w.shape[-2:]
    rows = np.arange(m) // block
    cols = np.arange(n) // block
    scale = amax * jnp.exp2(1.0 - bt)
    return w + r.astype(jnp.float32) * scale[..., rows[:, None], cols[None, :]]  # bf16 R -> f32 exact


@pytest.mark.parametrize("method", ["gaussws", "diffq"])
def test_forward_and_gradients_match_reference(method):
    shape = (2, 40, 70)  # stacked kernels, neither axis a multiple of 32: partial edge tiles
    key_w, key_b, key_c, key = jax.random.split(jax.random.key(0), 4)
    w = jax.random.normal(key_w, shape, jnp.float32).astype(BF16).astype(jnp.float32)  # bf16-exact f32 weights
    grid = pqt.block_grid(shape)
    bt = jax.random.uniform(key_b, grid, jnp.float32, 3.0, 8.0)
    c = jax.random.normal(key_c, shape, jnp.float32).astype(BF16).astype(jnp.float32)  # bf16-exact cotangent
    r = padded_noise(key, shape, method)
    amax = tile_max(w)

    def loss_op(w, bt):
        return jnp.sum(pqt.pqn_sample(w, bt, key, method=method).astype(jnp.float32) * c)  # bf16 -> f32

    def loss_ref(w, bt):
        return jnp.sum(reference(w, bt, r, amax) * c)

    w_hat = sample(w, bt, key, method=method)
    assert w_hat.dtype == BF16 and w_hat.shape == shape
    ref = np.asarray(reference(w, bt, r, amax))
    pqn = ref - np.asarray(w)
    # ŵ is the reference up to bf16 roundings (of ŵ, of the tile step and, for DiffQ, of the noise)
    err = np.abs(np.asarray(w_hat.astype(jnp.float32)) - ref)  # bf16 -> f32 exact
    assert np.all(err <= 2.0**-7 * (np.abs(ref) + np.abs(pqn)))
    assert np.mean(err) < 0.1 * np.mean(np.abs(pqn))  # without the noise err would be |pqn|
    assert np.mean(np.asarray(r.astype(jnp.float32)) != 0) > 0.25  # noise really was added

    gw, gb = jax.jit(jax.grad(loss_op, argnums=(0, 1)))(w, bt)
    gw_ref, gb_ref = jax.jit(jax.grad(loss_ref, argnums=(0, 1)))(w, bt)
    assert gw.dtype == jnp.float32 and gb.dtype == jnp.float32 and gb.shape == grid
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(gw_ref))  # ∂L/∂w = ∂L/∂ŵ exactly
    np.testing.assert_allclose(np.asarray(gb), np.asarray(gb_ref), rtol=1e-5, atol=1e-6 * np.abs(gb_ref).max())
    assert np.abs(np.asarray(gb)).min() > 0


def test_scalar_bitwidth_gradient_is_sum_over_tiles():
    key = jax.random.key(5)
    w = jax.random.normal(jax.random.key(1), (64, 64))
    grad = jax.jit(jax.grad(lambda b: jnp.sum(pqt.gaussws(w, b, key).astype(jnp.float32))))  # bf16 -> f32
    g_scalar = grad(5.0)
    g_grid = grad(jnp.full((2, 2), 5.0))
    np.testing.assert_allclose(float(g_scalar), float(jnp.sum(g_grid)), rtol=1e-6)


def test_forward_and_backward_see_the_same_r():
    """With w on a coarse grid and b_t = 4, ŵ − w = R/8 exactly, so the forward's R can be read off ŵ."""
    shape = (64, 96)
    w = jax.random.choice(jax.random.key(1), jnp.array([-1.0, -0.5, 0.0, 0.5, 1.0]), shape)
    w = w.at[::32, ::32].set(1.0)  # every tile's max|w| is 1
    bt = jnp.full((2, 3), 4.0)  # step = 1 · 2^(1−4) = 1/8
    key = pqt.pqt_key(jax.random.key(0), "blocks/0/mlp/down", 17)
    g = jax.random.normal(jax.random.key(2), shape).astype(BF16)

    def fwd_bwd(w, bt, key):
        w_hat, vjp = jax.vjp(lambda w, bt: pqt.gaussws(w, bt, key), w, bt)
        return w_hat, vjp(g)[1]

    w_hat, g_bt = jax.jit(fwd_bwd)(w, bt, key)
    r_fwd = (np.asarray(w_hat.astype(jnp.float32)) - np.asarray(w)) * 8  # bf16 -> f32 exact
    np.testing.assert_array_equal(r_fwd, np.round(r_fwd))
    np.testing.assert_array_equal(r_fwd, np.asarray(pqt.rounded_normal(key, shape).astype(jnp.float32)))
    g64 = np.asarray(g.astype(jnp.float32), np.float64)  # bf16 -> f32 -> f64 exact

    def expected(r):  # Eq. 4 with the given R
        return -math.log(2) / 8 * (g64 * r).reshape(2, 32, 3, 32).sum(axis=(1, 3))

    np.testing.assert_allclose(np.asarray(g_bt), expected(r_fwd), rtol=1e-5, atol=1e-5)
    # a backward with another R would be visibly different
    r_other = np.asarray(pqt.rounded_normal(jax.random.fold_in(key, 1), shape).astype(jnp.float32))
    assert np.max(np.abs(expected(r_other) - expected(r_fwd))) > 0.5


def test_keys_layers_and_steps_independent_and_reproducible():
    root = jax.random.key(0)
    n = 1 << 20
    draw = jax.jit(lambda k: pqt.rounded_normal(k, (n,)))
    r_a5 = np.asarray(draw(pqt.pqt_key(root, "blocks/0/attn/out", 5)).astype(jnp.float32))
    r_b5 = np.asarray(draw(pqt.pqt_key(root, "blocks/0/mlp/down", 5)).astype(jnp.float32))
    r_a6 = np.asarray(draw(pqt.pqt_key(root, "blocks/0/attn/out", 6)).astype(jnp.float32))
    again = np.asarray(draw(pqt.layer_key(pqt.step_key(root, 5), ("blocks", 0, "attn", "out"))).astype(jnp.float32))
    np.testing.assert_array_equal(r_a5, again)  # a function of (seed, step, path) only
    p_equal = sum(p * p for p in pqt.ROUNDED_NORMAL_PMF.values())  # ≈ 0.553 for independent draws
    sd = math.sqrt(p_equal * (1 - p_equal) / n)
    for other in (r_b5, r_a6):
        assert abs(np.mean(r_a5 == other) - p_equal) < 5 * sd
        assert abs(np.corrcoef(r_a5, other)[0, 1]) < 5 / math.sqrt(n)
    with pytest.raises(ValueError, match="non-empty"):
        pqt.layer_key(root, "")


@jax.jit
def lemma1_weights(key):
    """256×256 bf16 weights spanning ~20 binades inside every tile: the hard case for underflow."""
    shape = (256, 256)
    k1, k2, k3 = jax.random.split(key, 3)
    mant = jax.random.uniform(k1, shape, jnp.float32, 1.0, 2.0)
    expo = jax.random.randint(k2, shape, -20, 1).astype(jnp.float32)  # int32 -> f32 exact
    sign = jnp.where(jax.random.bernoulli(k3, 0.5, shape), -1.0, 1.0)
    return (sign * mant * jnp.exp2(expo)).astype(BF16)  # f32 -> bf16


@functools.partial(jax.jit, static_argnames="method")
def count_underflows(w, bt, key, method):
    """(# elements whose non-zero noise vanished in ŵ = bf16(w + R·step), # non-zero R)."""
    w_hat = pqt.pqn_sample(w, bt, key, method=method)
    r = pqt.pqn_noise(key, w.shape, method)  # 256×256: no padding
    return jnp.sum((r != 0) & (w_hat == w)), jnp.sum(r != 0)


def test_lemma1_no_underflow_for_bt_le_8_in_bf16():
    w = lemma1_weights(jax.random.key(3))
    grid = pqt.block_grid(w.shape)
    key = jax.random.key(9)
    # b_t spread over [1, 8] with every other tile row at exactly 8
    bt = jnp.where(jnp.arange(grid[0])[:, None] % 2 == 0, 8.0, jnp.linspace(1.0, 8.0, grid[0] * grid[1]).reshape(grid))
    lost, nonzero = count_underflows(w, bt, key, "gaussws")
    assert int(nonzero) > 15_000 and int(lost) == 0
    # the bound is real: beyond m + 2 + τ = 9 noise vanishes ...
    lost_hi, _ = count_underflows(w, jnp.full(grid, 10.0), key, "gaussws")
    assert int(lost_hi) > 100
    # ... and DiffQ (τ = −8) loses noise already at b_t = 4
    lost_u, _ = count_underflows(w, jnp.full(grid, 4.0), key, "diffq")
    assert int(lost_u) > 100


def test_diffq_rounds_noise_then_sum_in_bf16():
    """DiffQ: ŵ = bf16(w + bf16(R · step)) bit for bit under jit (XLA excess precision must not merge roundings)."""
    shape = (64, 64)
    w = jax.random.normal(jax.random.key(1), shape).astype(BF16)  # f32 -> bf16
    key = jax.random.key(2)
    w_hat = jax.jit(lambda w: pqt.diffq(w, 6.0, key))(w)  # b_t = 6: step = max|w| · 2^-5, exact
    w64 = np.asarray(w.astype(jnp.float32), np.float64)  # bf16 -> f32 -> f64 exact
    r64 = np.asarray(pqt.symmetric_uniform(key, shape).astype(jnp.float32), np.float64)
    amax = np.abs(w64).reshape(2, 32, 2, 32).max(axis=(1, 3))
    step = np.repeat(np.repeat(amax * 2.0**-5, 32, 0), 32, 1)
    pqn = (r64 * step).astype(ml_dtypes.bfloat16).astype(np.float64)  # exact f64 product, one bf16 rounding
    expected = (w64 + pqn).astype(ml_dtypes.bfloat16).astype(np.float64)  # exact f64 sum, one bf16 rounding
    got = np.asarray(w_hat.astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(got, expected)
    single = (w64 + r64 * step).astype(ml_dtypes.bfloat16).astype(np.float64)  # one rounding only
    assert np.sum(single != expected) > 0  # the case distinguishes the two roundings


def test_bad_inputs_raise():
    key = jax.random.key(0)
    w = jnp.ones((64, 40))
    with pytest.raises(ValueError, match=r"bitwidth shape \(2, 1\).*\(2, 2\)"):
        pqt.gaussws(w, jnp.ones((2, 1)), key)
    with pytest.raises(ValueError, match="unknown PQT method"):
        pqt.pqn_sample(w, 4.0, key, method="nipq")
    with pytest.raises(ValueError, match="at least 2 axes"):
        pqt.gaussws(jnp.ones((64,)), 4.0, key)
    with pytest.raises(ValueError, match="float"):
        pqt.gaussws(jnp.ones((64, 64), jnp.int32), 4.0, key)
    with pytest.raises(ValueError, match="block"):
        pqt.gaussws(w, 4.0, key, block=0)
    with pytest.raises(ValueError, match="compute_dtype"):
        pqt.gaussws(w, 4.0, key, compute_dtype=jnp.float8_e4m3fn)
