"""emulated_dot: the FP8 accumulation tutorial's accumulator table at K = 4096 and its hand-worked swamping example."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpt.fp8 import emulated_dot
from lpt.numerics import round_nearest

_emu = jax.jit(emulated_dot, static_argnames=("accumulator_bits", "promote_every", "max_abs"))


def test_accumulator_table_k4096():
    """FP8 inputs, K = 4096, 8x8 outputs; mean |error| / mean |truth| against an f64 sum, as in the FP8 accumulation
    tutorial."""
    rng = np.random.default_rng(0)
    q = lambda v: np.asarray(round_nearest(v, jnp.float8_e4m3fn, out_dtype=jnp.float32))
    a = q((rng.standard_normal((8, 4096)) * 0.5).astype(np.float32))
    b = q((rng.standard_normal((4096, 8)) * 0.5).astype(np.float32))
    truth = a.astype(np.float64) @ b.astype(np.float64)
    rows = {
        "FP8 acc (3 bits, sat. 448)": dict(accumulator_bits=3, max_abs=448.0),
        "BF16 acc (7 bits)": dict(accumulator_bits=7),
        "14-bit register only": dict(accumulator_bits=14),
        "14-bit, promote every 128": dict(accumulator_bits=14, promote_every=128),
        "f32 sequential (23 bits)": dict(accumulator_bits=23),
    }
    err = {}
    for name, kw in rows.items():
        out = np.asarray(_emu(a, b, **kw), np.float64)
        err[name] = np.mean(np.abs(out - truth)) / np.mean(np.abs(truth))
    print("\naccumulator                      rel. error (K=4096)")
    for name, e in err.items():
        print(f"{name:32s} {e:.2e}")
    assert err["FP8 acc (3 bits, sat. 448)"] >= 1e-2
    assert 3e-5 <= err["14-bit register only"] <= 1e-3  # the FP8 accumulation tutorial reports ~2-3e-4
    assert err["14-bit register only"] >= 3 * err["14-bit, promote every 128"]
    assert err["f32 sequential (23 bits)"] < 1e-6


def test_seed_walkthrough_swamping_and_promotion():
    """a = b = (4, 4, 4, 4, 0.25): an FP8 register swallows the last 0.0625; promotion every 2 keeps it."""
    a = np.array([4, 4, 4, 4, 0.25], np.float32)
    fp8 = float(_emu(a, a, accumulator_bits=3, max_abs=448.0))
    promoted = float(_emu(a, a, accumulator_bits=3, max_abs=448.0, promote_every=2))
    assert fp8 == 64.0
    assert promoted == 64.0625
    # saturation: sixteen products of 32 saturate an e4m3 register at 448
    big = np.full(16, np.sqrt(32.0), np.float32)
    assert float(_emu(big, big, accumulator_bits=3, max_abs=448.0)) == 448.0


def test_bad_arguments_raise():
    a = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="accumulator_bits must be an int in"):
        emulated_dot(a, a.T, accumulator_bits=30)
    with pytest.raises(ValueError, match="promote_every must be a positive int"):
        emulated_dot(a, a.T, accumulator_bits=7, promote_every=0)
    with pytest.raises(ValueError, match="equal K"):
        emulated_dot(a, a, accumulator_bits=7)
