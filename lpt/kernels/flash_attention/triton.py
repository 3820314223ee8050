"""The "loop" structure of the flash-attention kernel (Triton GPU, and the interpreter): a ``fori_loop`` over blocks.

A Triton program cannot carry state across grid steps, so each program loops over the blocks it reduces, loading one
block per iteration with ``pl.ds`` from a whole-sequence ref (a pointer: only the loaded [b, D] tiles occupy
registers and shared memory, whatever T is):

* forward ``(B, H, Tq/bq)``: loop over the key blocks the query block sees
  (:func:`lpt.kernels.flash_attention.tiles.key_blocks`: causal up to the diagonal, with a sliding window from the
  window's first block) with the online softmax.
* dQ ``(B, H, Tq/bq)``: loop over the same key blocks.
* dK/dV ``(B, Hkv, Tk/bk)``: one loop over the G query heads of kv head hk (outer) and the query blocks that see the
  key block (inner; :func:`lpt.kernels.flash_attention.tiles.query_blocks`: causal from the diagonal, with a sliding
  window up to the window's last), accumulating dk, dv [bk, D] f32, written as [B, Hkv, Tk, D]. q, dO, lse, δ come in as
  [B, Hkv, G·Tq, ·] (a free reshape of [B, H, Tq, ·]).

The loops run over those ranges only, so a sliding window makes the work O(T · window), not O(T²).

Same block order and per-block rules as the "grid" structure (:mod:`lpt.kernels.flash_attention.tpu`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from lpt.kernels import dispatch
from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention import tiles


def _fwd_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, o_ref, lse_ref, *, options, bq, bk, native):
    policy, causal, window, scale = options.policy, options.causal, options.window, options.scale
    i = pl.program_id(2)
    q = q_ref[...]
    q_seg = qseg_ref[...]
    pv_dtype = policy.pv(v_ref.dtype)
    nk = k_ref.shape[0] // bk

    def body(j, carry):
        start = pl.multiple_of(j * bk, bk)
        valid = tiles.valid_mask(q_seg, kvseg_ref[:, pl.ds(start, bk)], i * bq, start, (bq, bk), causal, window)
        s = tiles.dot(q, k_ref[pl.ds(start, bk), :], tiles.NT) * jnp.float32(scale)
        v_pv = fm.round_to(v_ref[pl.ds(start, bk), :].astype(jnp.float32), pv_dtype, native)  # -> f32 -> pv (RNE)
        return fm.forward_step(carry, s, valid, lambda w: tiles.dot(w, v_pv), policy, pv_dtype, native)

    col = jnp.zeros((bq, 1), jnp.float32)
    init = (col - jnp.inf, col, col, col, jnp.zeros(q.shape, jnp.float32))
    first, end = tiles.key_blocks(i, bq=bq, bk=bk, nk=nk, causal=causal, window=window)
    _, _, c, l, acc = lax.fori_loop(first, end, body, init)
    o, lse = fm.finalize(acc, l, c)
    o_ref[...] = fm.round_to(o, o_ref.dtype, native)  # f32 -> O dtype (RNE; bf16 for residual "input")
    lse_ref[...] = lse


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref, dq_ref, **kw):
    options, bq, bk, native = (kw[n] for n in ("options", "bq", "bk", "native"))
    causal, window, scale = options.causal, options.window, options.scale
    i = pl.program_id(2)
    q, do, lse, delta, q_seg = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], qseg_ref[...]
    nk = k_ref.shape[0] // bk

    def body(j, dq):
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        valid = tiles.valid_mask(q_seg, kvseg_ref[:, pl.ds(start, bk)], i * bq, start, (bq, bk), causal, window)
        s = tiles.dot(q, k, tiles.NT) * jnp.float32(scale)
        dp = tiles.dot(do, v_ref[pl.ds(start, bk), :], tiles.NT)
        _, ds_in = fm.backward_weights(s, valid, lse, dp, delta, q_ref.dtype, native)
        return dq + tiles.dot(ds_in, k)

    first, end = tiles.key_blocks(i, bq=bq, bk=bk, nk=nk, causal=causal, window=window)
    dq = lax.fori_loop(first, end, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq * jnp.float32(scale)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref, dk_ref, dv_ref, **kw):
    options, bq, bk, tq, g, native = (kw[n] for n in ("options", "bq", "bk", "tq", "g", "native"))
    causal, window, scale = options.causal, options.window, options.scale
    j = pl.program_id(2)
    k, v, kv_seg = k_ref[...], v_ref[...], kvseg_ref[...]
    lo, hi = tiles.query_blocks(j, bq=bq, bk=bk, nq=tq // bq, causal=causal, window=window)
    n_i = hi - lo  # query blocks per head

    def body(t, carry):
        dk, dv = carry
        gi, i = lax.div(t, n_i), lo + lax.rem(t, n_i)  # query head gi of the group (outer), query block i (inner)
        start = pl.multiple_of(i * bq, bq)
        row = pl.multiple_of(gi * tq + start, bq)
        q, do = q_ref[pl.ds(row, bq), :], do_ref[pl.ds(row, bq), :]
        valid = tiles.valid_mask(qseg_ref[pl.ds(start, bq), :], kv_seg, start, j * bk, (bq, bk), causal, window)
        s = tiles.dot(q, k, tiles.NT) * jnp.float32(scale)
        dp = tiles.dot(do, v, tiles.NT)
        lse, delta = lse_ref[pl.ds(row, bq), :], delta_ref[pl.ds(row, bq), :]
        p_in, ds_in = fm.backward_weights(s, valid, lse, dp, delta, q_ref.dtype, native)
        return dk + tiles.dot(ds_in, q, tiles.TN), dv + tiles.dot(p_in, do, tiles.TN)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, g * n_i, body, (zeros, zeros))
    dk_ref[...] = dk * jnp.float32(scale)
    dv_ref[...] = dv


def _call(kind, kernel, mode, grid, in_specs, out_specs, **outputs):
    """The ``pallas_call`` of one kernel, its outputs from :func:`lpt.kernels.flash_attention.tiles.call_outputs`
    (``kind`` and ``outputs``). Triton: 4 warps for D <= 64, 8 above (the f32 [b, D] accumulators spread over more
    threads), 2 stages."""
    d = outputs["shape"][-1]
    params = dict(num_warps=4 if d <= 64 else 8, num_stages=2) if mode == "triton" else {}
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        **tiles.call_outputs(kind, **outputs),
        **dispatch.mode_kwargs(mode, **params),
    )


def forward_call(mode, *, shape, g, tk, o_dtype, options, bq, bk):
    """``pallas_call`` of the forward on (q, k, v, q_seg [B, Tq, 1], kv_seg [B, 1, Tk]) -> (O, lse [B, H, Tq, 1]).

    Args:
      mode: "triton" or "interpret".
      shape, g, tk, o_dtype, options, bq, bk: as :func:`lpt.kernels.flash_attention.tpu.forward_call`.
    """
    mask = dict(causal=options.causal, window=options.window, bq=bq, bk=bk)  # the position rule and the blocks
    b, h, tq, d = shape
    full_kv = pl.BlockSpec((None, None, tk, d), lambda bi, hi, i: (bi, lax.div(hi, g), 0, 0))
    in_specs = [
        pl.BlockSpec((None, None, bq, d), lambda bi, hi, i: (bi, hi, i, 0)),
        full_kv,
        full_kv,
        pl.BlockSpec((None, bq, 1), lambda bi, hi, i: (bi, i, 0)),
        pl.BlockSpec((None, 1, tk), lambda bi, hi, i: (bi, 0, 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, None, bq, d), lambda bi, hi, i: (bi, hi, i, 0)),
        pl.BlockSpec((None, None, bq, 1), lambda bi, hi, i: (bi, hi, i, 0)),
    ]
    kernel = functools.partial(_fwd_kernel, options=options, bq=bq, bk=bk, native=False)
    grid = (b, h, tq // bq)
    return _call("fwd", kernel, mode, grid, in_specs, out_specs, shape=shape, g=g, tk=tk, o_dtype=o_dtype, **mask)


def dq_call(mode, *, shape, g, tk, options, bq, bk):
    """``pallas_call`` of dQ on (q, k, v, do, lse, δ [B, H, Tq, 1], q_seg, kv_seg) -> dq f32 [B, H, Tq, D].

    Args:
      mode, shape, g, tk, options, bq, bk: as :func:`forward_call`.
    """
    mask = dict(causal=options.causal, window=options.window, bq=bq, bk=bk)  # the position rule and the blocks
    b, h, tq, d = shape
    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i: (bi, hi, i, 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda bi, hi, i: (bi, hi, i, 0))
    full_kv = pl.BlockSpec((None, None, tk, d), lambda bi, hi, i: (bi, lax.div(hi, g), 0, 0))
    qseg_spec = pl.BlockSpec((None, bq, 1), lambda bi, hi, i: (bi, i, 0))
    kvseg_spec = pl.BlockSpec((None, 1, tk), lambda bi, hi, i: (bi, 0, 0))
    in_specs = tiles.backward_in_specs(q_spec, full_kv, row_spec, qseg_spec, kvseg_spec)
    kernel = functools.partial(_dq_kernel, options=options, bq=bq, bk=bk, native=False)
    return _call("dq", kernel, mode, (b, h, tq // bq), in_specs, q_spec, shape=shape, g=g, tk=tk, **mask)


def dkdv_call(mode, *, shape, g, tk, options, bq, bk):
    """``pallas_call`` of dK/dV, one program per key block, with the operands and outputs of
    :func:`lpt.kernels.flash_attention.tpu.dkdv_call`.

    Args:
      mode: "triton" or "interpret".
      shape, g, tk, options, bq, bk: as :func:`lpt.kernels.flash_attention.tpu.dkdv_call`.
    """
    mask = dict(causal=options.causal, window=options.window, bq=bq, bk=bk)  # the position rule and the blocks
    b, hkv, gtq, d = shape
    tq = gtq // g
    full_q = pl.BlockSpec((None, None, gtq, d), lambda bi, hk, j: (bi, hk, 0, 0))
    full_row = pl.BlockSpec((None, None, gtq, 1), lambda bi, hk, j: (bi, hk, 0, 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda bi, hk, j: (bi, hk, j, 0))
    qseg_spec = pl.BlockSpec((None, tq, 1), lambda bi, hk, j: (bi, 0, 0))
    kvseg_spec = pl.BlockSpec((None, 1, bk), lambda bi, hk, j: (bi, 0, j))
    in_specs = tiles.backward_in_specs(full_q, kv_spec, full_row, qseg_spec, kvseg_spec)
    kernel = functools.partial(_dkdv_kernel, options=options, tq=tq, g=g, bq=bq, bk=bk, native=False)
    grid = (b, hkv, tk // bk)
    return _call("dkdv", kernel, mode, grid, in_specs, [kv_spec, kv_spec], shape=shape, g=g, tk=tk, **mask)
