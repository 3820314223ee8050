"""blockwise_dot: accuracy vs f32, FP8 backward GEMMs, massive activations, chunk order, memory shape, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED
from float_bounds import assert_within, gamma
from jax.extend.core import jaxprs_in_params

from lpt.fp8 import (
    blockwise_dot,
    dequantize_blocks,
    dequantize_tiles,
    quantize_blocks,
    quantize_tensor,
    quantize_tiles,
)
from lpt.fp8.blockwise import snr_db

E4M3 = jnp.float8_e4m3fn


def _jit(f, **kw):
    """``jax.jit`` with LLVM's optimizations off, for the default tier's programs: their checks are SNR floors,
    error bounds that hold for any order of the f32 sums, and quantized operands that are correctly rounded
    (the same bits under any compile)."""
    return jax.jit(f, compiler_options=UNOPTIMIZED, **kw)


def _normal(seed, shape, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


@functools.partial(_jit, static_argnames=("grad_dtype", "scale_format", "block"))
def _loss_grads(x, w, g, grad_dtype=jnp.float8_e5m2, scale_format="f32", block=128):
    kw = dict(grad_dtype=grad_dtype, scale_format=scale_format, block=block)
    y, vjp = jax.vjp(lambda x, w: blockwise_dot(x, w, **kw), x, w)
    return (y, *vjp(g.astype(y.dtype)))  # g -> y dtype


@functools.cache
def _case():
    # leading dims (2, 20) -> 40 tokens: not a multiple of 128, so dW's token padding is exercised
    x = _normal(0, (2, 20, 256))
    w = _normal(1, (256, 384), 1 / 16)
    g = _normal(2, (2, 20, 384))
    y32 = np.einsum("btk,kn->btn", x.astype(np.float64), w)
    dx32 = np.einsum("btn,kn->btk", g.astype(np.float64), w)
    dw32 = np.einsum("btk,btn->kn", x.astype(np.float64), g)
    return x, w, g, (y32, dx32, dw32)


@pytest.mark.parametrize(
    "grad_dtype,min_grad_db,scale_format",
    [(jnp.float8_e5m2, 20.0, "f32"), (jnp.float8_e4m3fn, 25.0, "pow2")],
)
def test_output_and_gradients_snr(grad_dtype, min_grad_db, scale_format):
    x, w, g, refs = _case()
    outs = _loss_grads(x, w, g, grad_dtype=grad_dtype, scale_format=scale_format)
    snrs = [float(snr_db(r, o)) for r, o in zip(refs, outs, strict=True)]
    print(f"grad={jnp.dtype(grad_dtype).name} scales={scale_format}: SNR y/dx/dw = {snrs}")
    assert snrs[0] >= 25.0
    assert min(snrs[1:]) >= min_grad_db
    # the backward GEMMs really are FP8 (an f32 backward would reach > 60 dB)
    assert max(snrs[1:]) < 40.0


def test_gradients_are_the_stated_fp8_gemms():
    """dx = Q_g(g) @ Q_w(w).T with the forward's weight blocks; dw = Q_tok(x).T @ Q_tok(g) (token tiles)."""
    x, w, g, _ = _case()
    _, dx, dw = _loss_grads(x, w, g)
    x2, g2 = x.reshape(40, 256), g.reshape(40, 384)

    @_jit
    def dequantized(w, g2, xp, gp):
        e5m2 = jnp.float8_e5m2
        return (
            dequantize_blocks(*quantize_blocks(w)),
            dequantize_tiles(*quantize_tiles(g2, e5m2)),
            dequantize_tiles(*quantize_tiles(xp, E4M3, axis=0), axis=0),
            dequantize_tiles(*quantize_tiles(gp, e5m2, axis=0), axis=0),
        )

    pad = ((0, 88), (0, 0))  # 40 tokens -> 128
    wq, gq, xt, gt = (np.asarray(a, np.float64) for a in dequantized(w, g2, np.pad(x2, pad), np.pad(g2, pad)))
    # each f32 result adds exact FP8 products (<= 127 additions per 128-chunk, <= 3 chunk partials, 2 scale
    # products) and the dequantized references round each factor once: within γ_n·Σ|terms|, n = 127 + 3 + 2 + 2
    n = 127 + 3 + 2 + 2
    assert_within(np.asarray(dx).reshape(40, 256), gq @ wq.T, gamma(n) * (np.abs(gq) @ np.abs(wq).T), "dx")
    assert_within(dw, xt.T @ gt, gamma(n) * (np.abs(xt).T @ np.abs(gt)), "dw")


def test_massive_activations_blockwise_beats_per_tensor():
    """Token magnitudes spanning six decades: a few massive tokens (1e4) over a bulk log-uniform in [1e-2, 1].

    One per-tensor scale is set by the massive tokens and pushes the bulk into e4m3's subnormals or to zero;
    1x128 tiles give every token its own scale. (Outlier *channels* would not separate them: FP8 is a float
    format, so a large max alone costs nothing as long as the range fits in its ~2^18 dynamic range.)
    """
    rng = np.random.default_rng(5)
    mag = 10.0 ** rng.uniform(-2, 0, size=(128, 1))
    mag[::32] = 1e4  # 4 massive tokens
    x = (rng.standard_normal((128, 256)) * mag).astype(np.float32)
    w = _normal(6, (256, 128), 1 / 16)
    ref = x.astype(np.float64) @ w
    y_block = np.asarray(_jit(blockwise_dot)(x, w), np.float64)
    # per-tensor baseline: one e4m3 scale for x (weights keep their 128x128 blocks), f32 accumulation
    qx, sx = _jit(quantize_tensor)(x)
    wq = _jit(lambda w: dequantize_blocks(*quantize_blocks(w)))(w)
    y_tensor = (np.asarray(qx, np.float64) * float(sx)) @ np.asarray(wq, np.float64)

    def per_token(y):
        return np.mean(np.linalg.norm(y - ref, axis=1) / np.linalg.norm(ref, axis=1))

    e_block, e_tensor = per_token(y_block), per_token(y_tensor)
    print(f"mean per-token rel. error: blockwise {e_block:.3g}, per-tensor {e_tensor:.3g}")
    assert e_block < 0.06
    assert e_tensor >= 3 * e_block


def test_xla_path_sums_chunks_in_order_without_a_chunk_tensor():
    x = _normal(7, (16, 512))
    w = _normal(8, (512, 256))
    k, n = w.shape
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(blockwise_dot(x, w)), argnums=(0, 1)))(x, w)
    shapes = set()

    def walk(jx):
        for eqn in jx.eqns:
            shapes.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    assert (k // 128, 16, n) not in shapes and (k // 128, 16, k) not in shapes
    assert (16, n) in shapes  # the f32 accumulator
    # the result equals the chunk-ordered promoted sum (f64 model of the same formula) to f32 round-off
    qx, sx = _jit(quantize_tiles)(x)
    qw, sw = _jit(quantize_blocks)(w)
    a, b = np.asarray(qx, np.float64), np.asarray(qw, np.float64)
    ref = sum(
        (a[:, c * 128 : (c + 1) * 128] @ b[c * 128 : (c + 1) * 128])
        * np.asarray(sx)[:, c : c + 1]
        * np.repeat(np.asarray(sw)[c], 128)
        for c in range(4)
    )
    mag = sum(
        (np.abs(a[:, c * 128 : (c + 1) * 128]) @ np.abs(b[c * 128 : (c + 1) * 128]))
        * np.asarray(sx)[:, c : c + 1]
        * np.repeat(np.asarray(sw)[c], 128)
        for c in range(4)
    )
    # f32 round-off of that sum: 127 additions in a chunk, 2 scale products, 4 chunk partials: γ_133·Σ|terms|
    assert_within(_jit(blockwise_dot)(x, w), ref, gamma(127 + 2 + 4) * mag, "y")


def test_bad_inputs_raise():
    x = np.ones((4, 256), np.float32)
    with pytest.raises(ValueError, match=r"K=256 and N=200 must be multiples of block=128"):
        blockwise_dot(x, np.ones((256, 200), np.float32))
    with pytest.raises(ValueError, match="disagree on K"):
        blockwise_dot(x, np.ones((128, 128), np.float32))
    with pytest.raises(ValueError, match="impl must be one of"):
        blockwise_dot(x, np.ones((256, 128), np.float32), impl="cuda")
    with pytest.raises(ValueError, match="grad_dtype must be float8_e4m3fn or float8_e5m2"):
        blockwise_dot(x, np.ones((256, 128), np.float32), grad_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="floating-point"):
        blockwise_dot(x.astype(np.int32), np.ones((256, 128), np.float32))


def test_smaller_block_bf16_activations_and_dtypes():
    x, w, g = _normal(9, (8, 64)), _normal(10, (64, 32), 0.1), _normal(11, (8, 32))
    y, dx, dw = _loss_grads(x.astype(jnp.bfloat16), w, g, block=32)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    x64 = np.asarray(x.astype(jnp.bfloat16), np.float64)  # the bf16 input is what the layer sees
    assert float(snr_db(x64 @ w, y)) >= 25.0
    assert float(snr_db(x64.T @ g, dw)) >= 20.0


def test_a_gemm_weight_made_once_multiplies_as_the_weight_does():
    """gemm_weight(w) for stacked layers [L, K, N], each layer's slice passed as blockwise_dot's weight: output, dx
    and dw equal blockwise_dot on the weight itself up to f32 round-off (the same codes feed the same GEMMs), and dw
    reaches the stacked weight; the codes and scales are quantize_blocks' bit for bit. A GemmWeight of other options
    is refused."""
    from lpt.fp8.blockwise import gemm_weight

    x, g = _normal(2, (2, 40, 256)), _normal(3, (2, 40, 384))
    w = jnp.asarray(_normal(4, (3, 256, 384), 1 / 16), jnp.bfloat16)

    def loss(x, w, prepared):
        gw = gemm_weight(w)
        layers = [jax.tree.map(lambda a, i=i: a[i], gw) if prepared else w[i] for i in range(3)]
        return sum(jnp.sum(blockwise_dot(x, layer) * g) for layer in layers)

    direct = jax.jit(jax.value_and_grad(lambda x, w: loss(x, w, False), argnums=(0, 1)))(x, w)
    made = jax.jit(jax.value_and_grad(lambda x, w: loss(x, w, True), argnums=(0, 1)))(x, w)
    # the same codes in the same GEMMs; the two programs may fuse (and contract FMAs) differently: f32 round-off
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(made), strict=True):
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)  # bf16 dw -> f32 (exact)
        assert a.dtype == b.dtype
        rtol = 2.0**-7 if a.dtype == jnp.bfloat16 else 1e-5  # bf16 dw: its f32 sum may round to the next bf16
        np.testing.assert_allclose(b32, a32, rtol=rtol, atol=1e-6 * float(np.max(np.abs(a32))))
    assert np.any(np.asarray(made[1][1], np.float32) != 0)  # dw reached the stacked weight
    gw = gemm_weight(w)
    q, s = quantize_blocks(w[1])
    assert np.array_equal(np.asarray(gw.codes[1], np.float32), np.asarray(q, np.float32))
    assert np.array_equal(np.asarray(gw.scales[1]), np.asarray(s))
    with pytest.raises(ValueError, match="make it with gemm_weight and the same options"):
        blockwise_dot(x, jax.tree.map(lambda a: a[0], gw), fwd_dtype=jnp.float8_e5m2)
