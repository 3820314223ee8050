"""Hopper variant of flash attention, forward and backward: Mosaic GPU, TMA pipelines into shared memory, wgmma.

This module holds the forward and exports both entry points; the backward's kernels are in
:mod:`lpt.kernels.flash_attention.mosaic_gpu_backward`, and what the two share (tile sizes, shared memory per CTA,
masks, copies, wgmma helpers, checks) in :mod:`lpt.kernels.flash_attention.mosaic_gpu_blocks`.

Computes what :func:`lpt.kernels.flash_attention.kernel.forward` and
:func:`~lpt.kernels.flash_attention.kernel.backward` compute (XLA twin: :mod:`lpt.kernels.flash_attention.reference`),
for every policy whose P̃V operands are in the input dtype (the stable and the standard one included), with GQA,
causal / full / sliding-window / cross attention and optional segment ids (packing; padding as ids that match
nothing): the same per-block rules of
:mod:`lpt.kernels.flash_attention.math` in the same key-block order, over the blocks of
:func:`lpt.kernels.flash_attention.tiles.key_blocks` / :func:`~lpt.kernels.flash_attention.tiles.query_blocks`, so a
sliding window makes work and fetches O(T·w). Forward::

    grid (Tq/64, H, B); one CTA = one warpgroup (128 threads) = query block i (64 rows) of head h, batch b;
    Mosaic GPU launches the last grid axis fastest (CUDA's x = B, y = H, z = Tq/64), so the CTAs of one query
    block (every batch and head; the G heads that read one kv head side by side) run together, and query blocks
    run last to first: the causal blocks with the most key blocks start first
    Q [64, D] (q_seg [64]) -> SMEM                      TMA copies
    for j in key_blocks(i):                             causal: up to the diagonal; sliding window: from its first
        K_j, V_j [bk, D] (kv_seg [bk]) -> SMEM          plgpu.emit_pipeline, 2 slots: the TMA copies of block j + 1
                                                        are in flight while block j computes
        S = wgmma(Q, K_jᵀ) · scale                      f32, registers (WGMMA layout), a fresh accumulator
        online-softmax step of math.py on rows [64]     max and near-max count, shift rule, α, P̄, P̃ (input dtype),
                                                        ℓ from P̃ or P̄, the split of large and small weights
        P̃V = wgmma(P̃, V_j)                             P̃ from registers, into a fresh f32 accumulator (two with
        acc = α·acc + P̃V                                the split accumulation: P̃_big V + P̃_small V)
    O = acc / ℓ, lse = c + log ℓ -> SMEM -> GMEM        TMA; O in f32, or rounded to the input dtype (RNE) when
                                                        policy.residual == "input"; lse f32 [B, H, Tq]

Backward (FA2, given lse and δ; the policy enters only through them), two kernels of one warpgroup per CTA:

    dQ: grid (Tq/64, H, B), query block i of head h    Q, dO [64, D], lse, δ (q_seg) [64] -> SMEM once
    for j in key_blocks(i):                             K_j, V_j [bk, D] (kv_seg) pipelined, 2 slots
        S = wgmma(Q, K_jᵀ)·scale, dP = wgmma(dO, V_jᵀ)
        _, round(dS) = math.backward_weights(S, lse, dP, δ)          rows [64] as in the forward
        dq += wgmma(round(dS), K_j)                     accumulating into dq's registers (ACC.init)
    dq · scale -> SMEM -> GMEM (f32)

    dK/dV: grid (Tk/64, Hkv, B), key block j of kv head hk   K_j, V_j [64, D] (kv_seg) -> SMEM once
    for gi in the G query heads of hk, i in query_blocks(j):  Q_i, dO_i [bq, D], lse, δ (q_seg) [bq] pipelined
        Sᵀ = wgmma(K_j, Q_iᵀ)·scale, dPᵀ = wgmma(V_j, dO_iᵀ)      keys as rows: the tiles' M = 64
        round(Pᵀ), round(dSᵀ) = math.backward_weights(Sᵀ, lse, dPᵀ, δ)   lse, δ broadcast along the key rows
        dv += wgmma(round(Pᵀ), dO_i); dk += wgmma(round(dSᵀ), Q_i)
    dk · scale, dv -> SMEM -> GMEM (f32 [B, Hkv, Tk, D])

dK/dV is GQA-native: q, dO, lse, δ enter as [B, Hkv, G·Tq, ·] (a free reshape) and no [B, H, Tk, D] buffer exists.

Memory per CTA is O(block), independent of T (:func:`smem_bytes`, :func:`dq_smem_bytes`, :func:`dkdv_smem_bytes`;
Mosaic GPU rounds each allocation up to 1 KiB): the resident blocks, the pipeline's two slots and, once the pipeline
has released them, the epilogue's tiles, plus the barriers and (the forward's reductions) a 2 KiB reduction scratch;
bf16, D = 128, bk = 64: forward 83,992 bytes, dQ 100,400, dK/dV 100,384 (with segment ids 86,048 / 102,456 /
102,440) of the 232,448 an H100 block may use. Registers decide the backward's limits: the dK/dV warpgroup holds
dk, dv [64, D] f32 (D registers per thread) beside one step's [64, bk] f32 tiles, within 255 per thread; ptxas
(deviceless, sm_90a) spills at D = 128 with bk = 128 (992 bytes; the dQ kernel 44) and at D = 256 (1,544 bytes), so
the backward takes D ∈ :data:`BACKWARD_HEAD_DIMS` and D·bk <= 8192 (ValueError otherwise); the supported ones compile
without spills (dK/dV 255 registers at D = 128, bk = 64, dQ 199). Accumulating into a fresh wgmma accumulator and
adding it to dk / dv, as the forward does for P̃V, spilled 380 bytes at D = 128, bk = 64: the backward accumulates
in place. The forward at D = 128 spills at bk = 128 (208 bytes, stable policy) and, with segment ids, 16 bytes at
bk = 64.

Rows. Mosaic GPU keeps a [64, bk] tile in the WGMMA layout (64×8 tiles) and a row statistic as a [64] vector (that
layout reduced over columns); it cannot hold a [64, 1] array. math.py's rules take either layout
(:func:`lpt.kernels.flash_attention.math.wide`), so the kernels call ``forward_step``, ``finalize`` and
``backward_weights`` themselves; a test asserts the carry on rows equals the carry on columns bit for bit under XLA.
The dK/dV kernel's tiles have keys as rows, so it broadcasts lse and δ to full tiles (which ``wide`` passes through).
Segment ids are [64] / [bk] int32 vectors in the layouts of the tile's rows and columns (:func:`segment_mask`).

``interpret=True`` runs the Mosaic GPU interpreter on CPU (jax 0.10.2). Differences, none numeric: the interpreter
cannot apply a transposed reference (``ref.transpose``) inside wgmma nor take a wgmma operand from registers nor run
``run_state``, so there the operands read transposed come stored transposed (forward: Kᵀ [B, Hkv, D, Tk]; dQ: Kᵀ, Vᵀ
beside K; dK/dV: Qᵀ, dOᵀ beside Q, dO), a wgmma operand from registers (P̃, round(dS), round(Pᵀ), round(dSᵀ)) is stored
to an SMEM tile first, and the backward's wgmma accumulates into a fresh accumulator added to dq / dk / dv (the twin
adds per block the same way; on the GPU the tensor core adds into the accumulator in its own order); layout casts are
skipped (they only annotate layouts); roundings use lpt.numerics' bit-exact rounding (``native=False``: XLA may drop an
f32 -> bf16 -> f32 pair) where the compiled kernels use the hardware's RNE convert. Everything else (grids, block
ranges, pipelines, wgmma, per-block rules, epilogues) is the code that runs on the GPU. ``interpret=False`` lowers for
CUDA only (custom call ``mosaic_gpu_v2``). It cannot be chosen by ``lax.platform_dependent``: with the interpreter as
the cpu branch, lowering for CUDA fails ("Lowering rule for `cond` returns incorrect set of output tokens": the
interpreter's ordered IO effect), as for lpt's FP8 wgmma kernel; pass ``interpret=True`` explicitly on CPU.

A warp-specialized forward (a TMA producer warpgroup and two consumer warpgroups, as FlashAttention-3 and jax's
``attention_mgpu.py``) is :func:`lpt.kernels.flash_attention.mosaic_gpu_ws.forward`; its consumers run this kernel's
per-block code (:func:`~lpt.kernels.flash_attention.mosaic_gpu_blocks.forward_block`). Not in this slice: a
warp-specialized backward, which would also give the dK/dV kernel a second warpgroup's registers (D = 256,
bk = 128); an unmasked fast path for the
blocks below the diagonal, and skipping blocks that segment ids mask entirely; a ``pv_dtype`` other than the input
dtype (wgmma reads V from SMEM as stored: ValueError); the wiring into ``kernel.py``. ``lpt.attention`` runs these
kernels as ``dot_product_attention(impl="mosaic_gpu")``. Not run on GPU hardware.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention import mosaic_gpu_blocks as blocks
from lpt.kernels.flash_attention.mosaic_gpu_backward import backward
from lpt.kernels.flash_attention.mosaic_gpu_blocks import (
    BACKWARD_HEAD_DIMS,
    BACKWARD_TILE_LIMIT,
    BLOCK_KS,
    BLOCK_Q,
    HEAD_DIMS,
    SMEM_LIMIT,
    STAGES,
    dkdv_smem_bytes,
    dq_smem_bytes,
    smem_bytes,
)
from lpt.kernels.flash_attention.options import FlashOptions
from lpt.kernels.flash_attention.tiles import check

__all__ = [
    "BACKWARD_HEAD_DIMS",
    "BACKWARD_TILE_LIMIT",
    "BLOCK_KS",
    "BLOCK_Q",
    "HEAD_DIMS",
    "SMEM_LIMIT",
    "STAGES",
    "backward",
    "dkdv_smem_bytes",
    "dq_smem_bytes",
    "forward",
    "smem_bytes",
]


def _kernel(*refs, options, nq, nk, g, d, segments):
    q_g, k_g, v_g, *segs, o_g, lse_g = refs  # segs: (q_seg [B, Tq], kv_seg [B, Tk]) or ()
    interpret, bq, bk = options.interpret, options.block_q, options.block_k
    native = not interpret  # the hardware RNE convert when compiled; the bit-exact rounding under XLA
    dtype = q_g.dtype
    pv_dtype = options.policy.pv(v_g.dtype)
    i, h, b, hk, first, end, rows = blocks._query_program(nq, nk, g, bq, bk, options.causal, options.window)
    tiled = blocks._swizzled(d, dtype)

    def with_q(q_s, bars, p_s, qseg_s):
        blocks._copy_in([(q_g.at[b, h, rows], q_s)] + ([(segs[0].at[b, rows], qseg_s)] if segments else []), bars)
        q_seg = blocks._vector(qseg_s, 1, interpret) if segments else None  # [bq] int32 rows

        def step(idx, k_s, v_s, *rest):
            *kvseg_s, carry = rest
            j = first + idx[0]
            s = blocks.logits(q_s, k_s if interpret else k_s.transpose((1, 0)), bk, options.scale)
            kv_seg = blocks._vector(kvseg_s[0], 0, interpret) if segments else None  # [bk] int32 columns
            return blocks.forward_block(carry, s, v_s, p_s, i * bq, j * bk, options=options, q_seg=q_seg, kv_seg=kv_seg)

        init = blocks.forward_init(bq, d, interpret)
        if interpret:  # k arrives transposed, [D, Tk]
            k_spec = plgpu.BlockSpec((d, bk), lambda t: (0, first + t))
        else:
            k_spec = plgpu.BlockSpec((bk, d), lambda t: (first + t, 0), transforms=tiled)
        specs = [k_spec, plgpu.BlockSpec((bk, d), lambda t: (first + t, 0), transforms=tiled)]
        operands = [k_g.at[b, hk], v_g.at[b, hk]]
        if segments:
            specs.append(plgpu.BlockSpec((bk,), lambda t: (first + t,)))
            operands.append(segs[1].at[b])
        _, _, c, l, acc = plgpu.emit_pipeline(
            step,
            grid=(end - first,),  # traced when causal: the range of key_blocks(i)
            in_specs=specs,
            max_concurrent_steps=blocks.STAGES,
            init_carry=init,
        )(*operands)
        o, lse = fm.finalize(acc, l, c)  # O [bq, D], lse [bq]

        def epilogue(o_s, lse_s):
            blocks.store_outputs(o, lse, o_s, lse_s, o_g.at[b, h], lse_g.at[b, h], rows, native)

        o_tiled = () if o_g.dtype == jnp.float32 else tiled
        pl.run_scoped(epilogue, plgpu.SMEM((bq, d), o_g.dtype, transforms=o_tiled), plgpu.SMEM((bq,), jnp.float32))

    pl.run_scoped(
        with_q,
        plgpu.SMEM((bq, d), dtype, transforms=tiled),
        plgpu.Barrier(num_barriers=1 + segments),
        plgpu.SMEM((bq, bk), pv_dtype) if interpret else None,
        plgpu.SMEM((bq,), jnp.int32) if segments else None,
    )


def _validate(q, k, v, q_seg, kv_seg, options) -> int:
    blocks._validate_common(q, k, v, q_seg, kv_seg, options)
    policy, block_k = options.policy, options.block_k
    d = q.shape[3]
    if d not in blocks.HEAD_DIMS:
        raise ValueError(f"head dim D={d} is not supported by the Mosaic GPU forward; allowed: {blocks.HEAD_DIMS}")
    if policy.pv(v.dtype) != jnp.dtype(v.dtype):
        raise ValueError(
            f"AttentionPolicy.pv_dtype={policy.pv_dtype!r} differs from the input dtype {v.dtype}: the Mosaic GPU "
            "forward's P̃V wgmma reads V from shared memory as stored; use pv_dtype=None"
        )
    o_itemsize = q.dtype.itemsize if policy.residual == "input" else 4
    need = blocks.smem_bytes(d, q.dtype.itemsize, o_itemsize, block_k, segments=q_seg is not None)
    if need > blocks.SMEM_LIMIT:
        raise ValueError(
            f"D={d} with block_k={block_k} needs {need} bytes of shared memory per block, more than the "
            f"{blocks.SMEM_LIMIT} of an H100; use block_k={blocks.BLOCK_KS[0]}"
        )
    return check(q, k, options.block_q, block_k, options.causal, options.window)


def forward(q, k, v, q_seg=None, kv_seg=None, *, options: FlashOptions):
    """The Mosaic GPU (Hopper) flash-attention forward. Returns (O [B, H, Tq, D], lse f32 [B, H, Tq]) as
    :func:`lpt.kernels.flash_attention.kernel.forward` does: O is f32, or already rounded to nearest in q's dtype
    when ``options.policy.residual == "input"``; a query that sees no key gets O = 0 and lse = −inf.

    Args:
      q: [B, H, Tq, D], bf16 or f16; D in :data:`HEAD_DIMS`; Tq a multiple of ``options.block_q``.
      k, v: [B, Hkv, Tk, D] (H % Hkv == 0) in q's dtype; Tk a multiple of ``options.block_k``; causal needs Tq == Tk.
      q_seg, kv_seg: None, or int32 segment ids [B, Tq] and [B, Tk]: query i attends key j only if
        q_seg[i] == kv_seg[j] (packing; padding: ids that match nothing).
      options: the :class:`~lpt.kernels.flash_attention.options.FlashOptions`: the policy (its ``pv_dtype`` None or
        the input dtype); the position rule (:func:`lpt.kernels.flash_attention.math.position_mask`; key blocks
        outside a query block's range are neither fetched nor computed); the logit scale; ``block_q`` 64;
        ``block_k`` 64 or 128 (D = 256 fits shared memory with 64 only); ``interpret`` False compiles for CUDA
        (Hopper, custom call ``mosaic_gpu_v2``), True runs the Mosaic GPU interpreter on CPU (None: ValueError).
    """
    g = _validate(q, k, v, q_seg, kv_seg, options)
    segments = q_seg is not None
    static, out_type, k_op = blocks.forward_launch(q, k, options, g=g)
    kernel = functools.partial(_kernel, **static, segments=segments)
    b, h = q.shape[:2]
    grid = (static["nq"], h, b)
    call = blocks.launch(kernel, out_type, grid, "lpt_flash_attention_fwd_mgpu", options.interpret)
    return call(q, k_op, v, *((q_seg, kv_seg) if segments else ()))


# -- the backward: dQ and dK/dV ------------------------------------------------------------------------------------
