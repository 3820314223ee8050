"""The Pallas flash-attention kernel: both structures ("grid": Mosaic, "loop": Triton) interpreted against the XLA
twin, GQA-native dK/dV, the per-mode tiles, and lowering to the cuda (Triton) and tpu (Mosaic) custom calls.
Real compiles for v5e and H100 are in test_flash_attention_compile.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_bounds import assert_within
from lowering import lowering

from lpt.attention import dot_product_attention
from lpt.kernels.flash_attention import kernel as fk
from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention import reference as fr
from lpt.kernels.flash_attention.options import FlashOptions

B, H, HKV, T, D = 2, 4, 2, 64, 16
BQ, BK = 16, 8  # bq != bk: the causal diagonal crosses blocks differently for queries and keys


def _inputs(tk: int = T):
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (B, H, T, D)).astype(jnp.bfloat16)  # f32 -> bf16
    k = jax.random.normal(ks[1], (B, HKV, tk, D)).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, HKV, tk, D)).astype(jnp.bfloat16)
    do = jax.random.normal(ks[3], (B, H, T, D)).astype(jnp.bfloat16)
    q_seg = jnp.zeros((B, T), jnp.int32).at[1, 40:].set(1)  # batch 1: two packed sequences
    kv_seg = jnp.zeros((B, tk), jnp.int32).at[1, 40:].set(1).at[0, 5].set(-1)  # batch 0: key 5 is padding
    return q, k, v, do, q_seg, kv_seg


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "cross"])
@pytest.mark.parametrize("name", ["default", "standard"])
def test_both_structures_match_reference(causal, name):
    """Interpreted "grid" and "loop" kernels vs the XLA twin: the same key-block order and per-block rules, in three
    different XLA programs. XLA:CPU picks FMA contraction, vector widths and dot kernels per program and per ISA, so
    the f32 sums inside a block (D = 16 terms for S, Bk = 8 for P̃V, heads and queries for dK/dV) may run in another
    order: every f32 result is asserted within 16 f32 ulps of its largest magnitude (2^-20·max|·|; measured: 0 on
    Zen 3 and Zen 4, at most 2 ulps on Sapphire Rapids). Default policy: O is f32. Standard policy (ℓ summed from
    f32 P̄, O rounded to bf16): O within one bf16 ulp and almost all equal, lse within 2 f32 ulps, dq within 2^-18·max.
    Non-causal runs cross-attention, Tk = 48 != Tq = 64."""
    policy = fm.default_policy() if name == "default" else fm.standard_policy()
    q, k, v, do, q_seg, kv_seg = _inputs() if causal else _inputs(tk=48)
    twin = FlashOptions(causal=causal, scale=0.25, policy=policy, block_q=BQ, block_k=BK)
    o_r, lse_r = jax.jit(lambda: fr.reference_forward(q, k, v, q_seg, kv_seg, options=twin))()
    delta = jnp.sum(do.astype(jnp.float32) * o_r, axis=-1)  # bf16 -> f32 (exact products)
    g_r = jax.jit(lambda: fr.reference_backward(q, k, v, q_seg, kv_seg, lse_r, do, delta, options=twin))()
    dkdv = {}
    for structure in ("grid", "loop"):
        run = dataclasses.replace(twin, interpret=True, structure=structure)
        o, lse = jax.jit(lambda s=run: fk.forward(q, k, v, q_seg, kv_seg, options=s))()
        dq, dk, dv = jax.jit(lambda s=run: fk.backward(q, k, v, q_seg, kv_seg, lse_r, do, delta, options=s))()
        o_ref = o_r.astype(o.dtype) if o.dtype == jnp.float32 else fm.round_to(o_r, o.dtype)  # f32 -> O dtype (RNE)
        if name == "default":
            assert o.dtype == jnp.float32
            _assert_f32_order_close(o, o_ref)
            _assert_f32_order_close(lse, lse_r)
            _assert_f32_order_close(dq, g_r[0])
        else:
            np.testing.assert_allclose(o.astype(jnp.float32), o_ref.astype(jnp.float32), rtol=2.0**-8, atol=0)
            assert float(jnp.mean(o == o_ref)) > 0.97
            np.testing.assert_allclose(lse, lse_r, rtol=2.0**-22, atol=0)
            np.testing.assert_allclose(dq, g_r[0], atol=2.0**-18 * float(jnp.max(jnp.abs(g_r[0]))), rtol=0)
        assert dk.shape == dv.shape == k.shape and dk.dtype == jnp.float32
        for g, g_ref in ((dk, g_r[1]), (dv, g_r[2])):
            assert float(jnp.max(jnp.abs(g_ref))) > 0.1
            _assert_f32_order_close(g, g_ref)
        dkdv[structure] = (dk, dv)
    for a, b in zip(dkdv["grid"], dkdv["loop"], strict=True):
        _assert_f32_order_close(a, b)


def _assert_f32_order_close(x, ref):
    """|x - ref| <= 16 f32 ulps of max|ref| (2^-20·max|ref|): the same f32 sums, added in another order."""
    scale = float(jnp.max(jnp.abs(ref)))
    assert scale > 0
    assert_within(x, ref, 2.0**-20 * scale)


@pytest.mark.parametrize("platform, marker", [("cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu_custom_call")])
def test_lowers_to_kernel_custom_call(platform, marker):
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    k = jnp.zeros((1, 256, 1, 64), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(dot_product_attention(q, k, v, impl="pallas").astype(jnp.float32))

    with lowering(platform):
        fwd = jax.jit(loss).trace(q, k, k).lower(lowering_platforms=(platform,)).as_text()
        bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k).lower(lowering_platforms=(platform,)).as_text()
    assert fwd.count(marker) == 1  # the forward kernel
    assert bwd.count(marker) == 3  # forward (recomputed for residuals), dK/dV and dQ kernels
