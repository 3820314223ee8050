"""The Pallas flash-attention kernel in interpret mode against its XLA twin (lpt/kernels/flash_attention_reference.py):
forward and backward, several policies, repeats across blocks, masks, GQA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpt.attention import AttentionPolicy, dot_product_attention
from lpt.kernels import flash_attention as fk
from lpt.kernels import flash_attention_math as fm
from lpt.kernels import flash_attention_reference as fr
from lpt.lab.attention import repeated_max_draws

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


def test_interpret_kernel_split_accumulation_matches_reference_f32():
    """The f32 O (the default's δ residual) of the interpreted kernel equals the twin's bit for bit on rows whose
    repeated maxima dominate (the lab's draws): both sum P̃V as large + small weights (accumulator="split").

    One f32 matmul instead orders the swamped tiny products differently in the two programs (measured: 57% of the
    elements equal, different f32-level bias), so this fails if either side drops the split."""
    (q, k, v), _ = repeated_max_draws(8, seed=3)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # [n, T, 1, D] -> [n, 1, T, D]
    seg = jnp.zeros(q.shape[:1] + q.shape[2:3], jnp.int32)
    kw = dict(policy=fm.default_policy(), causal=False, scale=0.25, block_k=16)
    o_k, lse_k = jax.jit(lambda q, k, v: fk.flash_forward(q, k, v, seg, seg, block_q=32, interpret=True, **kw))(q, k, v)
    o_r, lse_r = jax.jit(lambda q, k, v: fr.reference_forward(q, k, v, seg, seg, **kw))(q, k, v)
    assert o_k.dtype == jnp.float32
    assert float(jnp.mean(o_k == o_r)) > 0.99
    np.testing.assert_allclose(o_k, o_r, rtol=2.0**-22, atol=0)
    np.testing.assert_allclose(lse_k, lse_r, rtol=2.0**-22, atol=0)
