"""The backward of the Mosaic GPU flash attention (Hopper): the dQ kernel and the GQA-native dK/dV kernel, given lse
and δ (FA2). Their structure, memory and register limits are described in :mod:`lpt.kernels.flash_attention.mosaic_gpu`,
which also holds the forward; the pieces both share are in :mod:`lpt.kernels.flash_attention.mosaic_gpu_blocks`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention import mosaic_gpu_blocks as blocks
from lpt.kernels.flash_attention.options import FlashOptions
from lpt.kernels.flash_attention.tiles import check, query_blocks

__all__ = ["backward"]


def _dq_kernel(*refs, options, nq, nk, g, d, bq, bk, segments):
    """dQ of query block i (64 rows) of head h, batch b: dq = scale · Σ_j round(dS_j) K_j over key_blocks(i).

    Operands (q, k, v, do, lse, δ, [q_seg, kv_seg], dq) compiled; the interpreter gets (q, kᵀ, vᵀ, k, do, lse, δ, ...)
    instead: its wgmma cannot transpose, so the Kᵀ and Vᵀ that S = Q Kᵀ and dP = dO Vᵀ read come stored
    transposed."""
    *ins, dq_g = refs
    causal, window, scale, interpret = options.causal, options.window, options.scale, options.interpret
    if interpret:
        q_g, kt_g, vt_g, k_g, do_g, lse_g, delta_g, *segs = ins
        streamed = [kt_g, vt_g, k_g]
    else:
        q_g, k_g, v_g, do_g, lse_g, delta_g, *segs = ins
        streamed = [k_g, v_g]
    native = not interpret  # the hardware RNE convert when compiled; the bit-exact rounding under XLA
    dtype = q_g.dtype
    layout = (lambda x, _: x) if interpret else plgpu.layout_cast
    i, h, b, hk, first, end, rows = blocks._query_program(nq, nk, g, bq, bk, causal, window)
    tiled = blocks._swizzled(d, dtype)

    def with_q(q_s, do_s, lse_s, delta_s, bars, ds_s, qseg_s):
        pairs = [(x.at[b, h, rows], x_s) for x, x_s in ((q_g, q_s), (do_g, do_s), (lse_g, lse_s), (delta_g, delta_s))]
        blocks._copy_in(pairs + ([(segs[0].at[b, rows], qseg_s)] if segments else []), bars)
        lse, delta = blocks._vector(lse_s, 1, interpret), blocks._vector(delta_s, 1, interpret)  # [bq] f32 rows
        q_seg = blocks._vector(qseg_s, 1, interpret) if segments else None  # [bq] int32 rows

        def step(idx, *tiles):
            *tiles, dq = tiles
            if interpret:
                kt_s, vt_s, k_s, *kvseg_s = tiles
            else:
                k_s, v_s, *kvseg_s = tiles
                kt_s, vt_s = k_s.transpose((1, 0)), v_s.transpose((1, 0))
            j = first + idx[0]
            s = blocks._mma(q_s, kt_s, (bq, bk)) * jnp.float32(scale)
            dp = blocks._mma(do_s, vt_s, (bq, bk))
            kv_seg = blocks._vector(kvseg_s[0], 0, interpret) if segments else None  # [bk] int32 columns
            valid = blocks.block_mask(i * bq, j * bk, s.shape, causal, window, interpret)
            valid = blocks.segment_mask(valid, q_seg, kv_seg, s.shape)
            _, ds = fm.backward_weights(s, valid, lse, dp, delta, dtype, native)  # round(dS) in the input dtype
            return blocks._mma_add(dq, blocks._operand(ds, ds_s, interpret), k_s, interpret)

        if interpret:  # kᵀ, vᵀ [D, Tk] and k [Tk, D]
            t_spec = plgpu.BlockSpec((d, bk), lambda t: (0, first + t))
            specs = [t_spec, t_spec, plgpu.BlockSpec((bk, d), lambda t: (first + t, 0))]
        else:
            specs = [plgpu.BlockSpec((bk, d), lambda t: (first + t, 0), transforms=tiled)] * 2
        operands = [x.at[b, hk] for x in streamed]
        if segments:
            specs.append(plgpu.BlockSpec((bk,), lambda t: (first + t,)))
            operands.append(segs[1].at[b])
        dq = plgpu.emit_pipeline(
            step,
            grid=(end - first,),  # traced when causal: the range of key_blocks(i)
            in_specs=specs,
            max_concurrent_steps=blocks.STAGES,
            init_carry=layout(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA),
        )(*operands)
        dq = dq * jnp.float32(scale)

        def epilogue(dq_s):
            dq_s[...] = dq
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dq_s, dq_g.at[b, h, rows])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(epilogue, plgpu.SMEM((bq, d), jnp.float32))

    pl.run_scoped(
        with_q,
        plgpu.SMEM((bq, d), dtype, transforms=tiled),
        plgpu.SMEM((bq, d), dtype, transforms=tiled),
        plgpu.SMEM((bq,), jnp.float32),
        plgpu.SMEM((bq,), jnp.float32),
        plgpu.Barrier(num_barriers=4 + segments),
        plgpu.SMEM((bq, bk), dtype) if interpret else None,
        plgpu.SMEM((bq,), jnp.int32) if segments else None,
    )


def _dkdv_kernel(*refs, options, tq, g, d, bq, bk, segments):
    """dK, dV of key block j (``bk`` = 64 rows) of kv head hk, batch b, summed over the G query heads of hk and the
    query blocks of query_blocks(j) (``bq`` rows each), with keys as rows (Sᵀ = K Qᵀ, the tiles' M = 64):

        Pᵀ, dSᵀ = backward_weights(Sᵀ, lse, dPᵀ = V dOᵀ, δ)   lse and δ broadcast along the key rows
        dv += round(Pᵀ) dO;  dk += round(dSᵀ) Q;  dk ·= scale after the last block

    q, do [B, Hkv, G·Tq, D] and lse, δ [B, Hkv, G·Tq] (a free reshape of [B, H, Tq, ·]): query head gi of the group
    reads rows gi·Tq …; query segments [B, Tq] are the same for every head. Operands (q, k, v, do, lse, δ, [q_seg,
    kv_seg], dk, dv) compiled; the interpreter gets (q, qᵀ, k, v, do, doᵀ, lse, δ, ...): its wgmma cannot transpose,
    so the Qᵀ and dOᵀ that Sᵀ and dPᵀ read come stored transposed."""
    *ins, dk_g, dv_g = refs
    causal, window, scale, interpret = options.causal, options.window, options.scale, options.interpret
    if interpret:
        q_g, qt_g, k_g, v_g, do_g, dot_g, lse_g, delta_g, *segs = ins
        streamed = [q_g, do_g, lse_g, delta_g, qt_g, dot_g]
    else:
        q_g, k_g, v_g, do_g, lse_g, delta_g, *segs = ins
        streamed = [q_g, do_g, lse_g, delta_g]
    native = not interpret
    dtype = q_g.dtype
    layout = (lambda x, _: x) if interpret else plgpu.layout_cast
    j = lax.axis_index("k")  # first key block first: causal, the key blocks with the longest ranges start first
    hk, b = lax.axis_index("h"), lax.axis_index("b")
    nq = tq // bq
    lo, hi = query_blocks(j, bq=bq, bk=bk, nq=nq, causal=causal, window=window)
    n_i = hi - lo  # query blocks per query head
    keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
    tiled = blocks._swizzled(d, dtype)

    def block(t):  # pipeline step t: query head gi = t // n_i of the group (outer), query block lo + t % n_i (inner)
        return lax.div(t, n_i) * nq + lo + lax.rem(t, n_i)

    def with_kv(k_s, v_s, bars, w_s, kvseg_s):
        pairs = [(k_g.at[b, hk, keys], k_s), (v_g.at[b, hk, keys], v_s)]
        blocks._copy_in(pairs + ([(segs[1].at[b, keys], kvseg_s)] if segments else []), bars)
        kv_seg = blocks._vector(kvseg_s, 1, interpret) if segments else None  # [bk] int32 rows

        def step(idx, *tiles):
            *tiles, (dk, dv) = tiles
            if interpret:
                q_s, do_s, lse_s, delta_s, qt_s, dot_s, *qseg_s = tiles
            else:
                q_s, do_s, lse_s, delta_s, *qseg_s = tiles
                qt_s, dot_s = q_s.transpose((1, 0)), do_s.transpose((1, 0))
            i = lo + lax.rem(idx[0], n_i)
            st = blocks._mma(k_s, qt_s, (bk, bq)) * jnp.float32(scale)  # Sᵀ [bk, bq] f32
            dpt = blocks._mma(v_s, dot_s, (bk, bq))  # dPᵀ [bk, bq] f32
            lse, delta = (
                lax.broadcast_in_dim(blocks._vector(r, 0, interpret), st.shape, (1,)) for r in (lse_s, delta_s)
            )
            q_seg = blocks._vector(qseg_s[0], 0, interpret) if segments else None  # [bq] int32 columns
            valid = blocks.block_mask(i * bq, j * bk, st.shape, causal, window, interpret, keys_first=True)
            valid = blocks.segment_mask(valid, q_seg, kv_seg, st.shape, keys_first=True)
            pt, dst = fm.backward_weights(st, valid, lse, dpt, delta, dtype, native)  # round(Pᵀ), round(dSᵀ)
            dv = blocks._mma_add(dv, blocks._operand(pt, w_s, interpret), do_s, interpret)
            dk = blocks._mma_add(dk, blocks._operand(dst, w_s, interpret), q_s, interpret)
            return dk, dv

        q_spec = plgpu.BlockSpec((bq, d), lambda t: (block(t), 0), transforms=() if interpret else tiled)
        row_spec = plgpu.BlockSpec((bq,), lambda t: (block(t),))
        specs = [q_spec, q_spec, row_spec, row_spec]
        if interpret:  # qᵀ, doᵀ [D, G·Tq]
            specs += [plgpu.BlockSpec((d, bq), lambda t: (0, block(t)))] * 2
        operands = [x.at[b, hk] for x in streamed]
        if segments:  # the query segments of block lo + t % n_i, whichever head
            specs.append(plgpu.BlockSpec((bq,), lambda t: (lo + lax.rem(t, n_i),)))
            operands.append(segs[0].at[b])
        zeros = layout(jnp.zeros((bk, d), jnp.float32), plgpu.Layout.WGMMA)
        dk, dv = plgpu.emit_pipeline(
            step,
            grid=(g * n_i,),  # traced when causal: G heads × the range of query_blocks(j)
            in_specs=specs,
            max_concurrent_steps=blocks.STAGES,
            init_carry=(zeros, zeros),
        )(*operands)
        dk = dk * jnp.float32(scale)

        def epilogue(dk_s, dv_s):
            dk_s[...] = dk
            dv_s[...] = dv
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dk_s, dk_g.at[b, hk, keys])
            plgpu.copy_smem_to_gmem(dv_s, dv_g.at[b, hk, keys])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(epilogue, plgpu.SMEM((bk, d), jnp.float32), plgpu.SMEM((bk, d), jnp.float32))

    pl.run_scoped(
        with_kv,
        plgpu.SMEM((bk, d), dtype, transforms=tiled),
        plgpu.SMEM((bk, d), dtype, transforms=tiled),
        plgpu.Barrier(num_barriers=2 + segments),
        plgpu.SMEM((bk, bq), dtype) if interpret else None,
        plgpu.SMEM((bk,), jnp.int32) if segments else None,
    )


def _validate_backward(q, k, v, q_seg, kv_seg, lse, do, delta, options) -> int:
    blocks._validate_common(q, k, v, q_seg, kv_seg, options)
    block_q, block_k, causal, window = options.block_q, options.block_k, options.causal, options.window
    b, h, tq, d = q.shape
    if do.shape != q.shape or do.dtype != q.dtype or lse.shape != (b, h, tq) or delta.shape != (b, h, tq):
        raise ValueError(
            f"need do like q {q.shape} {q.dtype} and lse, delta [B, H, Tq] = {(b, h, tq)}; got do {do.shape} "
            f"{do.dtype}, lse {lse.shape}, delta {delta.shape}"
        )
    if lse.dtype != jnp.float32 or delta.dtype != jnp.float32:
        raise ValueError(f"lse and delta must be float32, got {lse.dtype}, {delta.dtype}")
    if d not in blocks.BACKWARD_HEAD_DIMS:
        raise ValueError(
            f"head dim D={d} is not supported by the Mosaic GPU backward; allowed: {blocks.BACKWARD_HEAD_DIMS} "
            f"(its dK/dV warpgroup holds dk and dv [64, D] f32, {d} registers per thread, beside the [64, block_k] "
            "tiles of one step: ptxas spills above D = 128)"
        )
    if d * block_k > blocks.BACKWARD_TILE_LIMIT:
        raise ValueError(
            f"D={d} with block_k={block_k} is not supported by the Mosaic GPU backward: its [64, block_k] f32 tiles "
            f"beside the [64, D] accumulators exceed a warpgroup's 255 registers per thread (ptxas spills); use "
            f"block_k={blocks.BLOCK_KS[0]}"
        )
    check(q, k, block_k, block_q, causal, window)  # the dK/dV kernel's roles: key blocks of block_q rows
    return check(q, k, block_q, block_k, causal, window)


def backward(q, k, v, q_seg, kv_seg, lse, do, delta, *, options: FlashOptions):
    """The Mosaic GPU (Hopper) flash-attention backward, as :func:`lpt.kernels.flash_attention.kernel.backward`:
    given lse and δ = rowsum(dO ∘ O_residual) [B, H, Tq] f32, returns f32 (dq [B, H, Tq, D], dk, dv [B, Hkv, Tk,
    D]); the policy enters through lse (its forward) and δ (its residual). Two kernels: dQ, one CTA per (query block
    of ``block_q`` rows, head, batch) over the key blocks of ``key_blocks`` in steps of ``block_k`` keys; dK/dV, one
    CTA per (key block of ``block_q`` rows, kv head, batch) over the G query heads of the kv head and the query blocks
    of ``query_blocks`` in steps of ``block_k`` queries (GQA-native: no [B, H, Tk, D] buffer).

    Args:
      q, k, v, q_seg, kv_seg: as :func:`lpt.kernels.flash_attention.mosaic_gpu.forward`; D in
        :data:`~lpt.kernels.flash_attention.mosaic_gpu_blocks.BACKWARD_HEAD_DIMS`.
      lse, delta: [B, H, Tq] f32: the forward's logsumexp and δ = rowsum(dO ∘ O_residual).
      do: [B, H, Tq, D] in q's dtype, the output's gradient.
      options: as :func:`lpt.kernels.flash_attention.mosaic_gpu.forward` (its policy is not read), with
        ``block_q`` 64 and ``block_k`` 64 or 128 with D · block_k <= 8192 (registers); Tq and Tk multiples of both.
    """
    g = _validate_backward(q, k, v, q_seg, kv_seg, lse, do, delta, options)
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    block_q, block_k, interpret = options.block_q, options.block_k, options.interpret
    segments = q_seg is not None
    segs = (q_seg, kv_seg) if segments else ()
    common = dict(options=options, g=g, d=d, segments=segments)
    params = blocks.interpret_params() if interpret else None
    dq_kernel = functools.partial(_dq_kernel, nq=tq // block_q, nk=tk // block_k, bq=block_q, bk=block_k, **common)
    if interpret:  # the interpreter's wgmma takes Kᵀ, Vᵀ as stored
        dq_args = (q, jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3), k, do, lse, delta, *segs)
    else:
        dq_args = (q, k, v, do, lse, delta, *segs)
    dq = plgpu.kernel(
        dq_kernel,
        out_type=jax.ShapeDtypeStruct((b, h, tq, d), jnp.float32),
        grid=(tq // block_q, h, b),
        grid_names=("q", "h", "b"),
        kernel_name="lpt_flash_attention_dq_mgpu",
        interpret=params,
    )(*dq_args)

    def grouped(x):  # [B, H, Tq, ...] -> [B, Hkv, G·Tq, ...] (free: query heads of one kv head are adjacent)
        return x.reshape(b, hkv, g * tq, *x.shape[3:])

    qg, dog, lse_g, delta_g = map(grouped, (q, do, lse, delta))
    dkdv_kernel = functools.partial(_dkdv_kernel, tq=tq, bq=block_k, bk=block_q, **common)
    if interpret:  # the interpreter's wgmma takes Qᵀ, dOᵀ as stored
        dkdv_args = (qg, jnp.swapaxes(qg, 2, 3), k, v, dog, jnp.swapaxes(dog, 2, 3), lse_g, delta_g, *segs)
    else:
        dkdv_args = (qg, k, v, dog, lse_g, delta_g, *segs)
    out = jax.ShapeDtypeStruct((b, hkv, tk, d), jnp.float32)
    dk, dv = plgpu.kernel(
        dkdv_kernel,
        out_type=(out, out),
        grid=(tk // block_q, hkv, b),
        grid_names=("k", "h", "b"),
        kernel_name="lpt_flash_attention_dkdv_mgpu",
        interpret=params,
    )(*dkdv_args)
    return dq, dk, dv
