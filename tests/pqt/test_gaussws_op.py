"""gaussws / diffq: forward of Eq. 3, gradients of Eq. 4, same R in forward and backward, Lemma 1, keys.

Each test runs its JAX work inside one or two jitted functions: compiles dominate the wall time on CPU. Those whose
checks hold under any compile (noise made of bit operations, sums of exact products within rigorous bounds, counts
and bit patterns of correctly rounded results, statistics) compile with LLVM's optimizations off (:func:`_run`).
"""

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED
from float_bounds import assert_within, gamma

import lpt.pqt as pqt
from lpt.pqt.gaussws import pqn_noise, pqn_sample

BF16 = jnp.bfloat16


def f64(x):
    return np.asarray(x, np.float32).astype(np.float64)  # bf16/f32 -> f32 -> f64, exact


def _run(f, *args):
    """f(*args) as one jitted program compiled with LLVM's optimizations off (tests/cpu_compile.py)."""
    return jax.jit(f).lower(*args).compile(UNOPTIMIZED)(*args)


def tile_max(w, block=32):
    """max|w| per (possibly partial) tile, by explicit loops in numpy."""
    m, n = w.shape[-2:]
    amax = np.zeros(w.shape[:-2] + (-(-m // block), -(-n // block)), np.float32)
    for i in range(amax.shape[-2]):
        for j in range(amax.shape[-1]):
            tile = w[..., i * block : (i + 1) * block, j * block : (j + 1) * block]
            amax[..., i, j] = np.abs(tile).max(axis=(-2, -1))
    return amax


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
    grid = pqt.block_grid(shape)
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(ml_dtypes.bfloat16).astype(np.float32)  # bf16-exact f32 weights
    c = rng.standard_normal(shape).astype(ml_dtypes.bfloat16).astype(np.float32)  # bf16-exact cotangent
    bt = rng.uniform(3.0, 8.0, grid).astype(np.float32)
    amax = tile_max(w)
    key = jax.random.key(0)

    def run(w, bt, c, amax):
        r = pqn_noise(key, (2, 64, 96), method)[..., :40, :70]  # R as drawn: at the padded shape

        def loss_op(w, bt):
            return jnp.sum(pqn_sample(w, bt, key, method=method).astype(jnp.float32) * c)  # bf16 -> f32

        def loss_ref(w, bt):
            return jnp.sum(reference(w, bt, r, amax) * c)

        w_hat = pqn_sample(w, bt, key, method=method)
        return w_hat, reference(w, bt, r, amax), r, jax.grad(loss_op, (0, 1))(w, bt), jax.grad(loss_ref, (0, 1))(w, bt)

    w_hat, ref, r, (gw, gb), (gw_ref, gb_ref) = _run(run, w, bt, c, amax)
    assert w_hat.dtype == BF16 and w_hat.shape == shape
    ref, pqn = f64(ref), f64(ref) - w
    # ŵ is the reference up to bf16 roundings (of ŵ, of the tile step and, for DiffQ, of the noise)
    err = np.abs(f64(w_hat) - ref)
    assert np.all(err <= 2.0**-7 * (np.abs(ref) + np.abs(pqn)))
    assert np.mean(err) < 0.1 * np.mean(np.abs(pqn))  # without the noise err would be |pqn|
    assert np.mean(f64(r) != 0) > 0.25
    assert gw.dtype == jnp.float32 and gb.dtype == jnp.float32 and gb.shape == grid
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(gw_ref))  # ∂L/∂w = ∂L/∂ŵ exactly
    gb, gb_ref = np.asarray(gb), np.asarray(gb_ref)
    # ∂L/∂b_t = −ln2 · max|w| · 2^(1−b_t) · Σ_tile c·r: both programs sum the same exact products c·r (bf16 times a
    # few-bit R) over a tile (<= 1023 additions, any order) and multiply by three factors (exp2 <= 2 ulps, counted
    # as 4 roundings, and the ln2 constant): each within γ_n·Σ|terms| of the exact value, n = 1023 + 3 + 4 + 1
    terms = np.abs(c * f64(r))
    tile_abs = np.pad(terms, ((0, 0), (0, 64 - 40), (0, 96 - 70))).reshape(2, 2, 32, 3, 32).sum(axis=(2, 4))
    assert_within(gb, gb_ref, 2 * gamma(1031) * math.log(2) * amax * np.exp2(1.0 - bt) * tile_abs, "∂L/∂b_t")
    assert np.abs(gb).min() > 0


def test_scalar_bitwidth_gradient_is_sum_over_tiles():
    key = jax.random.key(5)
    w = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)

    @jax.jit
    def run(w):
        def loss(b):
            return jnp.sum(pqt.gaussws(w, b, key).astype(jnp.float32))  # bf16 -> f32

        return jax.grad(loss)(jnp.float32(5.0)), jax.grad(loss)(jnp.full((2, 2), 5.0))

    g_scalar, g_grid = run(w)
    # each tile's term is (−ln2 · step) · Σ_tile R (an exact integer sum): 2 products, exp2 (<= 2 ulps: 4 roundings),
    # 3 additions over the 4 tiles, in two programs that may fuse and order them differently: 2γ_9·Σ|tile terms|
    np.testing.assert_allclose(
        float(g_scalar), float(jnp.sum(g_grid)), rtol=0, atol=2 * gamma(9) * float(jnp.sum(jnp.abs(g_grid)))
    )


def test_forward_and_backward_see_the_same_r():
    """With w on a coarse grid and b_t = 4, ŵ − w = R/8 exactly, so the forward's R can be read off ŵ."""
    shape = (64, 96)
    rng = np.random.default_rng(1)
    w = rng.choice(np.array([-1.0, -0.5, 0.0, 0.5, 1.0], np.float32), shape)
    w[::32, ::32] = 1.0  # every tile's max|w| is 1
    g = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    bt = np.full((2, 3), 4.0, np.float32)  # step = 1 · 2^(1−4) = 1/8

    def run(w, bt, g):
        key = pqt.pqt_key(jax.random.key(0), "blocks/0/mlp/down", 17)
        w_hat, vjp = jax.vjp(lambda w, bt: pqt.gaussws(w, bt, key), w, bt)
        r_other = pqt.rounded_normal(jax.random.fold_in(key, 1), shape)
        return w_hat, vjp(g)[1], pqt.rounded_normal(key, shape), r_other

    w_hat, g_bt, r_key, r_other = _run(run, w, bt, g)
    r_fwd = (f64(w_hat) - w) * 8
    np.testing.assert_array_equal(r_fwd, np.round(r_fwd))
    np.testing.assert_array_equal(r_fwd, f64(r_key))

    def expected(r):  # Eq. 4 with the given R
        return -math.log(2) / 8 * (f64(g) * r).reshape(2, 32, 3, 32).sum(axis=(1, 3))

    # Σ over a 32 x 32 tile of exact products g·R (<= 1023 f32 additions), times 2^-3 (exp2: <= 2 ulps) and −ln2:
    # within γ_n·(ln2/8)·Σ|g·R| of the f64 value, n = 1023 + 4 + 2
    tile_abs = np.abs(f64(g) * r_fwd).reshape(2, 32, 3, 32).sum(axis=(1, 3))
    assert_within(g_bt, expected(r_fwd), gamma(1029) * math.log(2) / 8 * tile_abs, "∂L/∂b_t")
    assert np.max(np.abs(expected(f64(r_other)) - expected(r_fwd))) > 0.5  # another R would show


def test_keys_layers_and_steps_independent_and_reproducible():
    n = 1 << 20

    def run():
        root = jax.random.key(0)
        draw = functools.partial(pqt.rounded_normal, shape=(n,))
        return (
            draw(pqt.pqt_key(root, "blocks/0/attn/out", 5)),
            draw(pqt.pqt_key(root, "blocks/0/mlp/down", 5)),
            draw(pqt.pqt_key(root, "blocks/0/attn/out", 6)),
            draw(pqt.layer_key(pqt.step_key(root, 5), ("blocks", 0, "attn", "out"))),
        )

    r_a5, r_b5, r_a6, again = (f64(r) for r in _run(run))
    np.testing.assert_array_equal(r_a5, again)  # a function of (seed, step, path) only
    p_equal = sum(p * p for p in pqt.ROUNDED_NORMAL_PMF.values())  # ≈ 0.553 for independent draws
    sd = math.sqrt(p_equal * (1 - p_equal) / n)
    for other in (r_b5, r_a6):
        assert abs(np.mean(r_a5 == other) - p_equal) < 5 * sd
        assert abs(np.corrcoef(r_a5, other)[0, 1]) < 5 / math.sqrt(n)
    with pytest.raises(ValueError, match="non-empty"):
        pqt.layer_key(jax.random.key(0), "")


def test_lemma1_no_underflow_for_bt_le_8_in_bf16():
    """Lemma 1 (m = 7, τ = 0): with b_t ≤ 8 no non-zero GaussWS noise vanishes in the bf16 addition."""
    shape = (256, 256)
    rng = np.random.default_rng(3)
    # weights spanning ~20 binades inside every tile (bf16-exact): the hard case for underflow
    w = rng.choice([-1.0, 1.0], shape) * rng.uniform(1.0, 2.0, shape) * np.exp2(rng.integers(-20, 1, shape))
    w = w.astype(ml_dtypes.bfloat16)
    grid = pqt.block_grid(shape)
    # b_t spread over [1, 8], every other tile row at exactly 8; then beyond the bound; then DiffQ (τ = −8)
    bt = np.where(np.arange(grid[0])[:, None] % 2 == 0, 8.0, np.linspace(1.0, 8.0, grid[0] * grid[1]).reshape(grid))
    key = jax.random.key(9)

    def run(w, bt):
        def count(bt, method):  # (# non-zero R whose noise vanished in ŵ, # non-zero R)
            w_hat = pqn_sample(w, bt, key, method=method)
            r = pqn_noise(key, shape, method)  # 256×256: no padding
            return jnp.sum((r != 0) & (w_hat == w)), jnp.sum(r != 0)

        return count(bt, "gaussws"), count(jnp.full(grid, 10.0), "gaussws"), count(jnp.full(grid, 4.0), "diffq")

    (lost, nonzero), (lost_hi, _), (lost_u, _) = _run(run, w, bt.astype(np.float32))
    assert int(nonzero) > 15_000 and int(lost) == 0
    assert int(lost_hi) > 100  # the bound is real: beyond m + 2 + τ = 9 noise vanishes
    assert int(lost_u) > 100  # DiffQ's small |R| underflows already at b_t = 4


def test_diffq_rounds_noise_then_sum_in_bf16():
    """DiffQ: ŵ = bf16(w + bf16(R · step)) bit for bit under jit (XLA excess precision must not merge roundings)."""
    shape = (64, 64)
    w = np.random.default_rng(1).standard_normal(shape).astype(ml_dtypes.bfloat16)
    key = jax.random.key(2)
    # b_t = 6: step = max|w| · 2^-5, exact
    w_hat, r = jax.jit(lambda w: (pqt.diffq(w, 6.0, key), pqt.symmetric_uniform(key, shape)))(w)
    w64, r64 = f64(w), f64(r)
    amax = np.abs(w64).reshape(2, 32, 2, 32).max(axis=(1, 3))
    step = np.repeat(np.repeat(amax * 2.0**-5, 32, 0), 32, 1)
    pqn = f64((r64 * step).astype(ml_dtypes.bfloat16))  # exact f64 product, one bf16 rounding
    expected = f64((w64 + pqn).astype(ml_dtypes.bfloat16))  # exact f64 sum, one bf16 rounding
    np.testing.assert_array_equal(f64(w_hat), expected)
    single = f64((w64 + r64 * step).astype(ml_dtypes.bfloat16))  # one rounding only
    assert np.sum(single != expected) > 0  # the case distinguishes the two roundings


def test_bad_inputs_raise():
    key = jax.random.key(0)
    w = np.ones((64, 40), np.float32)
    with pytest.raises(ValueError, match=r"bitwidth shape \(2, 1\).*\(2, 2\)"):
        pqt.gaussws(w, np.ones((2, 1)), key)
    with pytest.raises(ValueError, match="unknown PQT method"):
        pqn_sample(w, 4.0, key, method="nipq")
    with pytest.raises(ValueError, match="at least 2 axes"):
        pqt.gaussws(np.ones((64,), np.float32), 4.0, key)
    with pytest.raises(ValueError, match="float"):
        pqt.gaussws(np.ones((64, 64), np.int32), 4.0, key)
    with pytest.raises(ValueError, match="block"):
        pqt.gaussws(w, 4.0, key, block=0)
    with pytest.raises(ValueError, match="compute_dtype"):
        pqt.gaussws(w, 4.0, key, compute_dtype=jnp.float8_e4m3fn)
