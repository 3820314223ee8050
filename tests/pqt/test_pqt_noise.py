"""rounded_normal matches Ahn & Yoo (GaussWS), Eq. 10; DiffQ's symmetric_uniform is an exact zero-mean bf16 uniform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import lpt.pqt as pqt
from lpt.pqt.noise import rounded_normal_from_bits

VALUES = (-2, -1, 0, 1, 2)


def eq10_pmf():
    """Eq. 10 written out from the paper's formulas (not from our constants)."""
    p2 = 3 / 4 * 2.0**-9  # each sign
    p1 = (3 / 4) ** 2 * 2.0**-2 * (1 - 2 * p2)  # each sign; (1 − Pr(|R| = 2))
    return {-2: p2, -1: p1, 0: 1 - 2 * p1 - 2 * p2, 1: p1, 2: p2}


def test_eq10_exact_over_all_16bit_words():
    words = jnp.arange(65536, dtype=jnp.uint32).astype(jnp.uint16)  # uint32 -> uint16, exact (< 2^16)
    r = jax.jit(rounded_normal_from_bits)(words)
    assert r.dtype == jnp.bfloat16
    r32 = np.asarray(r.astype(jnp.float32))  # bf16 -> f32 exact
    counts = {v: int(np.sum(r32 == v)) for v in VALUES}
    assert sum(counts.values()) == 65536  # no value outside {0, ±1, ±2}
    pmf = eq10_pmf()
    for v in VALUES:
        assert counts[v] == pmf[v] * 65536, (v, counts[v], pmf[v] * 65536)
    assert round(pmf[0], 3) == 0.717 and abs(1 / pmf[2] - 682.7) < 0.05 and abs(1 / pmf[1] - 7.1) < 0.05
    assert not np.any(np.signbit(r32[r32 == 0]))  # never −0


def test_eq10_statistically_over_16M_samples():
    n = 1 << 24  # 1.68e7 samples through jax.random.bits
    r = jax.jit(pqt.rounded_normal, static_argnums=1)(jax.random.key(2024), (n,))
    counts_fn = jax.jit(lambda r: jnp.stack([jnp.sum(r == jnp.bfloat16(v), dtype=jnp.int32) for v in VALUES]))
    counts = np.asarray(counts_fn(r), dtype=np.float64)
    assert counts.sum() == n
    pmf = np.array([eq10_pmf()[v] for v in VALUES])
    expected = n * pmf
    # per-value binomial bounds (5 sigma) ...
    sigma = np.sqrt(n * pmf * (1 - pmf))
    assert np.all(np.abs(counts - expected) < 5 * sigma), (counts, expected)
    # ... and a chi-square goodness-of-fit test (4 dof)
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert stats.chi2.sf(chi2, df=4) > 1e-4, chi2
    # the test has power: the true round(N(0,1)/2) distribution is rejected
    normal_pmf = np.diff(stats.norm.cdf([-np.inf, -3, -1, 1, 3, np.inf]))
    chi2_normal = float(np.sum((counts - n * normal_pmf) ** 2 / (n * normal_pmf)))
    assert stats.chi2.sf(chi2_normal, df=4) < 1e-12
    # neighbouring samples (which share a 32-bit PRNG word) are uncorrelated
    r64 = np.asarray(r[: 1 << 22].astype(jnp.float32), dtype=np.float64)  # bf16 -> f32 -> f64 exact
    corr = np.corrcoef(r64[0::2], r64[1::2])[0, 1]
    assert abs(corr) < 5 / np.sqrt(r64.size / 2)


def test_symmetric_uniform_is_exact_unbiased_bf16_grid():
    n = 1 << 21
    r = jax.jit(pqt.symmetric_uniform, static_argnums=1)(jax.random.key(7), (n,))
    assert r.dtype == jnp.bfloat16
    r64 = np.asarray(r.astype(jnp.float32), dtype=np.float64)  # bf16 -> f32 -> f64 exact
    k = (np.abs(r64) * 512 - 1) / 2  # ±(2k+1)/512
    np.testing.assert_array_equal(k, np.round(k))
    assert k.min() == 0 and k.max() == 127 and np.abs(r64).max() < 0.5
    values, counts = np.unique(r64, return_counts=True)
    assert values.size == 256
    p = 1 / 256
    assert np.all(np.abs(counts - n * p) < 5 * np.sqrt(n * p * (1 - p)))
    std_mean = np.sqrt(1 / 12 / n)
    assert abs(r64.mean()) < 5 * std_mean
    # jax.random.uniform in bf16 is biased by ≈ −1/256 (≈ 20 standard errors here): ours is not
    assert abs(r64.mean() - (-1 / 256)) > 10 * std_mean


def test_shape_validation():
    with pytest.raises(ValueError, match="shape"):
        pqt.rounded_normal(jax.random.key(0), (3, -1))
    with pytest.raises(ValueError, match="uint16"):
        rounded_normal_from_bits(jnp.zeros((3,), jnp.uint32))
