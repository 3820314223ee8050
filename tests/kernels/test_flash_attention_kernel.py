"""The Pallas flash-attention kernel lowers for cuda (Triton) and tpu (Mosaic): the custom calls are in the module.
Its interpret-mode agreement with the XLA twin is tested in test_flash_attention_reference.py."""

import jax
import jax.numpy as jnp
import pytest

from lpt.attention import dot_product_attention


@pytest.mark.parametrize("platform, marker", [("cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu_custom_call")])
def test_lowers_to_kernel_custom_call(platform, marker):
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    k = jnp.zeros((1, 256, 1, 64), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(dot_product_attention(q, k, v, impl="pallas").astype(jnp.float32))

    fwd = jax.jit(loss).trace(q, k, k).lower(lowering_platforms=(platform,)).as_text()
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k).lower(lowering_platforms=(platform,)).as_text()
    assert fwd.count(marker) == 1  # the forward kernel
    assert bwd.count(marker) == 3  # forward (recomputed for residuals), dK/dV and dQ kernels
