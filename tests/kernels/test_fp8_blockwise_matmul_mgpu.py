"""fp8_blockwise_matmul_mgpu (Hopper, Mosaic GPU): interpret=True vs the XLA twin, lowering for cuda."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_bounds import assert_within, gamma

from lpt.fp8 import blockwise_dot
from lpt.kernels import compat
from lpt.kernels.fp8_blockwise_matmul.kernel import fp8_blockwise_matmul_reference
from lpt.kernels.fp8_blockwise_matmul.mosaic_gpu import fp8_blockwise_matmul_mgpu

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _operands(m, k, n, dtype=jnp.float8_e4m3fn, seed=0):
    rng = np.random.default_rng(seed)
    a = jnp.asarray((rng.standard_normal((m, k)) * 8).astype(np.float32)).astype(dtype)  # f32 -> fp8
    b = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32)).astype(dtype)  # f32 -> fp8
    sa = jnp.asarray(rng.uniform(0.5, 2.0, (m, k // 128)).astype(np.float32))
    sb = jnp.asarray(rng.uniform(0.5, 2.0, (k // 128, n)).astype(np.float32))
    return a, sa, b, sb


def test_interpret_matches_xla_reference():
    args = _operands(40, 256, 128)  # M padded to 64, two K-chunks through the TMA pipeline
    ref = jax.jit(fp8_blockwise_matmul_reference)(*args)
    out = jax.jit(functools.partial(fp8_blockwise_matmul_mgpu, interpret=True))(*args)
    # two XLA programs adding the same exact FP8 products (127 additions per 128-chunk, 2 chunk partials, 2 scale
    # products) in any order: each within γ_n·Σ|terms| of the exact sum, n = 127 + 2 + 2, the two within twice that
    a, sa, b, sb = (np.asarray(x, np.float64) for x in args)  # fp8 / f32 -> f64, exact
    mag = sum(
        np.abs(a[:, c : c + 128]) @ np.abs(b[c : c + 128]) * sa[:, i, None] * sb[i] for i, c in enumerate((0, 128))
    )
    assert_within(out, ref, 2 * gamma(127 + 2 + 2) * mag)


def test_lowers_for_cuda_to_mosaic_gpu():
    args = _operands(128, 512, 256)
    text = jax.jit(fp8_blockwise_matmul_mgpu).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu_v2" in text
    assert "__gpu$xla.gpu.triton" not in text
    # through blockwise_dot: forward, dX and dW are three Mosaic GPU launches (e4m3 everywhere)
    x, w = jnp.ones((64, 256), jnp.float32), jnp.ones((256, 128), jnp.float32)
    dot = functools.partial(blockwise_dot, impl="mosaic_gpu", grad_dtype=jnp.float8_e4m3fn)
    f = jax.value_and_grad(lambda x, w: jnp.sum(dot(x, w)), argnums=(0, 1))
    text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu_v2") == 3


@pytest.mark.skipif(not compat.WGMMA_MIXES_FP8, reason=f"jax {jax.__version__}'s Mosaic GPU cannot mix FP8 formats")
@pytest.mark.parametrize("fa, fb", [(E5M2, E4M3), (E4M3, E5M2)], ids=["e5m2-x-e4m3", "e4m3-x-e5m2"])
def test_mixed_formats_interpreted_and_lowered(fa, fb):
    """dX multiplies e5m2 gradients by e4m3 weights and dW e4m3 activations by e5m2 gradients: on jax >= 0.11 one
    wgmma each. FP8 x FP8 products are exact in f32, so the interpreted kernel equals the twin to the f32 sums'
    rounding (one K-chunk of 128 terms and its scale products)."""
    a, sa, _, _ = _operands(64, 128, 128, dtype=fa, seed=1)
    _, _, b, sb = _operands(64, 128, 128, dtype=fb, seed=2)
    ref = jax.jit(fp8_blockwise_matmul_reference)(a, sa, b, sb)
    out = jax.jit(functools.partial(fp8_blockwise_matmul_mgpu, interpret=True))(a, sa, b, sb)
    a64, sa64, b64, sb64 = (np.asarray(x, np.float64) for x in (a, sa, b, sb))  # fp8 / f32 -> f64, exact
    assert_within(out, ref, 2 * gamma(127 + 2) * (np.abs(a64) @ np.abs(b64) * sa64 * sb64))
    assert float(np.max(np.abs(np.asarray(ref)))) > 1  # a real product, not zeros
    text = jax.jit(fp8_blockwise_matmul_mgpu).trace(a, sa, b, sb).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu_v2" in text


def test_rejects_bad_formats_and_tiles():
    a, sa, b, sb = _operands(64, 256, 128)
    with pytest.raises(ValueError, match="must be FP8"):
        fp8_blockwise_matmul_mgpu(a, sa, b.astype(jnp.bfloat16), sb)
    with pytest.raises(ValueError, match="block_m must be 64 or 128"):
        fp8_blockwise_matmul_mgpu(a, sa, b, sb, block_m=32)
    if compat.WGMMA_MIXES_FP8:  # the wgmma kernel takes the recipe's e5m2 gradients
        return
    with pytest.raises(ValueError, match="share one FP8 format"):
        fp8_blockwise_matmul_mgpu(a, sa, b.astype(jnp.float8_e5m2), sb)
    with pytest.raises(ValueError, match="needs grad_dtype == fwd_dtype"):
        blockwise_dot(np.ones((8, 128), np.float32), np.ones((128, 128), np.float32), impl="mosaic_gpu")
