"""lpt.numerics rounding: bit-exact against ml_dtypes, identical under jit, unbiased stochastic rounding."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED

from lpt import numerics as N

STORABLE = ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"]
ALL_LOW = STORABLE + ["float6_e2m3fn", "float6_e3m2fn"]


def _wide_values(n=50_000, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))).astype(np.float32)
    x[:8] = [np.inf, -np.inf, np.nan, 0.0, -0.0, 448.0, 464.0, 480.0]
    return x


def _same(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return np.all((a == b) | (np.isnan(a) & np.isnan(b)))


@pytest.mark.parametrize("name", ALL_LOW)
def test_round_nearest_matches_ml_dtypes_eager_and_jit(name):
    fmt = N.get_format(name)
    x = _wide_values()
    with np.errstate(all="ignore"):
        ref = x.astype(fmt.dtype)  # ml_dtypes: RNE, IEEE overflow (saturating for fp6/fp4)
    if name.startswith("float6"):
        ref = np.where(np.isnan(x), np.nan, ref.astype(np.float32))  # lpt keeps NaN in its f32 emulation
    eager = N.round_nearest(x, fmt.dtype, saturate=False)
    jitted = jax.jit(lambda v: N.round_nearest(v, fmt.dtype, saturate=False))(x)
    assert eager.dtype == (fmt.dtype if fmt.xla_storable else jnp.float32)
    assert _same(eager, ref)
    assert _same(jitted, ref)


def test_round_nearest_survives_excess_precision_under_jit():
    # w + u written in bf16 may be kept in f32 by XLA; rounding through lpt.numerics must not be skipped.
    w = jnp.ones((1024,), jnp.bfloat16)
    u = jnp.full((1024,), 1e-3, jnp.float32)  # below half an ulp of 1.0 in bf16 (2^-8 = 3.9e-3)

    @jax.jit
    def applied(w, u):
        s = N.round_nearest(w.astype(jnp.float32) + u, jnp.bfloat16)  # bf16 -> f32, add, round to bf16
        return s.astype(jnp.float32) - w.astype(jnp.float32)  # bf16 -> f32 (exact)

    np.testing.assert_array_equal(np.asarray(applied(w, u)), 0.0)


def test_overflow_policies():
    x = jnp.array([1000.0, -1e6, 3.0e38 * 2], jnp.float32)
    e4 = N.round_nearest(x[:2], jnp.float8_e4m3fn)  # default: saturate (no inf in e4m3fn)
    assert np.asarray(e4, np.float32).tolist() == [448.0, -448.0]
    assert np.isnan(np.asarray(N.round_nearest(x[:1], jnp.float8_e4m3fn, saturate=False), np.float32)).all()
    big = jnp.array([3.4e38], jnp.float32)  # above bf16's max (3.39e38) by more than half an ulp
    assert np.isinf(np.asarray(N.round_nearest(big, jnp.bfloat16), np.float32)).all()  # IEEE default for bf16
    sat = N.round_nearest(big, jnp.bfloat16, saturate=True)
    assert float(np.asarray(sat, np.float32)[0]) == N.get_format("bfloat16").max
    assert float(np.asarray(N.round_nearest(jnp.array([1e5]), jnp.float16), np.float32)[0]) == np.inf
    assert float(np.asarray(N.round_nearest(jnp.array([1e5]), jnp.float16, saturate=True), np.float32)[0]) == 65504


def _neighbors(x, fmt):
    """Grid neighbours lo <= x <= hi in fmt, computed with ml_dtypes (independent of lpt)."""
    lo = np.asarray(x, np.float32).astype(fmt.dtype)
    lo_f = lo.astype(np.float32)
    top = np.array(fmt.max, np.float32).astype(fmt.dtype)  # nextafter towards max (e4m3fn has no inf)
    lo = np.where(lo_f > x, np.nextafter(lo, -top), lo).astype(np.float32)
    hi = np.nextafter(lo.astype(fmt.dtype), top).astype(np.float32)
    return lo, hi


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"])
def test_round_stochastic_unbiased_and_on_neighbors(name):
    fmt = N.get_format(name)
    rng = np.random.default_rng(1)
    # points inside the normal range and inside the subnormal range of the format, positive and negative
    base = np.array([1.0, 1.3, fmt.smallest_normal * 1.7, fmt.smallest_subnormal * 2.3, fmt.max / 3], np.float32)
    frac = rng.uniform(0.05, 0.95, base.shape).astype(np.float32)
    lo, hi = _neighbors(base, fmt)
    x = (lo + frac * (hi - lo)).astype(np.float32)
    x = np.concatenate([x, -x])
    lo, hi = _neighbors(np.abs(x), fmt)
    n = 20_000
    xs = jnp.asarray(np.repeat(x[None], n, axis=0))
    r = np.asarray(jax.jit(lambda v, k: N.round_stochastic(v, fmt.dtype, k))(xs, jax.random.key(0)), np.float32)
    mag = np.abs(r)
    assert np.all((mag == lo) | (mag == hi)), "stochastic rounding must land on the two grid neighbours"
    assert np.all(np.sign(r) == np.sign(x))
    # mean within 5 standard errors of x (Bernoulli: sd = gap * sqrt(p(1-p)/n))
    p = (np.abs(x) - lo) / (hi - lo)
    se = (hi - lo) * np.sqrt(p * (1 - p) / n)
    z = (r.astype(np.float64).mean(0) - x) / se
    assert np.max(np.abs(z)) < 5.0, z
    # nearest rounding is biased for these x: the test could detect it
    rn = np.asarray(N.round_nearest(x, fmt.dtype), np.float32)
    assert np.max(np.abs((rn - x) / se)) > 5.0


def test_round_stochastic_deterministic_and_jit_equals_eager():
    x = jnp.linspace(-3, 3, 4097, dtype=jnp.float32)
    k = jax.random.key(42)
    a = N.round_stochastic(x, jnp.bfloat16, k)
    b = jax.jit(lambda v: N.round_stochastic(v, jnp.bfloat16, k))(x)
    c = N.round_stochastic(x, jnp.bfloat16, jax.random.key(43))
    assert _same(a, b)
    assert not _same(a, c)


def test_round_stochastic_bf16_matches_bit_definition():
    # bf16 SR is exactly: add 16 random bits below the kept mantissa, truncate.
    x = np.random.default_rng(3).standard_normal(10_000).astype(np.float32)
    key = jax.random.key(7)
    bits = np.asarray(N.random_bits(key, x.shape))
    ref = ((x.view(np.uint32) + (bits >> 16)) & np.uint32(0xFFFF0000)).view(np.float32)
    got = np.asarray(N.round_stochastic(x, jnp.bfloat16, key), np.float32)
    np.testing.assert_array_equal(got, ref)


def test_round_to_bits():
    x = _wide_values(seed=5)
    x = x[np.isfinite(x) & (np.abs(x) > 1e-30) & (np.abs(x) < 1e30)]
    r7 = np.asarray(jax.jit(lambda v: N.round_to_bits(v, 7))(x))
    np.testing.assert_array_equal(r7, x.astype(ml_dtypes.bfloat16).astype(np.float32))
    r3 = np.asarray(N.round_to_bits(jnp.array([1.0 + 1 / 16, 1000.0, -1000.0]), 3, max_abs=448.0))
    assert r3.tolist() == [1.0, 448.0, -448.0]  # 1+1/16 is a tie -> even; saturation at 448
    np.testing.assert_array_equal(np.asarray(N.round_to_bits(x, 23)), x)
    with pytest.raises(ValueError, match="mantissa_bits"):
        N.round_to_bits(x, 24)
    with pytest.raises(ValueError, match="max_abs"):
        N.round_to_bits(x, 3, max_abs=0.0)


def test_formats_and_ulp():
    f = N.get_format(jnp.float8_e4m3fn)
    assert (f.bits, f.exponent_bits, f.mantissa_bits, f.max, f.smallest_subnormal) == (
        8,
        4,
        3,
        448.0,
        2.0**-9,
    )
    assert not f.has_inf and f.has_nan
    assert N.get_format("float4_e2m1fn").bits == 4 and N.get_format("float6_e3m2fn").max == 28.0
    assert float(N.ulp(1.0, jnp.bfloat16)) == 2.0**-7
    assert float(N.ulp(448.0, jnp.float8_e4m3fn)) == 32.0
    assert float(N.ulp(1e-3, jnp.float8_e4m3fn)) == 2.0**-9  # subnormal spacing
    xs = np.abs(_wide_values(seed=9))
    xs = xs[np.isfinite(xs) & (xs < 6e4)].astype(np.float16).astype(np.float32)  # on the f16 grid
    np.testing.assert_array_equal(
        np.asarray(N.ulp(xs, jnp.float16)), np.spacing(xs.astype(np.float16)).astype(np.float32)
    )
    with pytest.raises(ValueError, match="unsupported dtype 'int32'"):
        N.get_format(jnp.int32)
    with pytest.raises(ValueError, match="floating-point"):
        N.round_nearest(jnp.arange(3), jnp.bfloat16)


def test_hash_bits_statistics():
    def draws():
        b = N.hash_bits(jax.random.key(0), (1 << 20,))
        v = N.hash_bits(jax.random.fold_in(jax.random.key(0), 1), (1 << 20,))
        keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(1), s))(jnp.arange(4096))
        return b, v, jax.vmap(lambda k: N.hash_bits(k, (4,)))(keys)

    # one program of integer operations, compiled with LLVM's optimizations off: the bits are the same under any
    # compile, and the checks are statistical
    b, v, w = (np.asarray(x) for x in jax.jit(draws).lower().compile(UNOPTIMIZED)())
    frac = np.mean((b[:, None] >> np.arange(32, dtype=np.uint32)) & 1, axis=0)
    assert np.max(np.abs(frac - 0.5)) < 0.003  # 5 sigma for 2^20 fair bits is 0.0024
    u = b / 2.0**32
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.005  # neighbours look independent (sigma 0.001)
    v = v / 2.0**32
    assert abs(np.corrcoef(u, v)[0, 1]) < 0.005  # and so do different keys
    # one element over many steps (a fresh key per step, as the update rules fold in the step): uniform, independent
    w = w / 2.0**32  # [steps, element]
    assert np.max(np.abs(w.mean(0) - 0.5)) < 5 / np.sqrt(12 * 4096)  # 5 sigma
    assert max(abs(np.corrcoef(w[:-1, i], w[1:, i])[0, 1]) for i in range(4)) < 5 / np.sqrt(4096)
    np.testing.assert_array_equal(
        np.asarray(N.random_bits(jax.random.key(3), (5,), "threefry")),
        np.asarray(jax.random.bits(jax.random.key(3), (5,), jnp.uint32)),
    )
    with pytest.raises(ValueError, match="unknown rng"):
        N.random_bits(jax.random.key(0), (3,), "mt19937")
