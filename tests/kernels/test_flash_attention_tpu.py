"""The Mosaic ("grid") structure of the flash kernels, inspected in interpret mode: every block is one block of the
sequence, dK/dV is GQA-native, and causal index maps never fetch a block above the diagonal."""

import jax
import jax.numpy as jnp
import numpy as np
from test_flash_attention_kernel import BK, BQ, HKV, B, D, H, T, _inputs  # noqa: F401

from lpt.kernels.flash_attention import kernel as fk
from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention.options import FlashOptions


def test_dkdv_kernel_is_gqa_native():
    """The dK/dV pallas_call writes [B, Hkv, T, D] (not per query head) from a grid (B, Hkv, T/bk, G·T/bq) whose
    trailing axis runs over the group's query heads and query blocks."""
    q, k, v, do, q_seg, kv_seg = _inputs()
    lse = delta = jnp.zeros((B, H, T), jnp.float32)

    def bwd(q, k, v, do):
        options = FlashOptions(causal=True, scale=0.25, block_q=BQ, block_k=BK, interpret=True)
        return fk.backward(q, k, v, q_seg, kv_seg, lse, do, delta, options=options)

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
    options = FlashOptions(causal=True, scale=1.0, policy=fm.default_policy(), block_q=8, block_k=4, interpret=True)

    def both(q, k):
        fk.forward(q, k, k, seg, seg, options=options)
        return fk.backward(q, k, k, seg, seg, rows, q, rows, options=options)

    eqns = {e.params["name"]: e for e in jax.make_jaxpr(both)(q, k).jaxpr.eqns if e.primitive.name == "pallas_call"}
    assert _fetches(eqns["lpt_flash_attention_fwd"], 1) == 40  # operand 1: k
    assert _fetches(eqns["lpt_flash_attention_dq"], 1) == 40
    assert _fetches(eqns["lpt_flash_attention_dkdv"], 0) == 40  # operand 0: q [B, Hkv, G·Tq, D]
