"""The "grid" structure of the flash-attention kernel (Mosaic TPU, and the interpreter): one block per grid step.

Every BlockSpec holds one block, so VMEM per program is O(bq·D + bk·D + bq·bk) whatever T is. The reduction runs
over a trailing grid axis with "arbitrary" semantics; its running state lives in VMEM scratch, set on the axis'
first step (``pl.when``) and written out on its last:

* forward ``(B, H, Tq/bq, nt)``: step t visits key block j = first + t of query block i, where first … end − 1 are
  the key blocks i sees (:func:`lpt.kernels.flash_attention.tiles.key_blocks`) and nt the most any query block sees
  (Tk/bk, or with a sliding window about (bq + window)/bk); scratch M, n, c, ℓ [bq, 1] and acc [bq, D] f32; the last
  step writes O (f32, or the input dtype for the "input" residual) and lse.
* dQ ``(B, H, Tq/bq, nt)``: the same steps; scratch dq [bq, D] f32.
* dK/dV ``(B, Hkv, Tk/bk, G·ns)``: key block j of kv head hk; the trailing axis r runs over the G query heads of
  hk (g = r // ns, outer) and the query blocks i = first + r mod ns that see j (inner;
  :func:`lpt.kernels.flash_attention.tiles.query_blocks`, ns the most any key block has); scratch dk, dv [bk, D] f32,
  written as dk, dv [B, Hkv, Tk, D] f32. q, dO, lse, δ come in as [B, Hkv, G·Tq, ·] (a free reshape of [B, H, Tq, ·]).

Causal (and sliding window): a step past its block's range (j >= end) computes nothing (``pl.when``), and its
index_map repeats the previous block's index (clamped to end − 1), so Pallas issues no DMA for it. Blocks outside
the window are never steps at all: the grid, the fetches and the work are O(T · window), not O(T²).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lpt.kernels import dispatch
from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention.tiles import (
    NT,
    TN,
    backward_in_specs,
    call_outputs,
    dot,
    key_blocks,
    query_blocks,
    valid_mask,
    widest,
)

_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary")


def _visit(blocks, b, t):
    """(block index of step t of block b's range, whether the step is in the range): ``first + t`` clamped to
    ``end − 1`` (a step past the end repeats the last index, so Pallas fetches nothing for it)."""
    first, end = blocks(b)
    return jnp.minimum(first + t, end - 1), first + t < end


def _when(cond, fn):
    if cond is None:
        fn()
    else:
        pl.when(cond)(fn)


def _fwd_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, o_ref, lse_ref, m_sc, n_sc, c_sc, l_sc, acc_sc, **kw):
    options, bq, bk, nt, native = (kw[n] for n in ("options", "bq", "bk", "nt", "native"))
    policy, causal, window, scale = options.policy, options.causal, options.window, options.scale
    i, t = pl.program_id(2), pl.program_id(3)
    j, visited = _visit(kw["blocks"], i, t)

    @pl.when(t == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        for ref in (n_sc, c_sc, l_sc, acc_sc):
            ref[...] = jnp.zeros(ref.shape, jnp.float32)

    def _step():
        pv_dtype = policy.pv(v_ref.dtype)
        valid = valid_mask(qseg_ref[...], kvseg_ref[...], i * bq, j * bk, (bq, bk), causal, window)
        s = dot(q_ref[...], k_ref[...], NT) * jnp.float32(scale)
        v_pv = fm.round_to(v_ref[...].astype(jnp.float32), pv_dtype, native)  # v dtype -> f32 -> pv dtype (RNE)
        carry = (m_sc[...], n_sc[...], c_sc[...], l_sc[...], acc_sc[...])
        new = fm.forward_step(carry, s, valid, lambda w: dot(w, v_pv), policy, pv_dtype, native)
        for ref, value in zip((m_sc, n_sc, c_sc, l_sc, acc_sc), new, strict=True):
            ref[...] = value

    _when(visited if causal else None, _step)

    @pl.when(t == nt - 1)
    def _finalize():
        o, lse = fm.finalize(acc_sc[...], l_sc[...], c_sc[...])
        o_ref[...] = fm.round_to(o, o_ref.dtype, native)  # f32 -> O dtype (RNE; bf16 for residual "input")
        lse_ref[...] = lse


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref, dq_ref, dq_sc, **kw):
    options, bq, bk, nt, native = (kw[n] for n in ("options", "bq", "bk", "nt", "native"))
    causal, window, scale = options.causal, options.window, options.scale
    i, t = pl.program_id(2), pl.program_id(3)
    j, visited = _visit(kw["blocks"], i, t)

    @pl.when(t == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    def _step():
        k = k_ref[...]
        valid = valid_mask(qseg_ref[...], kvseg_ref[...], i * bq, j * bk, (bq, bk), causal, window)
        s = dot(q_ref[...], k, NT) * jnp.float32(scale)
        dp = dot(do_ref[...], v_ref[...], NT)
        _, ds_in = fm.backward_weights(s, valid, lse_ref[...], dp, delta_ref[...], q_ref.dtype, native)
        dq_sc[...] += dot(ds_in, k)

    _when(visited if causal else None, _step)

    @pl.when(t == nt - 1)
    def _finalize():
        dq_ref[...] = dq_sc[...] * jnp.float32(scale)


def _dkdv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref, dk_ref, dv_ref, dk_sc, dv_sc, **kw
):
    options, bq, bk, ns, g, native = (kw[n] for n in ("options", "bq", "bk", "ns", "g", "native"))
    causal, window, scale = options.causal, options.window, options.scale
    j, r = pl.program_id(2), pl.program_id(3)
    i, visited = _visit(kw["blocks"], j, lax.rem(r, ns))

    @pl.when(r == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    def _step():
        q, do = q_ref[...], do_ref[...]
        valid = valid_mask(qseg_ref[...], kvseg_ref[...], i * bq, j * bk, (bq, bk), causal, window)
        s = dot(q, k_ref[...], NT) * jnp.float32(scale)
        dp = dot(do, v_ref[...], NT)
        p_in, ds_in = fm.backward_weights(s, valid, lse_ref[...], dp, delta_ref[...], q_ref.dtype, native)
        dv_sc[...] += dot(p_in, do, TN)
        dk_sc[...] += dot(ds_in, q, TN)

    _when(visited if causal else None, _step)

    @pl.when(r == g * ns - 1)
    def _finalize():
        dk_ref[...] = dk_sc[...] * jnp.float32(scale)
        dv_ref[...] = dv_sc[...]


def _key_steps(tq, tk, mask):
    """(key_blocks of query block i, the most key blocks one query block visits): the trailing grid axis. ``mask``:
    the position rule and the tiles (``causal``, ``window``, ``bq``, ``bk``)."""
    blocks = functools.partial(key_blocks, nk=tk // mask["bk"], **mask)
    return blocks, widest(blocks, tq // mask["bq"])


def forward_call(mode, *, shape, g, tk, o_dtype, options, bq, bk):
    """``pallas_call`` of the forward on (q, k, v, q_seg [B, Tq, 1], kv_seg [B, 1, Tk]) -> (O, lse [B, H, Tq, 1]).

    Args:
      mode: "mosaic" or "interpret".
      shape: q's shape (B, H, Tq, D).
      g: query heads per kv head.
      tk: key length.
      o_dtype: dtype of O.
      options: the :class:`~lpt.kernels.flash_attention.options.FlashOptions` (its policy, position rule and
        scale; its blocks are not read: ``bq``, ``bk`` are).
      bq, bk: the tiles (:func:`lpt.kernels.flash_attention.tiles.tiles`).
    """
    mask = dict(causal=options.causal, window=options.window, bq=bq, bk=bk)  # the position rule and the blocks
    b, h, tq, d = shape
    blocks, nt = _key_steps(tq, tk, mask)

    def kv_blk(i, t):
        return _visit(blocks, i, t)[0]

    kv_spec = pl.BlockSpec((None, None, bk, d), lambda bi, hi, i, j: (bi, lax.div(hi, g), kv_blk(i, j), 0))
    in_specs = [
        pl.BlockSpec((None, None, bq, d), lambda bi, hi, i, j: (bi, hi, i, 0)),
        kv_spec,
        kv_spec,
        pl.BlockSpec((None, bq, 1), lambda bi, hi, i, j: (bi, i, 0)),
        pl.BlockSpec((None, 1, bk), lambda bi, hi, i, j: (bi, 0, kv_blk(i, j))),
    ]
    out_specs = [
        pl.BlockSpec((None, None, bq, d), lambda bi, hi, i, j: (bi, hi, i, 0)),
        pl.BlockSpec((None, None, bq, 1), lambda bi, hi, i, j: (bi, hi, i, 0)),
    ]
    kernel = functools.partial(
        _fwd_kernel, options=options, nt=nt, blocks=blocks, bq=bq, bk=bk, native=mode == "mosaic"
    )
    return pl.pallas_call(
        kernel,
        grid=(b, h, tq // bq, nt),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32) for _ in range(4)] + [pltpu.VMEM((bq, d), jnp.float32)],
        **call_outputs("fwd", shape=shape, g=g, tk=tk, o_dtype=o_dtype, **mask),
        **dispatch.mode_kwargs(mode, semantics=_SEMANTICS),
    )


def dq_call(mode, *, shape, g, tk, options, bq, bk):
    """``pallas_call`` of dQ on (q, k, v, do, lse, δ [B, H, Tq, 1], q_seg, kv_seg) -> dq f32 [B, H, Tq, D].

    Args:
      mode, shape, g, tk, options, bq, bk: as :func:`forward_call`.
    """
    mask = dict(causal=options.causal, window=options.window, bq=bq, bk=bk)  # the position rule and the blocks
    b, h, tq, d = shape
    blocks, nt = _key_steps(tq, tk, mask)

    def kv_blk(i, t):
        return _visit(blocks, i, t)[0]

    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i, j: (bi, hi, i, 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda bi, hi, i, j: (bi, hi, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda bi, hi, i, j: (bi, lax.div(hi, g), kv_blk(i, j), 0))
    qseg_spec = pl.BlockSpec((None, bq, 1), lambda bi, hi, i, j: (bi, i, 0))
    kvseg_spec = pl.BlockSpec((None, 1, bk), lambda bi, hi, i, j: (bi, 0, kv_blk(i, j)))
    in_specs = backward_in_specs(q_spec, kv_spec, row_spec, qseg_spec, kvseg_spec)
    kernel = functools.partial(_dq_kernel, options=options, nt=nt, blocks=blocks, bq=bq, bk=bk, native=mode == "mosaic")
    return pl.pallas_call(
        kernel,
        grid=(b, h, tq // bq, nt),
        in_specs=in_specs,
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)],
        **call_outputs("dq", shape=shape, g=g, tk=tk, **mask),
        **dispatch.mode_kwargs(mode, semantics=_SEMANTICS),
    )


def dkdv_call(mode, *, shape, g, tk, options, bq, bk):
    """``pallas_call`` of dK/dV on (q, k, v, do, lse, δ, q_seg, kv_seg) with q, do [B, Hkv, G·Tq, D] and lse, δ
    [B, Hkv, G·Tq, 1] -> dk, dv f32 [B, Hkv, Tk, D].

    Args:
      shape: the grouped q's shape (B, Hkv, G·Tq, D).
      mode, g, tk, options, bq, bk: as :func:`forward_call`.
    """
    mask = dict(causal=options.causal, window=options.window, bq=bq, bk=bk)  # the position rule and the blocks
    b, hkv, gtq, d = shape
    tq = gtq // g
    nq, nk = tq // bq, tk // bk
    blocks = functools.partial(query_blocks, nq=nq, **mask)
    ns = widest(blocks, nk)

    def q_blk(j, r):
        return _visit(blocks, j, lax.rem(r, ns))[0]

    def grouped(bi, hk, j, r):  # query block i of query head g = r // ns of kv head hk, in [B, Hkv, G·Tq, ·]
        return (bi, hk, lax.div(r, ns) * nq + q_blk(j, r), 0)

    q_spec = pl.BlockSpec((None, None, bq, d), grouped)
    row_spec = pl.BlockSpec((None, None, bq, 1), grouped)
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda bi, hk, j, r: (bi, hk, j, 0))
    qseg_spec = pl.BlockSpec((None, bq, 1), lambda bi, hk, j, r: (bi, q_blk(j, r), 0))
    kvseg_spec = pl.BlockSpec((None, 1, bk), lambda bi, hk, j, r: (bi, 0, j))
    in_specs = backward_in_specs(q_spec, kv_spec, row_spec, qseg_spec, kvseg_spec)
    kernel = functools.partial(
        _dkdv_kernel, options=options, ns=ns, g=g, blocks=blocks, bq=bq, bk=bk, native=mode == "mosaic"
    )
    return pl.pallas_call(
        kernel,
        grid=(b, hkv, nk, g * ns),
        in_specs=in_specs,
        out_specs=[kv_spec, kv_spec],
        scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, d), jnp.float32)],
        **call_outputs("dkdv", shape=shape, g=g, tk=tk, **mask),
        **dispatch.mode_kwargs(mode, semantics=_SEMANTICS),
    )
