"""fp8_blockwise_matmul Pallas kernel: interpret=True vs its XLA twin, platform dispatch, cuda/tpu lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED
from float_bounds import assert_within, gamma
from lowering import lowering

from lpt.fp8 import blockwise_dot, dequantize_blocks, dequantize_tiles, quantize_blocks, quantize_tiles
from lpt.kernels.fp8_blockwise_matmul.kernel import fp8_blockwise_matmul, fp8_blockwise_matmul_reference


def _operands(m, k, n, da, db, seed=0):
    rng = np.random.default_rng(seed)
    a = jnp.asarray((rng.standard_normal((m, k)) * 8).astype(np.float32)).astype(da)  # f32 -> fp8
    b = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32)).astype(db)  # f32 -> fp8
    sa = jnp.asarray(rng.uniform(0.5, 2.0, (m, k // 128)).astype(np.float32))
    sb = jnp.asarray(rng.uniform(0.5, 2.0, (k // 128, n)).astype(np.float32))
    return a, sa, b, sb


@pytest.mark.parametrize(
    "m,k,n,da,db",
    [
        (40, 384, 256, jnp.float8_e4m3fn, jnp.float8_e4m3fn),  # M padded, 3 chunks (scales padded to 4)
        (128, 256, 128, jnp.float8_e5m2, jnp.float8_e4m3fn),  # mixed formats (backward GEMMs): bf16 upcast
    ],
)
@pytest.mark.parametrize("structure", ["grid", "loop"])
def test_interpret_matches_xla_reference(m, k, n, da, db, structure):
    """Both kernel structures (Mosaic's grid over K-chunks with a VMEM accumulator, Triton's in-kernel loop) add the
    chunks in the twin's order, in another XLA program: the order inside one chunk's dot and the FMA contraction of
    ``acc + partial·sa·sb`` may differ (XLA:CPU picks them per program and ISA)."""
    args = _operands(m, k, n, da, db)
    # LLVM's optimizations off: the check is an error bound on any order of the sums and any FMA contraction
    ref = jax.jit(fp8_blockwise_matmul_reference, compiler_options=UNOPTIMIZED)(*args)
    kernel = functools.partial(fp8_blockwise_matmul, interpret=True, structure=structure)
    out = jax.jit(kernel, compiler_options=UNOPTIMIZED)(*args)
    # each result sums K exact FP8 products in f32 (128 per chunk dot, K/128 chunk partials, two scale products per
    # partial): within γ_n·Σ|terms| of the exact sum, n = 128 + K/128 + 2, so the two within 2γ_n·Σ|terms|
    a, sa, b, sb = (np.asarray(x, np.float64) for x in args)  # fp8 / f32 -> f64, exact
    chunks = [slice(c, c + 128) for c in range(0, k, 128)]
    mag = sum(np.abs(a[:, ch]) @ np.abs(b[ch]) * sa[:, i, None] * sb[i] for i, ch in enumerate(chunks))
    assert_within(out, ref, 2 * gamma(128 + k // 128 + 2) * mag)
    # the per-chunk scales matter: dropping them would be far off
    assert float(np.max(np.abs(np.asarray(ref, np.float64) - a @ b))) > 1.0


def test_blockwise_dot_pallas_matches_xla_with_grads():
    """impl="pallas" (platform_dependent: interpreted on CPU) vs impl="xla", forward and both backward GEMMs."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((24, 256)).astype(np.float32)
    w = (rng.standard_normal((256, 128)) / 16).astype(np.float32)
    g = rng.standard_normal((24, 128)).astype(np.float32)

    # LLVM's optimizations off: the check is an error bound on any order of the sums and any FMA contraction
    @functools.partial(jax.jit, static_argnames="impl", compiler_options=UNOPTIMIZED)
    def run(x, w, impl):
        y, vjp = jax.vjp(lambda x, w: blockwise_dot(x, w, impl=impl), x, w)
        return (y, *vjp(g))

    # the two programs multiply the same FP8 codes and scales; each sum has at most 2 chunks of 128 exact products
    # and two scale products: |pallas - xla| <= 2γ_n·Σ|terms|, n = 128 + 2 + 2. Σ|terms| is the same GEMM on |x|,
    # |w|, |g| (the codes of |x| are the magnitudes of x's: nearest rounding and the amax scales are symmetric)
    f64 = functools.partial(np.asarray, dtype=np.float64)
    xq, wq = f64(dequantize_tiles(*quantize_tiles(np.abs(x)))), f64(dequantize_blocks(*quantize_blocks(np.abs(w))))
    gq = f64(dequantize_tiles(*quantize_tiles(np.abs(g), jnp.float8_e5m2)))
    pad = lambda a: np.pad(a, ((0, 128 - a.shape[0]), (0, 0)))  # dW pads the 24 tokens to one block
    xt = f64(dequantize_tiles(*quantize_tiles(pad(np.abs(x)), axis=0), axis=0))
    gt = f64(dequantize_tiles(*quantize_tiles(pad(np.abs(g)), jnp.float8_e5m2, axis=0), axis=0))
    for o_p, o_x, mag in zip(run(x, w, "pallas"), run(x, w, "xla"), (xq @ wq, gq @ wq.T, xt.T @ gt), strict=True):
        assert mag.shape == o_x.shape
        assert_within(o_p, o_x, 2 * gamma(128 + 2 + 2) * mag)


@pytest.mark.parametrize("platform,custom_call", [("cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu_custom_call")])
def test_lowers_for_gpu_and_tpu(platform, custom_call):
    a, sa, b, sb = _operands(128, 512, 256, jnp.float8_e4m3fn, jnp.float8_e4m3fn)
    with lowering(platform):
        text = jax.jit(fp8_blockwise_matmul).trace(a, sa, b, sb).lower(lowering_platforms=(platform,)).as_text()
    assert custom_call in text
    # the whole differentiable layer: forward, dX and dW are three kernel launches
    x = jnp.ones((64, 256), jnp.float32)
    w = jnp.ones((256, 128), jnp.float32)
    grad = jax.value_and_grad(lambda x, w: jnp.sum(blockwise_dot(x, w, impl="pallas")), argnums=(0, 1))
    with lowering(platform):
        text = jax.jit(grad).trace(x, w).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(custom_call) == 3


def test_bad_arguments_raise():
    a, sa, b, sb = _operands(16, 256, 128, jnp.float8_e4m3fn, jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        fp8_blockwise_matmul(a, sa, b, sb, block_n=96)
    with pytest.raises(ValueError, match="scales must have shapes"):
        fp8_blockwise_matmul(a, sa[:, :1], b, sb)
    with pytest.raises(ValueError, match="interpret must be None"):
        fp8_blockwise_matmul(a, sa, b, sb, interpret=False)
