"""Hopper flash-attention forward, warp-specialized: per CTA one producer warpgroup issues the TMA copies of K and V
into a ring of shared-memory slots while two consumer warpgroups compute (the schedule of FlashAttention-3 and of
jax's ``attention_mgpu.py``; lpt's own code).

Computes exactly what :func:`lpt.kernels.flash_attention.mosaic_gpu.forward` computes (O, lse; every policy whose P̃V
operands are in the input dtype; GQA, causal / full / sliding-window / cross attention): each consumer runs, per key
block, the same :func:`lpt.kernels.flash_attention.mosaic_gpu_blocks.logits` and
:func:`~lpt.kernels.flash_attention.mosaic_gpu_blocks.forward_block` (mask, math.py's ``forward_step``, P̃V by wgmma)
as that kernel, over the key blocks of :func:`lpt.kernels.flash_attention.tiles.key_blocks` of its own 64 query rows,
in the same order, then ``finalize``. So the two kernels' outputs are bit for bit the same wherever the tensor core
sums in the same order. No segment ids (ValueError): use the single-warpgroup forward for packed or padded
sequences. Schedule::

    grid (Tq/128, H, B), 3 warpgroups per CTA (384 threads); query pair p (the last first), head h, batch b
    consumer w ∈ {0, 1}: query block i = 2p + w (64 rows), its range [f_w, e_w) = key_blocks(i);
    the CTA's range [f, e) = [f_0, e_1), their union (f_0 <= f_1 <= e_0 <= e_1)

    producer (warpgroup 2, 24 registers)          consumers (warpgroups 0, 1, 240 registers each)
                                                  Q_i [64, D] -> SMEM (TMA)
    for j in [f, e), slot = (j − f) mod S:        for j in [f, e), slot = (j − f) mod S:
      wait k_free[slot] (not the first S)           wait k_full[slot]
      K_j -> k[slot] (TMA, arrives k_full[slot])    j in [f_w, e_w): S = wgmma(Q_i, K_jᵀ) · scale
      wait v_free[slot] (not the first S)           arrive k_free[slot]
      V_j -> v[slot] (TMA, arrives v_full[slot])    wait v_full[slot]
                                                    j in [f_w, e_w): forward_block: mask, online-softmax step of
                                                      math.py, acc = α·acc + P̃V (wgmma, P̃ from registers)
                                                    arrive v_free[slot]
    for the last S blocks: wait k_free, v_free    O = acc / ℓ, lse = c + log ℓ -> SMEM -> GMEM (TMA)

S = :data:`STAGES` slots (``stages``); k_free / v_free complete when both consumers arrived, so the producer refills a
slot only after both are done with it, and the copies of the next S − 1 blocks are in flight while a block computes;
at the end the producer waits for the last S frees, so that every phase of every barrier is waited on. A consumer
waits on every block of the union, also one outside its own range, because Mosaic GPU tracks each barrier's phase per
thread by counting waits; it skips that block's compute and releases its slots (the causal diagonal: the first
consumer's last block; a sliding window: the second consumer's first ones). Work stays that of the single-warpgroup
kernel, O(T·w) with a window. The two consumers share every K/V fetch (half the single-warpgroup kernel's K/V traffic
per query row), and each block's copies overlap both consumers' compute.

Shared memory per CTA (:func:`smem_bytes`): two Q tiles, S K and S V slots, two O tiles (in O's dtype: f32, or the
input dtype when ``policy.residual == "input"``) and two lse rows, each rounded up to 1 KiB, Mosaic GPU's reduction
scratch and the barriers; bf16, D = 128: 166,992 bytes with block_k = 64 and f32 O, 199,760 with block_k = 128 and
bf16 O; block_k = 128 with f32 O exceeds the 232,448 an H100 block may use (ValueError). Registers: ptxas (deviceless,
sm_90a) reports 168 per thread at launch (65,536 / 384), the consumers run under ``setmaxnreg`` 240, the producer 24;
no spills at D = 128 with block_k = 64 (stable and standard policy; causal, full, window) nor with block_k = 128 for
the standard policy; the stable policy spills at block_k = 128 (436 bytes at D = 64), as the single-warpgroup kernel
does at D = 128.

``interpret=True`` runs the Mosaic GPU interpreter (jax 0.10.2, 0.11.2, 0.12) as the single-warpgroup kernel does (K
stored transposed, P̃ via an SMEM tile per consumer): there it returns that kernel's (O, lse) bit for bit.
The interpreter runs the three warpgroups as threads that each execute an XLA:CPU program, on the pool of XLA's CPU
client: on a 2-core machine with one or two CPU devices (too few threads in the pool) two warpgroups blocked on a
barrier hold the whole pool and the third, which would release them, never runs, so some calls wait forever (seen
with sliding windows and G >= 2). With three CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=3``)
they finish, bit for bit the single-warpgroup kernel's; the tests run those cases so. A GPU runs each warpgroup on
its own warps. Not run on GPU hardware yet: outputs, absence of deadlock and speed on a GPU are unverified.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention import mosaic_gpu_blocks as blocks
from lpt.kernels.flash_attention.options import FlashOptions
from lpt.kernels.flash_attention.tiles import check, key_blocks

__all__ = ["BLOCK_KS", "HEAD_DIMS", "STAGES", "forward", "smem_bytes"]

HEAD_DIMS = (64, 128)  # the consumers hold acc [64, D] f32 beside a block's [64, bk] tiles in 240 registers
BLOCK_KS = (64, 128)  # key rows per slot
STAGES = 2  # K/V slots of the ring
_CONSUMERS = 2  # consumer warpgroups, 64 query rows each
_CONSUMER_REGISTERS = 240  # setmaxnreg: 2 · 128 · 240 + 128 · 24 <= 65,536 registers of an SM
_PRODUCER_REGISTERS = 24


def smem_bytes(d: int, itemsize: int, o_itemsize: int, block_k: int, stages: int = STAGES) -> int:
    """Shared memory of one warp-specialized forward CTA: the consumers' Q tiles, the ring's K and V slots, the
    consumers' O tiles and lse rows (each allocation rounded up to 1 KiB), Mosaic GPU's reduction scratch, and the
    barriers (Q: one per consumer; full and free: one each per K and per V slot). No T in it.

    Args:
      d: head dim.
      itemsize, o_itemsize: bytes per element of q/k/v and of O.
      block_k: key rows per slot.
      stages: K/V slots.
    """
    a = blocks._aligned
    tiles = a(_CONSUMERS * blocks.BLOCK_Q * d * itemsize) + 2 * a(stages * block_k * d * itemsize)
    epilogue = a(_CONSUMERS * blocks.BLOCK_Q * d * o_itemsize) + a(_CONSUMERS * blocks.BLOCK_Q * 4)
    return tiles + epilogue + blocks._REDUCTION_SCRATCH + blocks._BARRIER * (_CONSUMERS + 4 * stages)


def _kernel(q_g, k_g, v_g, o_g, lse_g, *, options, nq, nk, g, d, stages):
    interpret, bk = options.interpret, options.block_k
    bq, dtype, native = blocks.BLOCK_Q, q_g.dtype, not interpret
    tiled = blocks._swizzled(d, dtype)
    pair = nq // _CONSUMERS - 1 - lax.axis_index("q")  # the last first: the longest causal ranges start first
    h, b = lax.axis_index("h"), lax.axis_index("b")
    hk = lax.div(h, jnp.int32(g))
    ranges = dict(bq=bq, bk=bk, nk=nk, causal=options.causal, window=options.window)
    first, _ = key_blocks(_CONSUMERS * pair, **ranges)
    _, end = key_blocks(_CONSUMERS * pair + _CONSUMERS - 1, **ranges)  # the union of the consumers' ranges

    def slot_of(j):
        return lax.rem(j - first, jnp.int32(stages))

    def body(q_s, k_s, v_s, o_s, lse_s, p_s, q_full, k_full, v_full, k_free, v_free):
        wg = lax.axis_index("wg")

        @pl.when(wg < _CONSUMERS)
        def _consumer():
            if not interpret:
                plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
            i = _CONSUMERS * pair + wg
            own_first, own_end = key_blocks(i, **ranges)
            rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
            q_w, p_w = q_s.at[wg], (p_s.at[wg] if interpret else None)
            plgpu.copy_gmem_to_smem(q_g.at[b, h, rows], q_w, q_full.at[wg])
            plgpu.barrier_wait(q_full.at[wg])

            def skip(j, _):  # a block of the other consumer's range: keep the barrier phases, free the slot
                slot = slot_of(j)
                for full, free in ((k_full, k_free), (v_full, v_free)):
                    plgpu.barrier_wait(full.at[slot])
                    plgpu.barrier_arrive(free.at[slot])

            def compute(j, carry):
                slot = slot_of(j)
                plgpu.barrier_wait(k_full.at[slot])
                k_t = k_s.at[slot] if interpret else k_s.at[slot].transpose((1, 0))
                s = blocks.logits(q_w, k_t, bk, options.scale)
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_wait(v_full.at[slot])
                carry = blocks.forward_block(
                    carry, s, v_s.at[slot], p_w, i * bq, j * bk, options=options, q_seg=None, kv_seg=None
                )
                plgpu.barrier_arrive(v_free.at[slot])
                return carry

            lax.fori_loop(first, own_first, skip, None)
            carry = lax.fori_loop(own_first, own_end, compute, blocks.forward_init(bq, d, interpret))
            lax.fori_loop(own_end, end, skip, None)
            _, _, c, l, acc = carry
            o, lse = fm.finalize(acc, l, c)  # O [bq, D], lse [bq]
            blocks.store_outputs(o, lse, o_s.at[wg], lse_s.at[wg], o_g.at[b, h], lse_g.at[b, h], rows, native)

        @pl.when(wg == _CONSUMERS)
        def _producer():
            if not interpret:
                plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

            def fetch(j, _):
                slot, keys = slot_of(j), pl.ds(pl.multiple_of(j * bk, bk), bk)
                refill = j - first >= stages  # the slot held block j − S: wait until both consumers freed it
                k_src = k_g.at[b, hk, :, keys] if interpret else k_g.at[b, hk, keys]
                for src, dst, full, free in ((k_src, k_s, k_full, k_free), (v_g.at[b, hk, keys], v_s, v_full, v_free)):
                    pl.when(refill)(functools.partial(plgpu.barrier_wait, free.at[slot]))
                    plgpu.copy_gmem_to_smem(src, dst.at[slot], full.at[slot])

            def drain(j, _):  # wait until the consumers freed the last blocks: every phase of a barrier is waited on
                for free in (k_free, v_free):
                    plgpu.barrier_wait(free.at[slot_of(j)])

            lax.fori_loop(first, end, fetch, None)
            lax.fori_loop(jnp.maximum(first, end - stages), end, drain, None)

    o_tiled = () if o_g.dtype == jnp.float32 else tiled
    k_slots = (
        plgpu.SMEM((stages, d, bk), dtype)  # the interpreter's wgmma takes Kᵀ as stored
        if interpret
        else plgpu.SMEM((stages, bk, d), dtype, transforms=tiled)
    )
    pl.run_scoped(
        body,
        plgpu.SMEM((_CONSUMERS, bq, d), dtype, transforms=tiled),
        k_slots,
        plgpu.SMEM((stages, bk, d), dtype, transforms=tiled),
        plgpu.SMEM((_CONSUMERS, bq, d), o_g.dtype, transforms=o_tiled),
        plgpu.SMEM((_CONSUMERS, bq), jnp.float32),
        plgpu.SMEM((_CONSUMERS, bq, bk), dtype) if interpret else None,
        plgpu.Barrier(num_barriers=_CONSUMERS),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
        collective_axes="wg",
    )


def _validate(q, k, v, q_seg, kv_seg, options, stages) -> int:
    if q_seg is not None or kv_seg is not None:
        raise ValueError(
            "segment ids are not supported by the warp-specialized Mosaic GPU forward; use "
            "lpt.kernels.flash_attention.mosaic_gpu.forward"
        )
    if options.block_q != blocks.BLOCK_Q:
        raise ValueError(
            f"block_q must be {blocks.BLOCK_Q} (one consumer warpgroup's rows); got block_q={options.block_q}"
        )
    blocks._validate_common(q, k, v, None, None, options)
    policy, block_k = options.policy, options.block_k
    d = q.shape[3]
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim D={d} is not supported by the warp-specialized forward; allowed: {HEAD_DIMS}")
    if policy.pv(v.dtype) != jnp.dtype(v.dtype):
        raise ValueError(
            f"AttentionPolicy.pv_dtype={policy.pv_dtype!r} differs from the input dtype {v.dtype}: the P̃V wgmma "
            "reads V from shared memory as stored; use pv_dtype=None"
        )
    if not isinstance(stages, int) or stages < 2:
        raise ValueError(f"stages={stages!r} must be an int >= 2 (K/V slots of the ring)")
    o_itemsize = q.dtype.itemsize if policy.residual == "input" else 4
    need = smem_bytes(d, q.dtype.itemsize, o_itemsize, block_k, stages)
    if need > blocks.SMEM_LIMIT:
        raise ValueError(
            f"D={d} with block_k={block_k}, stages={stages} and a {o_itemsize}-byte O needs {need} bytes of shared "
            f"memory per block, more than the {blocks.SMEM_LIMIT} of an H100; use block_k={BLOCK_KS[0]} or fewer stages"
        )
    if q.shape[2] % (_CONSUMERS * blocks.BLOCK_Q):
        raise ValueError(f"Tq={q.shape[2]} must be a multiple of {_CONSUMERS * blocks.BLOCK_Q} (query rows per CTA)")
    return check(q, k, blocks.BLOCK_Q, block_k, options.causal, options.window)


def forward(q, k, v, q_seg=None, kv_seg=None, *, options: FlashOptions, stages: int = STAGES):
    """The warp-specialized Mosaic GPU (Hopper) flash-attention forward: returns what
    :func:`lpt.kernels.flash_attention.mosaic_gpu.forward` returns, (O [B, H, Tq, D], lse f32 [B, H, Tq]); O is f32,
    or rounded to nearest in q's dtype when ``options.policy.residual == "input"``; a query that sees no key gets
    O = 0 and lse = −inf. Takes that function's arguments (and ``stages``), so either can be passed where the other
    is.

    Args:
      q: [B, H, Tq, D], bf16 or f16; D in :data:`HEAD_DIMS`; Tq a multiple of 128 (two 64-row query blocks per CTA).
      k, v: [B, Hkv, Tk, D] (H % Hkv == 0) in q's dtype; Tk a multiple of ``options.block_k``; causal needs Tq == Tk.
      q_seg, kv_seg: None (segment ids are not supported here: ValueError).
      options: the :class:`~lpt.kernels.flash_attention.options.FlashOptions`: the policy (its ``pv_dtype`` None or
        the input dtype); the position rule (:func:`lpt.kernels.flash_attention.math.position_mask`; key blocks
        that no query of a CTA sees are neither fetched nor computed); the logit scale; ``block_q`` 64 (query rows
        per consumer warpgroup); ``block_k`` 64 or 128 (D = 128 with 128 fits shared memory only with O in the
        input dtype); ``interpret`` False compiles for CUDA (Hopper, custom call ``mosaic_gpu_v2``), True runs the
        Mosaic GPU interpreter on CPU.
      stages: K/V slots of the ring (>= 2).
    """
    g = _validate(q, k, v, q_seg, kv_seg, options, stages)
    static, out_type, k_op = blocks.forward_launch(q, k, options, g=g)
    kernel = functools.partial(_kernel, **static, stages=stages)
    b, h = q.shape[:2]
    grid = (static["nq"] // _CONSUMERS, h, b)
    threads = dict(num_threads=_CONSUMERS + 1, thread_name="wg")
    return blocks.launch(kernel, out_type, grid, "lpt_flash_attention_fwd_ws_mgpu", options.interpret, **threads)(
        q, k_op, v
    )
