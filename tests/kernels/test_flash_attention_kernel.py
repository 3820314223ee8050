"""The Pallas flash-attention kernel: both structures ("grid": Mosaic, "loop": Triton) interpreted against the XLA
twin, GQA-native dK/dV, the per-mode tiles, and lowering to the cuda (Triton) and tpu (Mosaic) custom calls.
Real compiles for v5e and H100 are in test_flash_attention_compile.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpt.attention import dot_product_attention
from lpt.kernels import flash_attention as fk
from lpt.kernels import flash_attention_math as fm
from lpt.kernels import flash_attention_reference as fr
from lpt.kernels.flash_attention_tiles import tiles

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
    """Interpreted "grid" and "loop" kernels vs the XLA twin. Default policy: O, lse and dq bit for bit (same
    key-block order, same per-block rules). Standard policy (ℓ summed from f32 P̄, which XLA fuses differently in
    the two programs): lse within 2 f32 ulps, dq within f32 rounding. dk, dv: equal between the two structures bit
    for bit (same order over heads and query blocks) and within f32 summation order of the twin (which sums heads
    and queries in one einsum). Non-causal runs cross-attention, Tk = 48 != Tq = 64."""
    policy = fm.default_policy() if name == "default" else fm.standard_policy()
    q, k, v, do, q_seg, kv_seg = _inputs() if causal else _inputs(tk=48)
    kw = dict(causal=causal, scale=0.25)
    o_r, lse_r = jax.jit(lambda: fr.reference_forward(q, k, v, q_seg, kv_seg, policy=policy, block_k=BK, **kw))()
    delta = jnp.sum(do.astype(jnp.float32) * o_r, axis=-1)  # bf16 -> f32 (exact products)
    g_r = jax.jit(lambda: fr.reference_backward(q, k, v, q_seg, kv_seg, lse_r, do, delta, block_k=BK, **kw))()
    dkdv = {}
    for structure in ("grid", "loop"):
        run = dict(block_q=BQ, block_k=BK, interpret=True, structure=structure, **kw)
        o, lse = jax.jit(lambda s=run: fk.forward(q, k, v, q_seg, kv_seg, policy=policy, **s))()
        dq, dk, dv = jax.jit(lambda s=run: fk.backward(q, k, v, q_seg, kv_seg, lse_r, do, delta, **s))()
        o_ref = o_r.astype(o.dtype) if o.dtype == jnp.float32 else fm.round_to(o_r, o.dtype)  # f32 -> O dtype (RNE)
        if name == "default":
            np.testing.assert_array_equal(o, o_ref)
            np.testing.assert_array_equal(lse, lse_r)
            np.testing.assert_array_equal(dq, g_r[0])
        else:
            np.testing.assert_allclose(o.astype(jnp.float32), o_ref.astype(jnp.float32), rtol=2.0**-8, atol=0)
            assert float(jnp.mean(o == o_ref)) > 0.97
            np.testing.assert_allclose(lse, lse_r, rtol=2.0**-22, atol=0)
            np.testing.assert_allclose(dq, g_r[0], atol=2.0**-18 * float(jnp.max(jnp.abs(g_r[0]))), rtol=0)
        assert dk.shape == dv.shape == k.shape and dk.dtype == jnp.float32
        for g, g_ref in ((dk, g_r[1]), (dv, g_r[2])):
            scale = float(jnp.max(jnp.abs(g_ref)))
            assert scale > 0.1
            np.testing.assert_allclose(g, g_ref, atol=2.0**-20 * scale, rtol=0)
        dkdv[structure] = (dk, dv)
    for a, b in zip(dkdv["grid"], dkdv["loop"], strict=True):
        np.testing.assert_array_equal(a, b)


def test_dkdv_kernel_is_gqa_native():
    """The dK/dV pallas_call writes [B, Hkv, T, D] (not per query head) from a grid (B, Hkv, T/bk, G·T/bq) whose
    trailing axis runs over the group's query heads and query blocks."""
    q, k, v, do, q_seg, kv_seg = _inputs()
    lse = delta = jnp.zeros((B, H, T), jnp.float32)

    def bwd(q, k, v, do):
        kw = dict(causal=True, scale=0.25, block_q=BQ, block_k=BK, interpret=True)
        return fk.flash_backward(q, k, v, q_seg, kv_seg, lse, do, delta, **kw)

    eqns = [e for e in jax.make_jaxpr(bwd)(q, k, v, do).jaxpr.eqns if e.primitive.name == "pallas_call"]
    by_name = {e.params["name"]: e for e in eqns}
    dkdv = by_name["lpt_flash_attention_dkdv"]
    assert [tuple(o.aval.shape) for o in dkdv.outvars] == [(B, HKV, T, D)] * 2
    assert tuple(dkdv.params["grid_mapping"].grid) == (B, HKV, T // BK, (H // HKV) * (T // BQ))
    for e in eqns:  # every pallas_call blocks sequences: no [.., T, D] block of q, k, v or dO in the grid structure
        blocks = [
            [getattr(dim, "block_size", 1) for dim in bm.block_shape] for bm in e.params["grid_mapping"].block_mappings
        ]
        assert all(T not in sizes for sizes in blocks), (e.params["name"], blocks)


def test_tiles_per_mode():
    assert tiles("interpret", 64, 64, 16, 16, 8) == (16, 8)
    assert tiles("mosaic", 32768, 32768, 128, 128, 128) == (512, 512)
    assert tiles("mosaic", 32768, 32768, 256, 128, 128) == (256, 256)
    assert tiles("mosaic", 384, 384, 128, 128, 128) == (384, 384)  # a multiple of 128 dividing T
    assert tiles("mosaic", 32, 32, 128, 8, 8) == (32, 32)  # T itself is always a legal TPU block
    assert tiles("triton", 32768, 32768, 128, 128, 128) == (64, 64)
    assert tiles("triton", 32768, 32768, 64, 128, 128) == (128, 128)
    with pytest.raises(ValueError, match="structure"):
        fk.forward(*_inputs()[:3], *_inputs()[4:], policy=fm.default_policy(), causal=True, scale=1.0, block_q=8,
                   block_k=8, interpret=True, structure="ring")  # fmt: skip


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


def _fetches(eqn, operand: int) -> int:
    """Block fetches of input ``operand`` over the grid in order: steps whose block index differs from the previous
    step's (Pallas copies a block only then)."""
    mapping = eqn.params["grid_mapping"]
    index_map = mapping.block_mappings[operand].index_map_jaxpr
    fetches, previous = 0, None
    for point in np.ndindex(*mapping.grid):
        idx = tuple(int(x) for x in jax.core.eval_jaxpr(index_map.jaxpr, index_map.consts, *map(jnp.int32, point)))
        fetches += idx != previous
        previous = idx
    return fetches


def test_causal_index_maps_skip_masked_blocks():
    """Causal grid kernels fetch only blocks at or below the diagonal: with Tq/bq = 4 query and Tk/bk = 8 key blocks
    the forward and dQ read K for each of the H = 2 heads 2·(2+4+6+8) = 40 times (64 without the clamp); dK/dV reads
    the Q blocks at or after each key block's diagonal for each of the G = 2 heads: 2·(4+4+3+3+2+2+1+1) = 40 (64
    without)."""
    b, h, hkv, t, d = 1, 2, 1, 32, 8
    q = jnp.zeros((b, h, t, d), jnp.bfloat16)
    k = jnp.zeros((b, hkv, t, d), jnp.bfloat16)
    seg = jnp.zeros((b, t), jnp.int32)
    rows = jnp.zeros((b, h, t), jnp.float32)
    kw = dict(causal=True, scale=1.0, block_q=8, block_k=4, interpret=True)

    def both(q, k):
        fk.forward(q, k, k, seg, seg, policy=fm.default_policy(), **kw)
        return fk.backward(q, k, k, seg, seg, rows, q, rows, **kw)

    eqns = {e.params["name"]: e for e in jax.make_jaxpr(both)(q, k).jaxpr.eqns if e.primitive.name == "pallas_call"}
    assert _fetches(eqns["lpt_flash_attention_fwd"], 1) == 40  # operand 1: k
    assert _fetches(eqns["lpt_flash_attention_dq"], 1) == 40
    assert _fetches(eqns["lpt_flash_attention_dkdv"], 0) == 40  # operand 0: q [B, Hkv, G·Tq, D]
