"""The Pallas flash-attention kernel in interpret mode against its XLA twin (forward and backward, several
policies, repeats across blocks, masks, GQA), and its lowering for cuda (Triton) and tpu (Mosaic)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpt.attention import AttentionPolicy, dot_product_attention
from lpt.kernels import flash_attention_math as fm

B, T, H, HKV, D = 1, 30, 2, 1, 16  # T padded to 32 internally
BLOCK = 8


def _inputs():
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.float32).at[:, :, :, 0].add(2.0)
    k = jax.random.normal(ks[1], (B, T, HKV, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, HKV, D), jnp.float32) - 1.0
    for t in (2, 12, 21):  # the same key in three different blocks of 8: repeats across blocks
        k = k.at[:, t].set(k[:, 2]).at[:, t, :, 0].set(3.0)
    return q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)


def test_repeat_count_runs_across_blocks():
    s = jnp.array([[0.5, 2.0, 1.0, 2.0, -1.0, 2.0 - 2.0**-11, 0.0, 1.9]])
    valid = jnp.ones_like(s, bool)
    m, n = jnp.full((1, 1), -jnp.inf), jnp.zeros((1, 1))
    for blk in range(4):
        m, n = fm.update_max_count(m, n, s[:, 2 * blk : 2 * blk + 2], valid[:, :2], 2.0**-9)
    assert float(m[0, 0]) == 2.0 and float(n[0, 0]) == 3.0  # two exact repeats and one within tie_tol
    c = fm.shift_of(m, n, AttentionPolicy(shift="beta", beta=7.0))
    assert float(c[0, 0]) == 14.0  # β·m for a repeated positive max
    c = fm.shift_of(jnp.full((1, 1), 30.0), n, AttentionPolicy(shift="beta", beta=7.0, max_offset=64.0))
    assert float(c[0, 0]) == 94.0  # underflow guard: offset capped at 64 instead of (β − 1)·30 = 180
    c = fm.shift_of(jnp.full((1, 1), -3.0), n, AttentionPolicy(shift="beta"))
    assert float(c[0, 0]) == 0.0  # negative repeated max: shift 0


POLICIES = {
    "standard": fm.standard_policy(),
    "default": fm.default_policy(),
    "all_bf16": AttentionPolicy(shift="max", denominator="f32", accumulator="pv", residual="input"),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_interpret_kernel_matches_reference(name):
    """Interpreted kernel vs the XLA twin, forward O and dq, dk, dv (causal, GQA, padding or segments, T padded).

    "standard" runs with interpret=None, i.e. through lax.platform_dependent (whose cpu branch interprets)."""
    policy = POLICIES[name]
    interpret = None if name == "standard" else True
    q, k, v = _inputs()
    masks = {"kv_mask": jnp.arange(T)[None, :] != 5}
    if name == "default":  # packed sequences instead of padding
        masks = {"segment_ids": (jnp.arange(T)[None, :] >= 17).astype(jnp.int32)}
    w = jax.random.normal(jax.random.PRNGKey(4), (B, T, H, D)).astype(jnp.bfloat16)

    def run(impl):
        def f(q, k, v):
            return dot_product_attention(
                q, k, v, policy=policy, impl=impl, block_q=BLOCK, block_k=BLOCK, interpret=interpret, **masks
            )

        def both(q, k, v):
            o, vjp = jax.vjp(f, q, k, v)
            return o, vjp(w)

        return jax.jit(both)(q, k, v)

    (o_k, g_k), (o_r, g_r) = run("pallas"), run("xla")
    o_k, o_r = o_k.astype(jnp.float32), o_r.astype(jnp.float32)
    # bf16 outputs: equal up to one bf16 ulp where the two XLA programs round an f32 value differently
    np.testing.assert_allclose(o_k, o_r, atol=0, rtol=2.0**-7)
    assert float(jnp.mean(o_k == o_r)) > 0.97
    for g_kernel, g_ref in zip(g_k, g_r, strict=True):
        g_kernel, g_ref = g_kernel.astype(jnp.float32), g_ref.astype(jnp.float32)
        scale = float(jnp.max(jnp.abs(g_ref)))
        assert scale > 0.05
        np.testing.assert_allclose(g_kernel, g_ref, atol=2e-2 * scale, rtol=0)


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
