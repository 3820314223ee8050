"""Hopper variant of the flash-attention forward: Mosaic GPU, a TMA pipeline of K/V blocks into shared memory, wgmma.

Computes what :func:`lpt.kernels.flash_attention.kernel.forward` computes, without segment ids (XLA twin:
:func:`lpt.kernels.flash_attention.reference.reference_forward`), for every policy whose P̃V operands are in the
input dtype (the stable and the standard one included): the same per-block rules of
:mod:`lpt.kernels.flash_attention.math` in the same key-block order, over the key blocks of
:func:`lpt.kernels.flash_attention.tiles.key_blocks`::

    grid (Tq/64, H, B); one CTA = one warpgroup (128 threads) = query block i (64 rows) of head h, batch b;
    Mosaic GPU launches the last grid axis fastest (CUDA's x = B, y = H, z = Tq/64), so the CTAs of one query
    block (every batch and head; the G heads that read one kv head side by side) run together, and query blocks
    run last to first: the causal blocks with the most key blocks start first
    Q [64, D] -> SMEM                                   one TMA copy
    for j in key_blocks(i):                             causal: up to the diagonal; sliding window: from its first
        K_j, V_j [bk, D] -> SMEM                        plgpu.emit_pipeline, 2 slots: the TMA copies of block j + 1
                                                        are in flight while block j computes
        S = wgmma(Q, K_jᵀ) · scale                      f32, registers (WGMMA layout), a fresh accumulator
        online-softmax step of math.py on rows [64]     max and near-max count, shift rule, α, P̄, P̃ (input dtype),
                                                        ℓ from P̃ or P̄, the split of large and small weights
        P̃V = wgmma(P̃, V_j)                             P̃ from registers, into a fresh f32 accumulator (two with
        acc = α·acc + P̃V                                the split accumulation: P̃_big V + P̃_small V)
    O = acc / ℓ, lse = c + log ℓ -> SMEM -> GMEM        TMA; O in f32, or rounded to the input dtype (RNE) when
                                                        policy.residual == "input"; lse f32 [B, H, Tq]

Memory per CTA is O(block), independent of T (:func:`smem_bytes`): shared memory holds the Q block, two slots of K
and V blocks and, once the pipeline has released them, the O and lse tiles of the epilogue, plus Mosaic GPU's 2 KiB
reduction scratch and three barriers (bf16, D = 128, bk = 64: 83,992 bytes of the 232,448 an H100 block may use);
registers hold acc [64, D] f32 and the [64, bk] tiles of S and P̃.

Rows. Mosaic GPU keeps a [64, bk] tile in the WGMMA layout (64×8 tiles) and a row statistic as a [64] vector (that
layout reduced over columns); it cannot hold a [64, 1] array. math.py's rules take either layout
(:func:`lpt.kernels.flash_attention.math.wide`), so the kernel calls ``forward_step`` and ``finalize`` themselves; a
test asserts the carry on rows equals the carry on columns bit for bit under XLA.

``interpret=True`` runs the Mosaic GPU interpreter on CPU (jax 0.10.2). Differences, none numeric: the interpreter
cannot apply ``transpose_ref`` inside wgmma nor take a wgmma operand from registers, so there k is passed transposed
([B, Hkv, D, Tk], K blocks [D, bk]) and P̃ is stored to an SMEM tile before its wgmma; layout casts are skipped (they
only annotate layouts); roundings use lpt.numerics' bit-exact rounding (``native=False``: XLA may drop an
f32 -> bf16 -> f32 pair) where the compiled kernel uses the hardware's RNE convert. Everything else (grid, block
ranges, pipeline, wgmma, per-block rules, epilogue) is the code that runs on the GPU. ``interpret=False`` lowers for
CUDA only (custom call ``mosaic_gpu_v2``). It cannot be chosen by ``lax.platform_dependent``: with the interpreter
as the cpu branch, lowering for CUDA fails ("Lowering rule for `cond` returns incorrect set of output tokens": the
interpreter's ordered IO effect), as for lpt's FP8 wgmma kernel; pass ``interpret=True`` explicitly on CPU.

Not in this slice: the backward (dQ, dK/dV: use :func:`lpt.kernels.flash_attention.kernel.backward` with this
forward's lse); warp specialization (a TMA producer warpgroup and two consumer warpgroups taking turns, as
FlashAttention-3 and jax's ``attention_mgpu.py``; the jax 0.10.2 interpreter cannot run it, ``run_state``); an
unmasked fast path for the blocks below the diagonal; segment ids (packing and kv padding: ValueError); a
``pv_dtype`` other than the input dtype (wgmma reads V from SMEM as stored: ValueError); the wiring into
``kernel.py`` and ``lpt.attention``'s impl choice. Not run on GPU hardware.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention.tiles import check, key_blocks

__all__ = ["BLOCK_Q", "BLOCK_KS", "HEAD_DIMS", "forward", "smem_bytes"]

BLOCK_Q = 64  # query rows per CTA: one warpgroup's wgmma M
BLOCK_KS = (64, 128)  # key rows per pipeline step (the N of S = QKᵀ and the K of P̃V)
HEAD_DIMS = (64, 128, 192, 256)  # a multiple of 64 (128-byte swizzled rows of 16-bit values), wgmma N <= 256
STAGES = 2  # K/V slots of the pipeline
SMEM_LIMIT = 232448  # bytes of shared memory an H100 / H200 thread block may use (227 KiB)
_REDUCTION_SCRATCH = 128 * 4 * 4  # Mosaic GPU's default reduction_scratch_bytes
_BARRIER = 8  # bytes per mbarrier: one for Q, one per pipeline slot
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # not re-exported in jax 0.10

    return InterpretGPUParams()


def smem_bytes(d: int, itemsize: int, o_itemsize: int, block_k: int, block_q: int = BLOCK_Q) -> int:
    """Shared memory of one CTA: the Q block, and the larger of the pipeline's K/V slots and the epilogue's O and lse
    tiles (allocated after the pipeline returns), Mosaic GPU's reduction scratch and the barriers. No T in it."""
    q = block_q * d * itemsize
    pipeline = STAGES * 2 * block_k * d * itemsize
    epilogue = block_q * d * o_itemsize + block_q * 4
    return q + max(pipeline, epilogue) + _REDUCTION_SCRATCH + _BARRIER * (1 + STAGES)


def _iota(shape, dim: int, interpret: bool):
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def block_mask(q_start, k_start, shape, causal: bool, window: int, interpret: bool):
    """[bq, bk] attend mask of the block whose first query / key positions are q_start / k_start
    (:func:`lpt.kernels.flash_attention.math.position_mask`); True when nothing is masked by position."""
    if not causal:
        return True
    q_pos = q_start + _iota(shape, 0, interpret)
    k_pos = k_start + _iota(shape, 1, interpret)
    return fm.position_mask(q_pos, k_pos, causal, window)


def _mma(a, b, shape):
    """a @ b by wgmma into a fresh f32 accumulator of ``shape``; returns it (waits for the wgmma)."""

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _kernel(q_g, k_g, v_g, o_g, lse_g, *, policy, causal, window, scale, nq, nk, g, d, bq, bk, interpret):
    native = not interpret  # the hardware RNE convert when compiled; the bit-exact rounding under XLA
    dtype = q_g.dtype
    pv_dtype = policy.pv(v_g.dtype)
    layout = (lambda x, _: x) if interpret else plgpu.layout_cast
    i = nq - 1 - lax.axis_index("q")  # last query block first: the causal blocks with the longest ranges start first
    h, b = lax.axis_index("h"), lax.axis_index("b")
    hk = lax.div(h, jnp.int32(g))  # GQA: query head h reads kv head h // G
    first, end = key_blocks(i, bq=bq, bk=bk, nk=nk, causal=causal, window=window)
    rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
    swizzle = plgpu.find_swizzle(d * dtype.itemsize * 8)  # one row of D 16-bit values: 128 bytes or more
    tiled = (plgpu.TilingTransform((8, swizzle // dtype.itemsize)), plgpu.SwizzleTransform(swizzle))

    def with_q(q_s, q_bar, p_s):
        plgpu.copy_gmem_to_smem(q_g.at[b, h, rows], q_s, q_bar)
        plgpu.barrier_wait(q_bar)

        def step(idx, k_s, v_s, carry):
            j = first + idx[0]
            s = _mma(q_s, k_s if interpret else plgpu.transpose_ref(k_s, (1, 0)), (bq, bk)) * jnp.float32(scale)
            valid = block_mask(i * bq, j * bk, (bq, bk), causal, window, interpret)

            def matmul(w):  # w [bq, bk] in pv dtype -> w V_j f32 [bq, D]
                if interpret:  # the interpreter's wgmma reads its operands from memory
                    p_s[...] = w
                    w = p_s
                return _mma(w, v_s, (bq, d))

            return fm.forward_step(carry, s, valid, matmul, policy, pv_dtype, native)

        row = layout(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        init = (row - jnp.inf, row, row, row, layout(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA))
        if interpret:  # k arrives transposed, [D, Tk]
            k_spec = plgpu.BlockSpec((d, bk), lambda t: (0, first + t))
        else:
            k_spec = plgpu.BlockSpec((bk, d), lambda t: (first + t, 0), transforms=tiled)
        v_spec = plgpu.BlockSpec((bk, d), lambda t: (first + t, 0), transforms=tiled)
        _, _, c, l, acc = plgpu.emit_pipeline(
            step,
            grid=(end - first,),  # traced when causal: the range of key_blocks(i)
            in_specs=[k_spec, v_spec],
            max_concurrent_steps=STAGES,
            init_carry=init,
        )(k_g.at[b, hk], v_g.at[b, hk])
        o, lse = fm.finalize(acc, l, c)  # O [bq, D], lse [bq]

        def epilogue(o_s, lse_s):
            o_s[...] = fm.round_to(o, o_s.dtype, native)  # f32 -> O dtype (RNE; a no-op for f32)
            lse_s[...] = lse
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_g.at[b, h, rows])
            plgpu.copy_smem_to_gmem(lse_s, lse_g.at[b, h, rows])
            plgpu.wait_smem_to_gmem(0)

        o_tiled = () if o_g.dtype == jnp.float32 else tiled
        pl.run_scoped(epilogue, plgpu.SMEM((bq, d), o_g.dtype, transforms=o_tiled), plgpu.SMEM((bq,), jnp.float32))

    p_tile = plgpu.SMEM((bq, bk), pv_dtype) if interpret else None
    pl.run_scoped(with_q, plgpu.SMEM((bq, d), dtype, transforms=tiled), plgpu.Barrier(num_barriers=1), p_tile)


def _validate(q, k, v, q_seg, kv_seg, policy, causal, window, block_q, block_k, interpret) -> int:
    if interpret not in (True, False):
        raise ValueError(
            f"interpret must be True (the Mosaic GPU interpreter, on CPU) or False (compile for CUDA), got "
            f"{interpret!r}: this kernel cannot be chosen per platform by lax.platform_dependent"
        )
    if q_seg is not None or kv_seg is not None:
        raise ValueError(
            "segment ids (packed sequences, kv padding) are not supported by the Mosaic GPU flash-attention forward "
            "yet; pass q_seg=kv_seg=None, or use lpt.kernels.flash_attention.kernel.forward"
        )
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or (q.shape[0], q.shape[3]) != (k.shape[0], k.shape[3]):
        raise ValueError(f"need q [B, H, Tq, D] and k, v [B, Hkv, Tk, D]; got q {q.shape}, k {k.shape}, v {v.shape}")
    if not (q.dtype == k.dtype == v.dtype) or jnp.dtype(q.dtype) not in _DTYPES:
        raise ValueError(
            f"q, k, v must share one dtype of {[str(t) for t in _DTYPES]} (wgmma's 16-bit operands); got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    d = q.shape[3]
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim D={d} is not supported by the Mosaic GPU forward; allowed: {HEAD_DIMS}")
    if block_q != BLOCK_Q or block_k not in BLOCK_KS:
        raise ValueError(
            f"block_q must be {BLOCK_Q} (one warpgroup's rows) and block_k one of {BLOCK_KS}; got block_q={block_q}, "
            f"block_k={block_k}"
        )
    if policy.pv(v.dtype) != jnp.dtype(v.dtype):
        raise ValueError(
            f"AttentionPolicy.pv_dtype={policy.pv_dtype!r} differs from the input dtype {v.dtype}: the Mosaic GPU "
            "forward's P̃V wgmma reads V from shared memory as stored; use pv_dtype=None"
        )
    o_itemsize = q.dtype.itemsize if policy.residual == "input" else 4
    need = smem_bytes(d, q.dtype.itemsize, o_itemsize, block_k)
    if need > SMEM_LIMIT:
        raise ValueError(
            f"D={d} with block_k={block_k} needs {need} bytes of shared memory per block, more than the "
            f"{SMEM_LIMIT} of an H100; use block_k={BLOCK_KS[0]}"
        )
    return check(q, k, block_q, block_k, causal, window)


def forward(
    q,
    k,
    v,
    q_seg=None,
    kv_seg=None,
    *,
    policy: fm.AttentionPolicy,
    causal: bool,
    scale: float,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_KS[0],
    window: int = 0,
    interpret: bool = False,
):
    """The Mosaic GPU (Hopper) flash-attention forward. Returns (O [B, H, Tq, D], lse f32 [B, H, Tq]) as
    :func:`lpt.kernels.flash_attention.kernel.forward` does: O is f32, or already rounded to nearest in q's dtype
    when ``policy.residual == "input"``.

    Args:
      q: [B, H, Tq, D]; k, v: [B, Hkv, Tk, D] (H % Hkv == 0), all bf16 or all f16; D in :data:`HEAD_DIMS`; Tq a
        multiple of ``block_q``, Tk of ``block_k``; causal needs Tq == Tk.
      q_seg, kv_seg: must be None (segment ids are not supported yet: ValueError).
      policy: the numerics policy; its ``pv_dtype`` must be None or the input dtype.
      causal, window: the position rule (:func:`lpt.kernels.flash_attention.math.position_mask`); ``window`` > 0
        needs ``causal``; key blocks outside a query block's range are neither fetched nor computed.
      scale: logit scale.
      block_q: 64; block_k: 64 or 128 (D = 256 fits shared memory with 64 only).
      interpret: False compiles for CUDA (Hopper, custom call ``mosaic_gpu_v2``); True runs the Mosaic GPU
        interpreter on CPU.
    """
    g = _validate(q, k, v, q_seg, kv_seg, policy, causal, window, block_q, block_k, interpret)
    b, h, tq, d = q.shape
    tk = k.shape[2]
    o_dtype = q.dtype if policy.residual == "input" else jnp.float32  # bf16 O halves the write when it suffices
    nq, nk = tq // block_q, tk // block_k
    kernel = functools.partial(
        _kernel,
        policy=policy,
        causal=causal,
        window=window,
        scale=scale,
        nq=nq,
        nk=nk,
        g=g,
        d=d,
        bq=block_q,
        bk=block_k,
        interpret=interpret,
    )
    k_op = jnp.swapaxes(k, 2, 3) if interpret else k  # the interpreter's wgmma takes Kᵀ as stored
    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((b, h, tq, d), o_dtype), jax.ShapeDtypeStruct((b, h, tq), jnp.float32)),
        grid=(nq, h, b),
        grid_names=("q", "h", "b"),
        kernel_name="lpt_flash_attention_fwd_mgpu",
        interpret=_interpret_params() if interpret else None,
    )(q, k_op, v)
