"""lpt.kernels.fp8_codes_math inside a Pallas kernel: what the fused AdamW kernel's 8-bit step runs.

The functions are integer and exactly scaled f32 operations, so a kernel (interpret mode on CPU, the mode the
kernel tests use) and XLA give the same bits: rounding into each 8-bit format (nearest and stochastic), the codes of
the rounded values, and the blocks' codes and scales. Their agreement with lpt.numerics and ml_dtypes is in
tests/kernels/test_adamw_kahan_8bit.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from lpt.kernels import fp8_codes_math as C
from lpt.numerics.random import hash_bits

FORMATS = [jnp.float8_e4m3fn, jnp.float8_e5m2]


def _data(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 128)) * 10.0 ** rng.uniform(-9, 5, (8, 128))
    x.reshape(-1)[:5] = [0.0, -0.0, np.inf, -np.inf, np.nan]
    return jnp.asarray(x, jnp.float32)


def _steps(x, words, fmt):
    nearest = C.fp8_code(C.round_fp8(x, fmt), fmt)
    stochastic = C.fp8_code(C.round_fp8(x, fmt, words), fmt)
    codes, scales = C.encode_blocks(x[1:], fmt, words[1:])
    return nearest, stochastic, codes, jnp.broadcast_to(scales, codes.shape), C.decode_blocks(codes, scales, fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
def test_the_code_math_in_an_interpreted_kernel_equals_xla(fmt):
    x, words = _data(0), hash_bits(jax.random.key(3), (8, 128))
    xla = jax.jit(lambda x, w: _steps(x, w, fmt))(x, words)

    def kernel(x_ref, w_ref, *out_refs):
        for ref, value in zip(out_refs, _steps(x_ref[...], w_ref[...], fmt), strict=True):
            ref[...] = value

    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in xla]
    interpreted = pl.pallas_call(kernel, out_shape=shapes, interpret=True)(x, words)
    for name, a, b in zip(("nearest", "stochastic", "codes", "scales", "decoded"), xla, interpreted, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), name  # bits (NaN payloads included)
    assert np.all(np.asarray(xla[0]) < 256) and len(np.unique(np.asarray(xla[0]))) > 100  # real codes, many of them
