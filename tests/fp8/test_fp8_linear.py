"""Fp8Linear and the dot_general hook: same numbers as blockwise_dot, FP8 gradients into f32 params, statelessness."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lpt.fp8 import Fp8Linear, blockwise_dot, fp8_gemm_diagnostics, make_fp8_dot_general, snr_db


def _x(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_layer_matches_blockwise_dot_and_trains_in_fp8():
    layer = Fp8Linear(128, 256, rngs=nnx.Rngs(0), use_bias=True, grad_dtype=jnp.float8_e4m3fn)
    layer.bias[...] = jnp.full((256,), 0.5)
    x = _x(0, (4, 8, 128))
    kernel = layer.kernel[...]

    @nnx.jit
    def loss_and_grads(layer, x):
        return nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(layer)

    @nnx.jit
    def apply(layer, x):
        return layer(x)

    y = apply(layer, x)
    expected = jax.jit(blockwise_dot)(x, kernel) + 0.5
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-6, atol=1e-6)
    assert float(snr_db(x @ np.asarray(kernel) + 0.5, y)) >= 25.0
    _, grads = loss_and_grads(layer, x)
    gk = grads.kernel[...]
    assert gk.dtype == jnp.float32 and gk.shape == (128, 256)
    y32 = x @ np.asarray(kernel, np.float64) + 0.5
    gk32 = np.einsum("btk,btn->kn", x.astype(np.float64), 2 * y32)
    snr = float(snr_db(gk32, gk))
    assert 20.0 <= snr < 40.0  # FP8 wgrad: close to f32 but visibly quantized
    np.testing.assert_allclose(np.asarray(grads.bias[...]), 2 * np.asarray(y).sum((0, 1)), rtol=1e-4)


def test_stateless_under_remat_and_scan():
    """No scale state: remat and a scan over microbatches give the same gradients as a plain loop."""
    layer = Fp8Linear(128, 128, rngs=nnx.Rngs(1))
    w = layer.kernel[...]
    xs = _x(1, (2, 16, 128))
    loss = lambda w, x: jnp.sum(blockwise_dot(x, w) ** 2)

    @jax.jit
    def both(w, xs):
        plain = sum(jax.grad(loss)(w, xs[i]) for i in range(2))

        def body(acc, x):
            return acc + jax.grad(jax.checkpoint(loss))(w, x), None

        scanned, _ = jax.lax.scan(body, jnp.zeros_like(w), xs)
        return plain, scanned

    plain, scanned = both(w, xs)
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(plain), rtol=1e-5, atol=1e-5)


def test_dot_general_hook_in_nnx_linear():
    hook = make_fp8_dot_general()
    lin = nnx.Linear(128, 128, use_bias=False, dot_general=hook, rngs=nnx.Rngs(2))
    x = _x(2, (8, 128))
    y = nnx.jit(lambda m, x: m(x))(lin, x)
    expected = jax.jit(blockwise_dot)(x, lin.kernel[...])
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="supports only"):
        hook(x, np.ones((8, 128), np.float32), (((0,), (0,)), ((), ())))


def test_constructor_and_diagnostics():
    with pytest.raises(ValueError, match=r"Fp8Linear\(100, 128\).*multiples of block=128"):
        Fp8Linear(100, 128, rngs=nnx.Rngs(0))
    assert Fp8Linear(64, 32, rngs=nnx.Rngs(0), block=32).kernel.shape == (64, 32)
    x = _x(4, (8, 128)) * 0.1
    x[0, 7] = 1e6  # one outlier: the other 127 values of its tile underflow
    d = jax.jit(fp8_gemm_diagnostics)(x, _x(5, (128, 128)))
    assert int(d["x_saturated"]) == 0 and int(d["x_underflowed"]) == 127 and int(d["w_underflowed"]) == 0
    assert 20.0 < float(d["snr_db_vs_bf16"]) < 40.0
