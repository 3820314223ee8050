"""fp8_blockwise_matmul Pallas kernel: interpret=True vs its XLA twin, platform dispatch, cuda/tpu lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpt.fp8 import blockwise_dot
from lpt.kernels.fp8_blockwise_matmul import fp8_blockwise_matmul, fp8_blockwise_matmul_reference


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
    chunks in the twin's order; the only difference allowed is the order inside one chunk's dot."""
    args = _operands(m, k, n, da, db)
    ref = jax.jit(fp8_blockwise_matmul_reference)(*args)
    out = jax.jit(functools.partial(fp8_blockwise_matmul, interpret=True, structure=structure))(*args)
    scale = float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=4 * 2.0**-24 * scale * k / 128)
    # the per-chunk scales matter: dropping them would be far off
    assert float(jnp.max(jnp.abs(ref - jnp.dot(args[0].astype(jnp.float32), args[2].astype(jnp.float32))))) > 1.0


def test_blockwise_dot_pallas_matches_xla_with_grads():
    """impl="pallas" (platform_dependent: interpreted on CPU) vs impl="xla", forward and both backward GEMMs."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((24, 256)).astype(np.float32)
    w = (rng.standard_normal((256, 128)) / 16).astype(np.float32)
    g = rng.standard_normal((24, 128)).astype(np.float32)

    @functools.partial(jax.jit, static_argnames="impl")
    def run(x, w, impl):
        y, vjp = jax.vjp(lambda x, w: blockwise_dot(x, w, impl=impl), x, w)
        return (y, *vjp(g))

    for o_p, o_x in zip(run(x, w, "pallas"), run(x, w, "xla"), strict=True):
        np.testing.assert_allclose(np.asarray(o_p), np.asarray(o_x), rtol=1e-5, atol=1e-5 * float(jnp.abs(o_x).max()))


@pytest.mark.parametrize("platform,custom_call", [("cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu_custom_call")])
def test_lowers_for_gpu_and_tpu(platform, custom_call):
    a, sa, b, sb = _operands(128, 512, 256, jnp.float8_e4m3fn, jnp.float8_e4m3fn)
    text = jax.jit(fp8_blockwise_matmul).trace(a, sa, b, sb).lower(lowering_platforms=(platform,)).as_text()
    assert custom_call in text
    # the whole differentiable layer: forward, dX and dW are three kernel launches
    x = jnp.ones((64, 256), jnp.float32)
    w = jnp.ones((256, 128), jnp.float32)
    grad = jax.value_and_grad(lambda x, w: jnp.sum(blockwise_dot(x, w, impl="pallas")), argnums=(0, 1))
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
