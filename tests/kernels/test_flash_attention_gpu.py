"""The Triton ("loop") structure of the flash kernels, inspected in interpret mode: a grid over query blocks (key
blocks for dK/dV) whose programs loop over the other sequence in-kernel from a whole-sequence ref, and dK/dV written
per KV head ([B, Hkv, T, D]: the G query heads are summed inside the program)."""

import jax
import jax.numpy as jnp
from test_flash_attention_kernel import BK, BQ, HKV, B, D, H, T, _inputs

from lpt.kernels.flash_attention import kernel as fk
from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention.options import FlashOptions


def _calls(structure):
    q, k, v, do, q_seg, kv_seg = _inputs()
    rows = jnp.zeros((B, H, T), jnp.float32)
    kw = dict(causal=True, scale=0.25, block_q=BQ, block_k=BK, interpret=True, structure=structure)
    options = FlashOptions(policy=fm.default_policy(), **kw)

    def both(q, k, v, do):
        fk.forward(q, k, v, q_seg, kv_seg, options=options)
        return fk.backward(q, k, v, q_seg, kv_seg, rows, do, rows, options=options)

    eqns = jax.make_jaxpr(both)(q, k, v, do).jaxpr.eqns
    return {e.params["name"]: e for e in eqns if e.primitive.name == "pallas_call"}


def _block_rows(eqn, operand):
    return eqn.params["grid_mapping"].block_mappings[operand].block_shape[-2]


def test_loop_structure_reads_whole_sequences_and_writes_per_kv_head():
    loop, grid = _calls("loop"), _calls("grid")
    fwd = loop["lpt_flash_attention_fwd"]
    assert tuple(fwd.params["grid_mapping"].grid) == (B, H, T // BQ)  # no key-block grid axis: an in-kernel loop
    assert getattr(_block_rows(fwd, 1), "block_size", _block_rows(fwd, 1)) == T  # k: the whole sequence
    assert getattr(_block_rows(grid["lpt_flash_attention_fwd"], 1), "block_size", None) == BK  # grid: one block
    dkdv = loop["lpt_flash_attention_dkdv"]
    assert [tuple(o.aval.shape) for o in dkdv.outvars] == [(B, HKV, T, D)] * 2
