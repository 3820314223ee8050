"""Block quantization: scales, rounding error, per-block independence, error messages, statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpt.fp8 import (
    dequantize_blocks,
    dequantize_tiles,
    quantize_blocks,
    quantize_tensor,
    quantize_tiles,
)
from lpt.fp8.blockwise import quantization_stats

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


def _normal(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("dtype,fmax,half_ulp", [(E4M3, 448.0, 2.0**-4), (E5M2, 57344.0, 2.0**-3)])
def test_tiles_scale_and_roundtrip(dtype, fmax, half_ulp):
    x = _normal(0, (8, 256)) * np.logspace(-3, 3, 8, dtype=np.float32)[:, None]  # rows differ by 6 decades
    q, s = jax.jit(lambda v: quantize_tiles(v, dtype))(x)
    assert q.dtype == dtype and s.shape == (8, 2)
    amax = np.abs(np.asarray(x)).reshape(8, 2, 128).max(-1)
    np.testing.assert_allclose(np.asarray(s), amax / fmax, rtol=1e-6)
    # each tile's largest element lands on the format max (saturation-free)
    qmax = np.abs(np.asarray(q, np.float32)).reshape(8, 2, 128).max(-1)
    np.testing.assert_allclose(qmax, fmax, rtol=half_ulp)
    xd = np.asarray(jax.jit(dequantize_tiles)(q, s))
    big = np.abs(np.asarray(x)) >= np.repeat(np.asarray(s), 128, axis=1) * 2.0**-6 * 2  # normal range (e4m3)
    rel = np.abs(xd - np.asarray(x))[big] / np.abs(np.asarray(x))[big]
    assert rel.max() <= half_ulp * (1 + 1e-6)


def test_tiles_along_token_axis():
    x = _normal(1, (256, 64))
    q, s = jax.jit(lambda v: quantize_tiles(v, E4M3, axis=0))(x)
    assert s.shape == (2, 64)
    xd = jax.jit(lambda a, b: dequantize_tiles(a, b, axis=0))(q, s)
    np.testing.assert_allclose(np.asarray(xd), x, rtol=2.0**-4, atol=1e-3)


def test_pow2_scales_are_powers_of_two_and_fit():
    x = _normal(2, (4, 512)) * 3.7
    q, s = jax.jit(lambda v: quantize_tiles(v, E4M3, scale_format="pow2"))(x)
    s = np.asarray(s)
    assert np.all(np.log2(s) == np.round(np.log2(s)))
    amax = np.abs(np.asarray(x)).reshape(4, 4, 128).max(-1)
    ratio = amax / s
    assert np.all(ratio <= 448.0) and np.all(ratio > 224.0)  # the smallest power of two that fits


def test_weight_blocks_are_independent():
    w = _normal(3, (256, 256))
    w[:128, 128:] *= 1e-5  # one block six decades smaller
    q, s = jax.jit(quantize_blocks)(jnp.asarray(w))
    assert s.shape == (2, 2)
    wd = np.asarray(jax.jit(dequantize_blocks)(q, s))
    rel_small = np.linalg.norm(wd[:128, 128:] - w[:128, 128:]) / np.linalg.norm(w[:128, 128:])
    assert rel_small < 0.05
    # with one scale for the tensor the small block is mostly flushed to zero
    qt, st = jax.jit(quantize_tensor)(jnp.asarray(w))
    wt = np.asarray(qt, np.float32) * float(st)
    assert np.linalg.norm(wt[:128, 128:] - w[:128, 128:]) / np.linalg.norm(w[:128, 128:]) > 0.5


def test_zero_tile_gets_unit_scale_and_non_finite_tiles_surface():
    x = np.zeros((4, 128), np.float32)
    x[1, 3] = 5.0
    x[2, 0], x[3, 0] = np.nan, np.inf
    q, s = jax.jit(quantize_tiles)(x)
    assert float(s[0, 0]) == 1.0 and float(s[1, 0]) == pytest.approx(5.0 / 448)
    assert not np.any(np.asarray(q[0], np.float32))
    assert np.isnan(float(s[2, 0])) and np.isinf(float(s[3, 0]))
    assert np.all(np.isnan(np.asarray(q[2], np.float32)))  # the whole tile, not just the NaN element


def test_bad_shapes_and_options_raise():
    with pytest.raises(ValueError, match=r"x.shape\[1\]=200 .* multiple of the tile size 128"):
        quantize_tiles(np.ones((4, 200), np.float32))
    with pytest.raises(ValueError, match=r"multiples of the block size 128"):
        quantize_blocks(np.ones((128, 96), np.float32))
    with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2"):
        quantize_tiles(np.ones((4, 128), np.float32), jnp.bfloat16)
    with pytest.raises(ValueError, match="scale_format"):
        quantize_tiles(np.ones((4, 128), np.float32), scale_format="log")
    with pytest.raises(ValueError, match="floating-point"):
        quantize_tiles(np.ones((4, 128), np.int32))


def test_stats_count_underflow_inside_outlier_tiles():
    x = np.ones((3, 256), np.float32)
    x[0, 5] = 1e6  # one outlier: its tile's 127 other values flush to zero
    q, s = jax.jit(quantize_tiles)(x)
    st = jax.jit(quantization_stats)(x, q, s)
    assert int(st.saturated) == 0
    assert int(st.underflowed) == 127
    assert int(st.total) == 3 * 256
