"""``lpt.kernels.sqrt_math``: the root rounded to nearest from any start within two ulps, checked against numpy's
IEEE ``sqrt`` bit for bit (a product promise: the kernel and its twin agree on every backend by it). The starts are
the true root moved 0, ±1 and ±2 ulps, as an approximate hardware square root may leave it; without the correction
4 of 5 starts would be wrong. Normal inputs only: XLA:CPU flushes subnormal operands to zero, so on a CPU their root
is 0 in the twin and here alike."""

import jax
import jax.numpy as jnp
import numpy as np

from lpt.kernels.sqrt_math import correct_sqrt, sqrt_rn


def _inputs():
    rng = np.random.default_rng(0)
    logs = rng.uniform(-126, 127.9, 20000)
    x = np.exp2(logs).astype(np.float32)  # f64 -> f32 across the whole positive range, subnormals included
    pows = np.exp2(np.arange(-125, 128, dtype=np.float64)).astype(np.float32)  # every normal power of two
    squares = (np.arange(1, 5000, dtype=np.float32) ** 2).astype(np.float32)  # exact roots
    ups, downs = np.nextafter(pows, np.float32(np.inf)), np.nextafter(pows, np.float32(0))
    x = np.concatenate([x, pows, squares, ups, downs, np.float32([2.0**-126, 3.4e38])])
    return x[(x >= 2.0**-126) & np.isfinite(x)]


def test_any_start_within_two_ulps_ends_on_the_rounded_root():
    x = _inputs()
    true = np.sqrt(x)  # f32 IEEE root, rounded to nearest even
    fix = jax.jit(correct_sqrt)
    for d in (-2, -1, 0, 1, 2):
        start = (true.view(np.uint32).astype(np.int64) + d).astype(np.uint32).view(np.float32)
        got = np.asarray(fix(jnp.asarray(x), jnp.asarray(start)))
        bad = np.flatnonzero(got.view(np.uint32) != true.view(np.uint32))
        assert bad.size == 0, (d, x[bad[:5]], got[bad[:5]], true[bad[:5]])
        if d:
            assert np.all(start != true)  # the start was wrong: the correction did the work


def test_zero_inf_nan_and_the_plain_root():
    x = jnp.asarray([0.0, -0.0, np.inf, np.nan, 4.0, 2.0, -1.0], jnp.float32)
    got = np.asarray(jax.jit(sqrt_rn)(x))
    with np.errstate(invalid="ignore"):  # the root of -1: NaN
        want = np.sqrt(np.asarray(x))
    np.testing.assert_array_equal(got.view(np.uint32)[[0, 1, 2, 4, 5]], want.view(np.uint32)[[0, 1, 2, 4, 5]])
    assert np.isnan(got[3]) and np.isnan(got[6])
