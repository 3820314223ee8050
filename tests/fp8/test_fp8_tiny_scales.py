"""Tiles whose amax / F would be an f32 subnormal: finite, exact codes; blockwise_dot stays finite.

XLA flushes f32 subnormals to zero, so ``amax / F`` for ``amax < F * 2^-126`` (5.3e-36 for e4m3, 6.7e-34 for e5m2)
would give scale 0 and NaN codes. The scale is floored at 2^-126, which makes ``t / scale = t * 2^126`` exact.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED
from float_bounds import assert_within, gamma

from lpt.fp8 import blockwise_dot, dequantize_blocks, dequantize_tiles, quantize_blocks, quantize_tiles
from lpt.fp8.recipe import block_scale
from lpt.numerics import exponent_of, pow2, round_nearest

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
TINY = np.float32(2.0**-126)  # smallest normal f32
FMAX = {E4M3: 448.0, E5M2: 57344.0}
HALF_ULP = {E4M3: 2.0**-4, E5M2: 2.0**-3}  # relative, normal range


def _jit(f, **kw):
    """``jax.jit`` with LLVM's optimizations off. The scales, quantizers and dequantizers are max, quotients, one
    product and bit operations, each correctly rounded where it is written (the same bits under any compile); the
    GEMMs are checked against error bounds far above f32 round-off."""
    return jax.jit(f, compiler_options=UNOPTIMIZED, **kw)


def _threshold(dtype) -> np.float32:
    return np.float32(FMAX[dtype] * 2.0**-126)  # exact in f32: F * 2^-126


def _tile(amax, seed=0, n=128) -> np.ndarray:
    """One row of ``n`` f32 values with max |.| exactly ``amax`` and all of them normal f32."""
    v = np.random.default_rng(seed).uniform(0.05, 1.0, n) * np.random.default_rng(seed + 1).choice([-1, 1], n)
    x = (np.sign(v) * np.maximum(np.abs(v) * np.float64(amax), 2.0**-126)).astype(np.float32)  # f64 -> f32
    x[7] = np.float32(amax)
    assert np.all(np.abs(x) >= TINY)
    return x


def _old_scale(amax_f32, dtype, scale_format):
    """The scale without the floor (bitwise reference for tiles above the threshold)."""
    ratio = amax_f32 / jnp.float32(FMAX[dtype])
    if scale_format == "pow2":
        e = exponent_of(ratio)
        e = e + (ratio > pow2(e)).astype(jnp.int32)  # bool -> int32
        ratio = pow2(e)
    return jnp.where(amax_f32 == 0, jnp.float32(1.0), ratio)


def _below(v):
    return np.nextafter(np.float32(v), np.float32(0))


def _above(v):
    return np.nextafter(np.float32(v), np.float32(1))


@pytest.mark.parametrize("scale_format", ["f32", "pow2"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_tiny_tiles_get_scale_2pow_minus126_and_exact_codes(dtype, scale_format):
    thr = _threshold(dtype)
    amaxes = [1e-37, 2.0**-120, _below(thr), thr / 3, _below(448 * 2.0**-126), 2.0**-126]
    x = np.stack([_tile(a, seed=i) for i, a in enumerate(amaxes)])
    q, s = _jit(functools.partial(quantize_tiles, dtype=dtype, scale_format=scale_format))(x)
    np.testing.assert_array_equal(np.asarray(s), np.full((len(amaxes), 1), TINY))
    qf = np.asarray(q, np.float32)
    assert np.all(np.isfinite(qf))
    # the codes are x * 2^126 rounded once to nearest-even (numpy + ml_dtypes: no flushing anywhere)
    ref = (x * np.float32(2.0**126)).astype(np.dtype(dtype))  # f32 -> fp8, RNE
    np.testing.assert_array_equal(qf, ref.astype(np.float32))
    assert np.all(np.abs(qf) >= 1.0)  # every code is a normal FP8 value: the format's full relative precision
    xd = np.asarray(_jit(dequantize_tiles)(q, s))
    rel = np.abs(xd - x) / np.abs(x)
    assert rel.max() <= HALF_ULP[dtype]


@pytest.mark.parametrize("scale_format", ["f32", "pow2"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_tiny_weight_block_next_to_normal_ones(dtype, scale_format):
    w = np.random.default_rng(3).standard_normal((256, 256)).astype(np.float32)
    w[:128, 128:] = _tile(1e-37, seed=4, n=128 * 128).reshape(128, 128)
    q, s = _jit(functools.partial(quantize_blocks, dtype=dtype, scale_format=scale_format))(w)
    assert float(s[0, 1]) == TINY and float(s[0, 0]) > 1e-6
    wd = np.asarray(_jit(dequantize_blocks)(q, s))
    assert np.all(np.isfinite(wd))
    rel = np.abs(wd[:128, 128:] - w[:128, 128:]) / np.abs(w[:128, 128:])
    assert rel.max() <= HALF_ULP[dtype]


@pytest.mark.parametrize("scale_format", ["f32", "pow2"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_f32_subnormal_elements_are_finite_and_lose_at_most_themselves(dtype, scale_format):
    sub = np.float32(2.0**-126) * np.linspace(0.01, 0.99, 128).astype(np.float32)  # f32 subnormals
    x = np.stack([sub, _tile(3e-38, seed=5)])
    x[1, :64] = sub[:64]  # a tiny-normal tile with subnormal elements in it
    q, s = _jit(functools.partial(quantize_tiles, dtype=dtype, scale_format=scale_format))(x)
    assert np.all(np.isfinite(np.asarray(q, np.float32))) and np.all(np.isfinite(np.asarray(s)))
    xd = np.asarray(_jit(dequantize_tiles)(q, s))
    assert np.all(np.abs(xd[:, :64] - x[:, :64]) <= TINY)  # dequantized to 0 or a nearby value
    rel = np.abs(xd[1, 64:] - x[1, 64:]) / np.abs(x[1, 64:])
    assert rel.max() <= HALF_ULP[dtype]


@pytest.mark.parametrize("scale_format", ["f32", "pow2"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_tiles_at_and_above_the_threshold_are_bitwise_unchanged(dtype, scale_format):
    thr = _threshold(dtype)
    amaxes = [thr, _above(thr), _above(_above(thr)), thr * 1.5, 1e-30, 1e-3, 1.0, 3e4]
    x = np.stack([_tile(a, seed=10 + i) for i, a in enumerate(amaxes)])
    q, s = _jit(functools.partial(quantize_tiles, dtype=dtype, scale_format=scale_format))(x)

    @_jit
    def old(x):
        s_old = _old_scale(jnp.max(jnp.abs(x), axis=-1, keepdims=True), dtype, scale_format)
        return round_nearest(x / s_old, dtype, saturate=True), s_old  # f32 -> fp8, RNE, saturating

    q_old, s_old = old(x)
    np.testing.assert_array_equal(np.asarray(s).view(np.uint32), np.asarray(s_old).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(q_old).view(np.uint8))
    assert np.all(np.asarray(s_old) >= TINY)


def test_pow2_scales_match_the_unfloored_formula_everywhere():
    """pow2 scales already rounded subnormal ratios up to 2^-126: the floor changes no pow2 scale."""
    amax = np.float32([0.0, 1e-45, 1e-40, 1e-37, 2.0**-126, 1e-35, 1e-30, 1.0, 1e30])
    for dtype in (E4M3, E5M2):
        new = np.asarray(_jit(lambda a, d=dtype: block_scale(a, d, "pow2"))(amax))
        old = np.asarray(_jit(lambda a, d=dtype: _old_scale(a, d, "pow2"))(amax))
        np.testing.assert_array_equal(new.view(np.uint32), old.view(np.uint32))


@functools.partial(_jit, static_argnames=("grad_dtype", "scale_format", "impl"))
def _y_dx_dw(x, w, g, grad_dtype, scale_format, impl="xla"):
    kw = dict(grad_dtype=grad_dtype, scale_format=scale_format, impl=impl)
    y, vjp = jax.vjp(lambda x, w: blockwise_dot(x, w, **kw), x, w)
    return (y, *vjp(g))


def _tiny_case():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    w = (rng.standard_normal((256, 128)) / 16).astype(np.float32)
    g = rng.standard_normal((16, 128)).astype(np.float32)
    # amax 4e-36 is below F * 2^-126 for e4m3 and e5m2; every element stays a normal f32 (>= 2e-37)
    x[3] = _tile(4e-36, seed=8, n=256)  # a tiny token: y[3], and dw's token tiles see a tiny row
    g[6] = _tile(4e-36, seed=9, n=128)  # a tiny gradient row: dx[6]
    g[:, 5] = _tile(4e-36, seed=10, n=16)  # a tiny gradient column: dw[:, 5]
    return x, w, g


@functools.partial(_jit, static_argnames=("fwd", "grad", "sf"))
def _dequantized_operands(x, w, g, fwd, grad, sf):
    """The quantized-then-dequantized f32 operands of each GEMM of blockwise_dot (one program, not one per op)."""
    pad = lambda a: jnp.pad(a, ((0, 128 - a.shape[0]), (0, 0)))  # noqa: E731 - dW pads tokens to the block
    xq = dequantize_tiles(*quantize_tiles(x, fwd, scale_format=sf))
    wq = dequantize_blocks(*quantize_blocks(w, fwd, scale_format=sf))
    gq = dequantize_tiles(*quantize_tiles(g, grad, scale_format=sf))
    xt = dequantize_tiles(*quantize_tiles(pad(x), fwd, axis=0, scale_format=sf), axis=0)
    gt = dequantize_tiles(*quantize_tiles(pad(g), grad, axis=0, scale_format=sf), axis=0)
    return xq, wq, gq, xt, gt


def _dequant_refs(x, w, g, fwd, grad, sf):
    """dequantize-then-matmul in f64 with the same quantized operands as each GEMM of blockwise_dot."""
    xq, wq, gq, xt, gt = (np.asarray(a, np.float64) for a in _dequantized_operands(x, w, g, fwd, grad, sf))
    return xq @ wq, gq @ wq.T, xt.T @ gt


def _assert_rows_match(out, ref, rows, what, rtol=1e-5):
    out = np.asarray(out, np.float64)
    assert np.all(np.isfinite(out)), what
    for r in rows:
        scale = np.abs(ref[r]).max()
        assert scale > 0
        # + 2^-126: XLA flushes f32 results (and partial sums) below the smallest normal to zero, numpy does not
        np.testing.assert_allclose(out[r], ref[r], rtol=0, atol=rtol * scale + 2.0**-126, err_msg=f"{what} row {r}")


@pytest.mark.parametrize(
    "grad_dtype,scale_format", [(E5M2, "f32"), (E4M3, "f32"), (E5M2, "pow2")], ids=["e5m2-f32", "e4m3-f32", "pow2"]
)
def test_blockwise_dot_on_tiny_tokens_and_gradients_is_finite_and_exact(grad_dtype, scale_format):
    x, w, g = _tiny_case()
    y, dx, dw = _y_dx_dw(x, w, g, grad_dtype, scale_format)
    ry, rdx, rdw = _dequant_refs(x, w, g, E4M3, grad_dtype, scale_format)
    _assert_rows_match(y, ry, range(16), "y")
    _assert_rows_match(dx, rdx, range(16), "dx")
    _assert_rows_match(dw.T, rdw.T, range(128), "dw columns")
    # the tiny rows are as accurate as the normal ones against the exact f64 product
    exact = x.astype(np.float64) @ w
    err = np.linalg.norm(np.asarray(y, np.float64) - exact, axis=1) / np.linalg.norm(exact, axis=1)
    assert err[3] < 2 * np.median(err)


def test_pallas_interpret_on_tiny_tokens_matches_xla():
    """The kernel (interpreted on CPU) and the XLA path multiply the same FP8 codes and scales with f32 accumulation,
    in two programs whose f32 sums may run in different orders (XLA:CPU picks FMA contraction and vector width per
    ISA). Each result adds at most 256 products (exact in f32) and rounds a few times more for the block scales and
    the promotion, so it is within γ_{256+4}·Σ|products| of the exact value (tests/float_bounds.py) and
    the two within twice that. Σ|products| is the same GEMM on |x|, |w|, |g|,
    whose codes are the magnitudes of the codes of x, w, g (nearest rounding and the amax scale are symmetric)."""
    x, w, g = _tiny_case()
    xla = _y_dx_dw(x, w, g, E5M2, "f32")
    pal = _y_dx_dw(x, w, g, E5M2, "f32", impl="pallas")  # interpreted on CPU
    abs_products = _dequant_refs(np.abs(x), np.abs(w), np.abs(g), E4M3, E5M2, "f32")  # Σ|products|: y, dx, dw
    for a, b, mag, what in zip(xla, pal, abs_products, ("y", "dx", "dw"), strict=True):
        assert np.all(np.isfinite(np.asarray(b)))
        assert mag.shape == np.shape(a)
        # + 2^-126: XLA flushes f32 results below the smallest normal to zero
        assert_within(b, a, 2 * gamma(256 + 4) * mag + 2.0**-126, what)
