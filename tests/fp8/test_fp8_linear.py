"""Fp8Linear and the dot_general hook: same numbers as blockwise_dot, FP8 gradients into f32 params, statelessness."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from float_bounds import assert_within, gamma

from lpt.fp8 import (
    Fp8Linear,
    blockwise_dot,
    dequantize_blocks,
    dequantize_tiles,
    fp8_gemm_diagnostics,
    make_fp8_dot_general,
    quantize_blocks,
    quantize_tiles,
)
from lpt.fp8.blockwise import snr_db


def _x(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _abs_terms(x, w):
    """Σ_k |x_k w_kn| of blockwise_dot's FP8 operands (dequantized, f64): the same GEMM on |x| and |w|, whose codes
    are the magnitudes of x's and w's (nearest rounding and the amax scales are symmetric)."""
    x = np.abs(np.asarray(x, np.float32))
    xq = np.asarray(dequantize_tiles(*quantize_tiles(x.reshape(-1, x.shape[-1]))), np.float64)
    wq = np.asarray(dequantize_blocks(*quantize_blocks(np.abs(np.asarray(w, np.float32)))), np.float64)
    return (xq @ wq).reshape(x.shape[:-1] + (wq.shape[1],))


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
    # two programs: 128 exact FP8 products summed in f32 in any order, 2 scale products and the bias add, each
    # within γ_131·(Σ|terms| + 0.5) of the exact value
    y_bound = 2 * gamma(131) * (_abs_terms(x, kernel) + 0.5)
    assert_within(y, expected, y_bound, "y")
    assert float(snr_db(x @ np.asarray(kernel) + 0.5, y)) >= 25.0
    _, grads = loss_and_grads(layer, x)
    gk = grads.kernel[...]
    assert gk.dtype == jnp.float32 and gk.shape == (128, 256)
    y32 = x @ np.asarray(kernel, np.float64) + 0.5
    gk32 = np.einsum("btk,btn->kn", x.astype(np.float64), 2 * y32)
    snr = float(snr_db(gk32, gk))
    assert 20.0 <= snr < 40.0  # FP8 wgrad: close to f32 but visibly quantized
    # Σ over the 32 tokens of 2y, from the gradient program's own y (within y_bound of this y): 31 f32 additions
    b_bound = 2 * y_bound.sum((0, 1)) + 2 * gamma(31) * np.abs(2 * np.asarray(y, np.float64)).sum((0, 1))
    assert_within(grads.bias[...], 2 * np.asarray(y, np.float64).sum((0, 1)), b_bound, "bias gradient")


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
    # dW of each microbatch is the FP8 GEMM Q(x)ᵀ Q(2y) over 128 (padded) tokens, 2 scale products, then 2
    # microbatches added: the two programs within 2γ_131·Σ|terms|, Σ|terms| from |x| and |2y|. (This takes the FP8
    # codes of 2y to be the same in both: an f32 difference in y flips an e5m2 rounding with probability ~2^-21 per
    # element and f32 ulp.)
    pad = lambda a: np.pad(np.abs(a), ((0, 128 - a.shape[0]), (0, 0)))
    mag = 0.0
    for x in xs:
        y2 = 2 * np.asarray(jax.jit(blockwise_dot)(x, w))
        xt = np.asarray(dequantize_tiles(*quantize_tiles(pad(x), axis=0), axis=0), np.float64)
        gt = np.asarray(dequantize_tiles(*quantize_tiles(pad(y2), jnp.float8_e5m2, axis=0), axis=0), np.float64)
        mag = mag + xt.T @ gt
    assert_within(scanned, plain, 2 * gamma(131) * mag, "dW")


def test_dot_general_hook_in_nnx_linear():
    hook = make_fp8_dot_general()
    lin = nnx.Linear(128, 128, use_bias=False, dot_general=hook, rngs=nnx.Rngs(2))
    x = _x(2, (8, 128))
    y = nnx.jit(lambda m, x: m(x))(lin, x)
    expected = jax.jit(blockwise_dot)(x, lin.kernel[...])
    # two programs: 128 exact FP8 products summed in any order and 2 scale products: 2γ_130·Σ|terms|
    assert_within(y, expected, 2 * gamma(130) * _abs_terms(x, lin.kernel[...]), "y")
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
