"""Pallas flash attention (FA2 forward with saved logsumexp, FA2 backward) with the lpt numerics policy.

XLA twin: :mod:`lpt.kernels.flash_attention_reference` (same recurrence, same key-block order); the per-block rules
(shift rule, repeat count across blocks, masking, rounding of P̃, where ℓ comes from) are the functions of
:mod:`lpt.kernels.flash_attention_math`, called from both.

Layout: q [B, H, Tq, D]; k, v [B, Hkv, Tk, D] (GQA: query head h reads kv head h // (H/Hkv)); q_seg [B, Tq],
kv_seg [B, Tk] int32 (query i attends key j iff segments match and, if causal, j <= i); Tq, Tk multiples of the
blocks. Grids:

* forward ``(B, H, Tq/bq)``: one query block per program; a ``fori_loop`` over key blocks (causal: only up to
  the diagonal) runs the online softmax; writes O (f32, or bf16 for the "input" residual) and
  lse = c + log ℓ (f32, −inf for rows without keys).
* backward dK/dV ``(B, H, Tk/bk)``: per query head, loop over query blocks from the diagonal; the wrapper sums the
  per-query-head dK, dV over each group. Backward dQ ``(B, H, Tq/bq)``: loop over key blocks. δ comes in from the
  caller (it is where the residual policy acts).

Row vectors (lse, δ, q_seg) travel as [.., T, 1] and kv_seg as [B, 1, Tk] so that every block's last two dims are
TPU-legal. Platform: ``interpret=True`` interprets everywhere; ``interpret=None`` interprets on CPU and compiles
with Triton on cuda and Mosaic on tpu, chosen by ``jax.lax.platform_dependent``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from lpt.kernels import flash_attention_math as fm

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _dot(a, b, dims=None):
    if dims is None:
        return jnp.dot(a, b, preferred_element_type=jnp.float32)
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _valid(q_seg, kv_seg, q_start, k_start, shape, causal: bool):
    """[bq, bk] attend mask from q_seg [bq, 1], kv_seg [1, bk] and block offsets."""
    ok = q_seg == kv_seg
    if causal:
        q_pos = q_start + lax.broadcasted_iota(jnp.int32, shape, 0)
        k_pos = k_start + lax.broadcasted_iota(jnp.int32, shape, 1)
        ok = ok & (k_pos <= q_pos)
    return ok


def _fwd_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, o_ref, lse_ref, *, policy, causal, scale, bq, bk, native):
    i = pl.program_id(2)
    q = q_ref[...]
    q_seg = qseg_ref[...]
    pv_dtype = policy.pv(v_ref.dtype)
    nk = k_ref.shape[0] // bk
    hi = jnp.minimum(nk, lax.div((i + 1) * bq + bk - 1, bk)) if causal else nk  # ceil; lax.div: no sign op

    def body(j, carry):
        m, n, c, l, acc = carry
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        valid = _valid(q_seg, kvseg_ref[:, pl.ds(start, bk)], i * bq, start, (bq, bk), causal)
        s = _dot(q, k, _NT) * jnp.float32(scale)
        m_new, n_new = fm.update_max_count(m, n, s, valid, policy.tie_tol)
        c_new = fm.shift_of(m_new, n_new, policy)
        alpha = fm.rescale(c, c_new, m, policy, pv_dtype, native)
        p = fm.probs(s, valid, c_new)
        p_pv = fm.round_to(p, pv_dtype, native)
        p_sum = p_pv.astype(jnp.float32) if policy.denominator == "rounded" else p  # pv dtype -> f32, exact
        v_pv = fm.round_to(v.astype(jnp.float32), pv_dtype, native)  # v dtype -> f32 -> pv dtype
        if policy.accumulator == "split":  # large and small weights in separate matmuls, summed once
            p_big, p_small = fm.split_weights(p_pv, s, m_new, policy)
            sum_big, sum_small = fm.split_weights(p_sum, s, m_new, policy)
            pv = _dot(p_big, v_pv) + _dot(p_small, v_pv)
            p_rowsum = jnp.sum(sum_big, axis=-1, keepdims=True) + jnp.sum(sum_small, axis=-1, keepdims=True)
        else:
            pv = _dot(p_pv, v_pv)
            p_rowsum = jnp.sum(p_sum, axis=-1, keepdims=True)
        l_new = alpha * l + p_rowsum
        if policy.accumulator == "pv":
            acc_new = fm.round_grid_f32(
                fm.round_grid_f32(alpha * acc, pv_dtype, native) + fm.round_grid_f32(pv, pv_dtype, native),
                pv_dtype,
                native,
            )
        else:
            acc_new = alpha * acc + pv
        return m_new, n_new, c_new, l_new, acc_new

    col = jnp.zeros((bq, 1), jnp.float32)
    init = (col - jnp.inf, col, col, col, jnp.zeros(q.shape, jnp.float32))
    _, _, c, l, acc = lax.fori_loop(0, hi, body, init)
    o, lse = fm.finalize(acc, l, c)
    o_ref[...] = fm.round_to(o, o_ref.dtype, native)  # f32 -> O dtype (bf16 for residual "input")
    lse_ref[...] = lse


def _dkdv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qseg_ref,
    kvseg_ref,
    dk_ref,
    dv_ref,
    *,
    causal,
    scale,
    bq,
    bk,
    native,
):
    j = pl.program_id(2)
    k = k_ref[...]
    v = v_ref[...]
    kv_seg = kvseg_ref[...]
    in_dtype = q_ref.dtype
    nq = q_ref.shape[0] // bq
    lo = lax.div(j * bk, bq) if causal else 0  # positive operands: lax.div == floor

    def body(i, carry):
        dk, dv = carry
        start = pl.multiple_of(i * bq, bq)
        q = q_ref[pl.ds(start, bq), :]
        do = do_ref[pl.ds(start, bq), :]
        valid = _valid(qseg_ref[pl.ds(start, bq), :], kv_seg, start, j * bk, (bq, bk), causal)
        s = _dot(q, k, _NT) * jnp.float32(scale)
        p = fm.probs(s, valid, lse_ref[pl.ds(start, bq), :])
        dv = dv + _dot(fm.round_to(p, in_dtype, native), do, _TN)
        dp = _dot(do, v, _NT)
        ds = p * (dp - delta_ref[pl.ds(start, bq), :])
        dk = dk + _dot(fm.round_to(ds, in_dtype, native), q, _TN)
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(lo, nq, body, (zeros, zeros))
    dk_ref[...] = dk * jnp.float32(scale)
    dv_ref[...] = dv


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref, dq_ref, *, causal, scale, bq, bk, native
):
    i = pl.program_id(2)
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    q_seg = qseg_ref[...]
    in_dtype = q_ref.dtype
    nk = k_ref.shape[0] // bk
    hi = jnp.minimum(nk, lax.div((i + 1) * bq + bk - 1, bk)) if causal else nk  # ceil; lax.div: no sign op

    def body(j, dq):
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        valid = _valid(q_seg, kvseg_ref[:, pl.ds(start, bk)], i * bq, start, (bq, bk), causal)
        s = _dot(q, k, _NT) * jnp.float32(scale)
        p = fm.probs(s, valid, lse)
        ds = p * (_dot(do, v, _NT) - delta)
        return dq + _dot(fm.round_to(ds, in_dtype, native), k)

    dq = lax.fori_loop(0, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq * jnp.float32(scale)


def _run(build, args, interpret):
    """Run ``build(mode)(*args)``: interpreted if asked, else per platform via ``lax.platform_dependent``."""
    if interpret:
        return build("interpret")(*args)
    return lax.platform_dependent(*args, cpu=build("interpret"), cuda=build("triton"), tpu=build("mosaic"))


def _mode_kwargs(mode: str, grid_rank: int) -> dict:
    if mode == "interpret":
        return {"interpret": True}
    if mode == "triton":
        return {"compiler_params": pltriton.CompilerParams(num_warps=4, num_stages=2)}
    return {"compiler_params": pltpu.CompilerParams(dimension_semantics=("parallel",) * grid_rank)}


def _check(q, k, block_q, block_k):
    tq, tk, h, hkv = q.shape[2], k.shape[2], q.shape[1], k.shape[1]
    if tq % block_q or tk % block_k or h % hkv:
        raise ValueError(
            f"need Tq % block_q == 0, Tk % block_k == 0, H % Hkv == 0; got Tq={tq}, block_q={block_q}, "
            f"Tk={tk}, block_k={block_k}, H={h}, Hkv={hkv}"
        )
    return h // hkv


def flash_forward(q, k, v, q_seg, kv_seg, *, policy, causal, scale, block_q, block_k, interpret=None):
    """Forward kernel. Returns (O [B, H, Tq, D], lse f32 [B, H, Tq]); O is f32, or already rounded to nearest in
    q's dtype when ``policy.residual == "input"`` (the wrapper's rounding is then exact)."""
    b, h, tq, d = q.shape
    tk = k.shape[2]
    g = _check(q, k, block_q, block_k)
    kernel = functools.partial(_fwd_kernel, policy=policy, causal=causal, scale=scale, bq=block_q, bk=block_k)
    in_specs = [
        pl.BlockSpec((None, None, block_q, d), lambda bi, hi, i: (bi, hi, i, 0)),
        pl.BlockSpec((None, None, tk, d), lambda bi, hi, i: (bi, lax.div(hi, g), 0, 0)),
        pl.BlockSpec((None, None, tk, d), lambda bi, hi, i: (bi, lax.div(hi, g), 0, 0)),
        pl.BlockSpec((None, block_q, 1), lambda bi, hi, i: (bi, i, 0)),
        pl.BlockSpec((None, 1, tk), lambda bi, hi, i: (bi, 0, 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, None, block_q, d), lambda bi, hi, i: (bi, hi, i, 0)),
        pl.BlockSpec((None, None, block_q, 1), lambda bi, hi, i: (bi, hi, i, 0)),
    ]
    o_dtype = q.dtype if policy.residual == "input" else jnp.float32  # bf16 O halves the write when it suffices
    out_shape = [jax.ShapeDtypeStruct((b, h, tq, d), o_dtype), jax.ShapeDtypeStruct((b, h, tq, 1), jnp.float32)]

    def build(mode):
        return pl.pallas_call(
            functools.partial(kernel, native=mode == "mosaic"),
            grid=(b, h, tq // block_q),
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            name="lpt_flash_attention_fwd",
            **_mode_kwargs(mode, 3),
        )

    args = (q, k, v, q_seg[:, :, None], kv_seg[:, None, :])
    o, lse = _run(build, args, interpret)
    return o, lse[..., 0]


def flash_backward(q, k, v, q_seg, kv_seg, lse, do, delta, *, causal, scale, block_q, block_k, interpret=None):
    """Backward kernels given lse, δ [B, H, Tq] f32. Returns f32 (dq [B,H,Tq,D], dk, dv [B,Hkv,Tk,D])."""
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    g = _check(q, k, block_q, block_k)
    kw = dict(causal=causal, scale=scale, bq=block_q, bk=block_k)
    args = (q, k, v, do, lse[..., None], delta[..., None], q_seg[:, :, None], kv_seg[:, None, :])
    full_q = pl.BlockSpec((None, None, tq, d), lambda bi, hi, j: (bi, hi, 0, 0))
    full_row = pl.BlockSpec((None, None, tq, 1), lambda bi, hi, j: (bi, hi, 0, 0))
    kv_blk = pl.BlockSpec((None, None, block_k, d), lambda bi, hi, j: (bi, lax.div(hi, g), j, 0))
    dkdv_specs = [
        full_q,
        kv_blk,
        kv_blk,
        full_q,
        full_row,
        full_row,
        pl.BlockSpec((None, tq, 1), lambda bi, hi, j: (bi, 0, 0)),
        pl.BlockSpec((None, 1, block_k), lambda bi, hi, j: (bi, 0, j)),
    ]
    dkdv_out = pl.BlockSpec((None, None, block_k, d), lambda bi, hi, j: (bi, hi, j, 0))
    dkdv_shape = jax.ShapeDtypeStruct((b, h, tk, d), jnp.float32)

    def build_dkdv(mode):
        return pl.pallas_call(
            functools.partial(_dkdv_kernel, native=mode == "mosaic", **kw),
            grid=(b, h, tk // block_k),
            in_specs=dkdv_specs,
            out_specs=[dkdv_out, dkdv_out],
            out_shape=[dkdv_shape, dkdv_shape],
            name="lpt_flash_attention_dkdv",
            **_mode_kwargs(mode, 3),
        )

    q_blk = pl.BlockSpec((None, None, block_q, d), lambda bi, hi, i: (bi, hi, i, 0))
    row_blk = pl.BlockSpec((None, None, block_q, 1), lambda bi, hi, i: (bi, hi, i, 0))
    full_kv = pl.BlockSpec((None, None, tk, d), lambda bi, hi, i: (bi, lax.div(hi, g), 0, 0))
    dq_specs = [
        q_blk,
        full_kv,
        full_kv,
        q_blk,
        row_blk,
        row_blk,
        pl.BlockSpec((None, block_q, 1), lambda bi, hi, i: (bi, i, 0)),
        pl.BlockSpec((None, 1, tk), lambda bi, hi, i: (bi, 0, 0)),
    ]

    def build_dq(mode):
        return pl.pallas_call(
            functools.partial(_dq_kernel, native=mode == "mosaic", **kw),
            grid=(b, h, tq // block_q),
            in_specs=dq_specs,
            out_specs=q_blk,
            out_shape=jax.ShapeDtypeStruct((b, h, tq, d), jnp.float32),
            name="lpt_flash_attention_dq",
            **_mode_kwargs(mode, 3),
        )

    dk_h, dv_h = _run(build_dkdv, args, interpret)
    dq = _run(build_dq, args, interpret)
    dk = dk_h.reshape(b, hkv, g, tk, d).sum(axis=2)
    dv = dv_h.reshape(b, hkv, g, tk, d).sum(axis=2)
    return dq, dk, dv
