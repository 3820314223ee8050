"""The Pallas flash-attention kernel in interpret mode against its XLA twin (lpt/kernels/flash_attention/reference.py):
forward and backward, several policies, repeats across blocks, masks, GQA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED
from float_bounds import assert_within, gamma

from lpt.attention import AttentionPolicy, dot_product_attention
from lpt.kernels.flash_attention import kernel as fk
from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention import reference as fr
from lpt.kernels.flash_attention.options import FlashOptions
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

        return jax.jit(both, compiler_options=UNOPTIMIZED)(q, k, v)

    (o_k, g_k), (o_r, g_r) = run("pallas"), run("xla")
    o_k, o_r = o_k.astype(jnp.float32), o_r.astype(jnp.float32)
    # bf16 outputs: equal up to one bf16 ulp where the two XLA programs round an f32 value differently. The programs'
    # f32 values differ by a few f32 ulps (2^-16 of a bf16 ulp each), so a bf16 rounding (of P̃, of a block update,
    # of O) flips only within that distance of a rounding boundary: on well under 3% of the outputs
    np.testing.assert_allclose(o_k, o_r, atol=0, rtol=2.0**-7)
    assert float(jnp.mean(o_k == o_r)) > 0.97
    for g_kernel, g_ref in zip(g_k, g_r, strict=True):
        g_kernel, g_ref = g_kernel.astype(jnp.float32), g_ref.astype(jnp.float32)
        scale = float(jnp.max(jnp.abs(g_ref)))
        assert scale > 0.05
        np.testing.assert_allclose(g_kernel, g_ref, atol=2e-2 * scale, rtol=0)


def test_interpret_kernel_split_accumulation_matches_reference_f32():
    """The f32 O (the default's δ residual) and lse of the interpreted kernel and the twin on rows whose repeated
    maxima dominate (the lab's draws): both sum P̃V as large + small weights (accumulator="split": three dots per
    key block, S and the two P̃V matmuls, against two for one f32 matmul).

    The two XLA programs may add the same f32 terms in other orders (XLA:CPU picks FMA contraction, vector widths
    and dot kernels per program and ISA). First-order bounds, u = 2^-24: a logit sums D = 16 exact bf16 products, so
    the programs' logits differ by at most e_j = 2γ_16·0.25·Σ_d|q_d k_jd|, which moves O by Σ_j P_j e_j |v_j − O|
    and lse by Σ_j P_j e_j. P̃ is rounded before ℓ and P̃V sum it (denominator="rounded"), so a weight's own
    rounding scales acc and ℓ alike; each product P̃_j v_j (exact) then meets <= 15 additions in its block's dot, 1
    joining the large and small sums, <= 3 rescales and 4 additions over the 4 key blocks and the final division:
    n = 24 roundings, in acc and in ℓ, so 4γ_24·Σ_j P_j|v_j| more for O. lse = c + log ℓ adds 2γ_24 from ℓ and,
    per program, 2u·(max_offset + log T + |lse|) for s − c (|s − c| <= max_offset + |s − m|), log and the final
    sum. Dropping the split moves O by at most 6 ulps here, within these bounds, so the split is checked in the
    traced programs."""
    (q, k, v), _ = repeated_max_draws(8, seed=3)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # [n, T, 1, D] -> [n, 1, T, D]
    seg = jnp.zeros(q.shape[:1] + q.shape[2:3], jnp.int32)
    policy = fm.default_policy()
    options = FlashOptions(causal=False, scale=0.25, policy=policy, block_q=32, block_k=16, interpret=True)
    kernel = lambda q, k, v: fk.forward(q, k, v, seg, seg, options=options)
    twin = lambda q, k, v: fr.reference_forward(q, k, v, seg, seg, options=options)
    for f in (kernel, twin):  # S = QKᵀ, (P̃ ∘ big) V, (P̃ ∘ ¬big) V
        assert str(jax.make_jaxpr(f)(q, k, v)).count("dot_general") == 3
    o_k, lse_k = jax.jit(kernel, compiler_options=UNOPTIMIZED)(q, k, v)
    o_r, lse_r = jax.jit(twin, compiler_options=UNOPTIMIZED)(q, k, v)
    assert o_k.dtype == jnp.float32
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))  # bf16 -> f64, exact
    s = 0.25 * q64 @ k64.swapaxes(-1, -2)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    pe = p * 2 * gamma(16) * 0.25 * (np.abs(q64) @ np.abs(k64).swapaxes(-1, -2))  # P_j e_j
    o64 = p @ v64
    o_bound = pe @ np.abs(v64) + pe.sum(-1, keepdims=True) * np.abs(o64) + 4 * gamma(24) * (p @ np.abs(v64))
    assert_within(o_k, o_r, o_bound, "O")
    lse_abs = np.abs(np.asarray(lse_r, np.float64))
    lse_bound = pe.sum(-1) + 2 * gamma(24) + 4 * 2.0**-24 * (policy.max_offset + np.log(s.shape[-1]) + lse_abs)
    assert_within(lse_k, lse_r, lse_bound, "lse")
