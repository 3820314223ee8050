"""Hopper variant of flash attention, forward and backward: Mosaic GPU, TMA pipelines into shared memory, wgmma.

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

Not in this slice: warp specialization (a TMA producer warpgroup and two consumer warpgroups taking turns, as
FlashAttention-3 and jax's ``attention_mgpu.py``; the jax 0.10.2 interpreter cannot run it, ``run_state``), which
would also give the dK/dV kernel a second warpgroup's registers (D = 256, bk = 128); an unmasked fast path for the
blocks below the diagonal, and skipping blocks that segment ids mask entirely; a ``pv_dtype`` other than the input
dtype (wgmma reads V from SMEM as stored: ValueError); the wiring into ``kernel.py``. ``lpt.attention`` runs these
kernels as ``dot_product_attention(impl="mosaic_gpu")``. Not run on GPU hardware.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lpt.kernels import compat
from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention.tiles import check, key_blocks, query_blocks

__all__ = [
    "BACKWARD_HEAD_DIMS",
    "BLOCK_KS",
    "BLOCK_Q",
    "HEAD_DIMS",
    "backward",
    "dkdv_smem_bytes",
    "dq_smem_bytes",
    "forward",
    "smem_bytes",
]

BLOCK_Q = 64  # query rows per CTA: one warpgroup's wgmma M (the backward: also the key rows of a dK/dV CTA)
BLOCK_KS = (64, 128)  # rows per pipeline step: keys (forward, dQ; the N of S = QKᵀ) or queries (dK/dV)
HEAD_DIMS = (64, 128, 192, 256)  # a multiple of 64 (128-byte swizzled rows of 16-bit values), wgmma N <= 256
BACKWARD_HEAD_DIMS = (64, 128)  # D of the backward: registers (module docstring)
BACKWARD_TILE_LIMIT = 64 * 128  # the largest D · block_k of the backward: registers (module docstring)
STAGES = 2  # slots of each pipeline
SMEM_LIMIT = 232448  # bytes of shared memory an H100 / H200 thread block may use (227 KiB)
_REDUCTION_SCRATCH = 128 * 4 * 4  # Mosaic GPU's default reduction_scratch_bytes (the forward's row max and sums)
_SMEM_ALIGNMENT = 1024  # Mosaic GPU reserves every shared-memory allocation in multiples of 1 KiB
_BARRIER = 8  # bytes per mbarrier
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # not re-exported in jax 0.10

    return InterpretGPUParams()


def _aligned(n: int) -> int:
    return -(-n // _SMEM_ALIGNMENT) * _SMEM_ALIGNMENT


def smem_bytes(
    d: int, itemsize: int, o_itemsize: int, block_k: int, block_q: int = BLOCK_Q, segments: bool = False
) -> int:
    """Shared memory of one forward CTA: the Q block (and its query segments), the larger of the pipeline's K/V slots
    (and kv segment slots) with Mosaic GPU's reduction scratch and the epilogue's O and lse tiles (allocated after the
    pipeline returns), and the barriers: one for Q (and one for the query segments), one per pipeline slot. Each
    allocation is rounded up to 1 KiB. No T in it."""
    q = _aligned(block_q * d * itemsize) + segments * _aligned(block_q * 4)
    pipeline = 2 * _aligned(STAGES * block_k * d * itemsize) + segments * _aligned(STAGES * block_k * 4)
    epilogue = _aligned(block_q * d * o_itemsize) + _aligned(block_q * 4)
    return q + max(pipeline + _REDUCTION_SCRATCH, epilogue) + _BARRIER * (1 + segments + STAGES)


def dq_smem_bytes(d: int, itemsize: int, block_k: int, block_q: int = BLOCK_Q, segments: bool = False) -> int:
    """Shared memory of one dQ CTA: the Q and dO blocks, its lse and δ rows (and query segments), then the larger of
    the pipeline's K/V slots (and kv segment slots) and the epilogue's dq tile (f32), and the barriers (each
    allocation rounded up to 1 KiB; the backward reduces nothing, so no reduction scratch). No T in it."""
    resident = 2 * _aligned(block_q * d * itemsize) + (2 + segments) * _aligned(block_q * 4)
    pipeline = 2 * _aligned(STAGES * block_k * d * itemsize) + segments * _aligned(STAGES * block_k * 4)
    epilogue = _aligned(block_q * d * 4)
    return resident + max(pipeline, epilogue) + _BARRIER * (4 + segments + STAGES)


def dkdv_smem_bytes(d: int, itemsize: int, block_q: int, block_k: int = BLOCK_Q, segments: bool = False) -> int:
    """Shared memory of one dK/dV CTA (``block_k`` key rows; ``block_q`` query rows per pipeline step): the K and V
    blocks (and kv segments), then the larger of the pipeline's Q/dO slots with their lse/δ rows (and query segment
    slots) and the epilogue's dk, dv tiles (f32), and the barriers (each allocation rounded up to 1 KiB). No T in
    it."""
    resident = 2 * _aligned(block_k * d * itemsize) + segments * _aligned(block_k * 4)
    pipeline = 2 * _aligned(STAGES * block_q * d * itemsize) + (2 + segments) * _aligned(STAGES * block_q * 4)
    epilogue = 2 * _aligned(block_k * d * 4)
    return resident + max(pipeline, epilogue) + _BARRIER * (2 + segments + STAGES)


def _iota(shape, dim: int, interpret: bool):
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def block_mask(q_start, k_start, shape, causal: bool, window: int, interpret: bool, keys_first: bool = False):
    """[bq, bk] attend mask of the block whose first query / key positions are q_start / k_start
    (:func:`lpt.kernels.flash_attention.math.position_mask`), or [bk, bq] with ``keys_first`` (the dK/dV kernel's
    tiles); True when nothing is masked by position."""
    if not causal:
        return True
    q_dim, k_dim = (1, 0) if keys_first else (0, 1)
    q_pos = q_start + _iota(shape, q_dim, interpret)
    k_pos = k_start + _iota(shape, k_dim, interpret)
    return fm.position_mask(q_pos, k_pos, causal, window)


def segment_mask(valid, q_seg, kv_seg, shape, keys_first: bool = False):
    """``valid`` (a block's position mask, or True) and q_seg == kv_seg on the block: q_seg, kv_seg int32 vectors
    along its query and key axis ([bq] rows and [bk] columns of a [bq, bk] tile; the other way round with
    ``keys_first``). ``valid`` itself when there are no segments (None)."""
    if q_seg is None:
        return valid
    q_dim, k_dim = (1, 0) if keys_first else (0, 1)
    same = lax.broadcast_in_dim(q_seg, shape, (q_dim,)) == lax.broadcast_in_dim(kv_seg, shape, (k_dim,))
    return same if valid is True else valid & same


def _vector(ref, dim: int, interpret: bool):
    """A [n] vector (a row statistic or segment ids) read from SMEM in the layout of a WGMMA tile reduced over
    ``dim``: dim 1 gives a vector along the tile's rows, dim 0 along its columns (interpreter: a plain read)."""
    if interpret:
        return ref[...]
    return compat.mgpu_load(ref, layout=plgpu.Layout.WGMMA.reduce(dim))


def _copy_in(pairs, bars):
    """TMA copies GMEM -> SMEM of (src, dst) pairs, one barrier each (``bars``: that many barriers); waits for all."""
    for n, (src, dst) in enumerate(pairs):
        plgpu.copy_gmem_to_smem(src, dst, bars.at[n])
    for n in range(len(pairs)):
        plgpu.barrier_wait(bars.at[n])


def _mma(a, b, shape):
    """a @ b by wgmma into a fresh f32 accumulator of ``shape``; returns it (waits for the wgmma)."""

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _mma_add(acc, a, b, interpret: bool):
    """acc + a @ b (f32). Compiled: wgmma accumulates into ``acc`` itself (``plgpu.ACC.init``), so no second
    accumulator tile is live (at D = 128 a second [64, D] f32 tile made ptxas spill the dK/dV kernel); the interpreter
    cannot run ``run_state``, so there a fresh accumulator is added to ``acc``."""
    if interpret:
        return acc + _mma(a, b, acc.shape)

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(run)(plgpu.ACC.init(acc))


def _operand(w, scratch, interpret: bool):
    """A wgmma A operand from registers: ``w`` itself when compiled; the interpreter's wgmma reads its operands
    from memory, so there ``w`` is stored to the SMEM tile ``scratch`` first."""
    if not interpret:
        return w
    scratch[...] = w
    return scratch


def _swizzled(d: int, dtype):
    """The transforms of a [rows, D] tile of 16-bit values in SMEM that wgmma and TMA read: 8-row tiles of one
    swizzle width, swizzled (one row of D 16-bit values: 128 bytes or more)."""
    swizzle = plgpu.find_swizzle(d * dtype.itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // dtype.itemsize)), plgpu.SwizzleTransform(swizzle))


# -- the forward ---------------------------------------------------------------------------------------------------


def _query_program(nq, nk, g, bq, bk, causal, window):
    """This CTA's query block i (the last first: the causal blocks with the longest ranges start first), head h,
    batch b, kv head hk = h // G (GQA), its key-block range [first, end) and its rows of Tq."""
    i = nq - 1 - lax.axis_index("q")
    h, b = lax.axis_index("h"), lax.axis_index("b")
    hk = lax.div(h, jnp.int32(g))
    first, end = key_blocks(i, bq=bq, bk=bk, nk=nk, causal=causal, window=window)
    return i, h, b, hk, first, end, pl.ds(pl.multiple_of(i * bq, bq), bq)


def _kernel(*refs, policy, causal, window, scale, nq, nk, g, d, bq, bk, segments, interpret):
    q_g, k_g, v_g, *segs, o_g, lse_g = refs  # segs: (q_seg [B, Tq], kv_seg [B, Tk]) or ()
    native = not interpret  # the hardware RNE convert when compiled; the bit-exact rounding under XLA
    dtype = q_g.dtype
    pv_dtype = policy.pv(v_g.dtype)
    layout = (lambda x, _: x) if interpret else plgpu.layout_cast
    i, h, b, hk, first, end, rows = _query_program(nq, nk, g, bq, bk, causal, window)
    tiled = _swizzled(d, dtype)

    def with_q(q_s, bars, p_s, qseg_s):
        _copy_in([(q_g.at[b, h, rows], q_s)] + ([(segs[0].at[b, rows], qseg_s)] if segments else []), bars)
        q_seg = _vector(qseg_s, 1, interpret) if segments else None  # [bq] int32 rows

        def step(idx, k_s, v_s, *rest):
            *kvseg_s, carry = rest
            j = first + idx[0]
            s = _mma(q_s, k_s if interpret else k_s.transpose((1, 0)), (bq, bk)) * jnp.float32(scale)
            kv_seg = _vector(kvseg_s[0], 0, interpret) if segments else None  # [bk] int32 columns
            valid = block_mask(i * bq, j * bk, s.shape, causal, window, interpret)
            valid = segment_mask(valid, q_seg, kv_seg, s.shape)

            def matmul(w):  # w [bq, bk] in pv dtype -> w V_j f32 [bq, D]
                return _mma(_operand(w, p_s, interpret), v_s, (bq, d))

            return fm.forward_step(carry, s, valid, matmul, policy, pv_dtype, native)

        row = layout(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        init = (row - jnp.inf, row, row, row, layout(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA))
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
            max_concurrent_steps=STAGES,
            init_carry=init,
        )(*operands)
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

    pl.run_scoped(
        with_q,
        plgpu.SMEM((bq, d), dtype, transforms=tiled),
        plgpu.Barrier(num_barriers=1 + segments),
        plgpu.SMEM((bq, bk), pv_dtype) if interpret else None,
        plgpu.SMEM((bq,), jnp.int32) if segments else None,
    )


def _validate_common(q, k, v, q_seg, kv_seg, block_q, block_k, interpret) -> None:
    """The checks the forward and the backward share."""
    if interpret not in (True, False):
        raise ValueError(
            f"interpret must be True (the Mosaic GPU interpreter, on CPU) or False (compile for CUDA), got "
            f"{interpret!r}: this kernel cannot be chosen per platform by lax.platform_dependent"
        )
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or (q.shape[0], q.shape[3]) != (k.shape[0], k.shape[3]):
        raise ValueError(f"need q [B, H, Tq, D] and k, v [B, Hkv, Tk, D]; got q {q.shape}, k {k.shape}, v {v.shape}")
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("pass both segment ids q_seg and kv_seg, or neither")
    if q_seg is not None:
        want = ((q.shape[0], q.shape[2]), (k.shape[0], k.shape[2]))
        if (q_seg.shape, kv_seg.shape) != want or q_seg.dtype != jnp.int32 or kv_seg.dtype != jnp.int32:
            raise ValueError(
                f"need segment ids q_seg {want[0]} and kv_seg {want[1]} int32; got q_seg {q_seg.shape} {q_seg.dtype}, "
                f"kv_seg {kv_seg.shape} {kv_seg.dtype}"
            )
    if not (q.dtype == k.dtype == v.dtype) or jnp.dtype(q.dtype) not in _DTYPES:
        raise ValueError(
            f"q, k, v must share one dtype of {[str(t) for t in _DTYPES]} (wgmma's 16-bit operands); got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    if block_q != BLOCK_Q or block_k not in BLOCK_KS:
        raise ValueError(
            f"block_q must be {BLOCK_Q} (one warpgroup's rows) and block_k one of {BLOCK_KS}; got block_q={block_q}, "
            f"block_k={block_k}"
        )


def _validate(q, k, v, q_seg, kv_seg, policy, causal, window, block_q, block_k, interpret) -> int:
    _validate_common(q, k, v, q_seg, kv_seg, block_q, block_k, interpret)
    d = q.shape[3]
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim D={d} is not supported by the Mosaic GPU forward; allowed: {HEAD_DIMS}")
    if policy.pv(v.dtype) != jnp.dtype(v.dtype):
        raise ValueError(
            f"AttentionPolicy.pv_dtype={policy.pv_dtype!r} differs from the input dtype {v.dtype}: the Mosaic GPU "
            "forward's P̃V wgmma reads V from shared memory as stored; use pv_dtype=None"
        )
    o_itemsize = q.dtype.itemsize if policy.residual == "input" else 4
    need = smem_bytes(d, q.dtype.itemsize, o_itemsize, block_k, segments=q_seg is not None)
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
    when ``policy.residual == "input"``; a query that sees no key gets O = 0 and lse = −inf.

    Args:
      q: [B, H, Tq, D]; k, v: [B, Hkv, Tk, D] (H % Hkv == 0), all bf16 or all f16; D in :data:`HEAD_DIMS`; Tq a
        multiple of ``block_q``, Tk of ``block_k``; causal needs Tq == Tk.
      q_seg, kv_seg: None, or int32 segment ids [B, Tq] and [B, Tk]: query i attends key j only if
        q_seg[i] == kv_seg[j] (packing; padding: ids that match nothing).
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
    segments = q_seg is not None
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
        segments=segments,
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
    )(q, k_op, v, *((q_seg, kv_seg) if segments else ()))


# -- the backward: dQ and dK/dV ------------------------------------------------------------------------------------


def _dq_kernel(*refs, causal, window, scale, nq, nk, g, d, bq, bk, segments, interpret):
    """dQ of query block i (64 rows) of head h, batch b: dq = scale · Σ_j round(dS_j) K_j over key_blocks(i).

    Operands (q, k, v, do, lse, δ, [q_seg, kv_seg], dq) compiled; the interpreter gets (q, kᵀ, vᵀ, k, do, lse, δ, ...)
    instead: its wgmma cannot transpose, so the Kᵀ and Vᵀ that S = Q Kᵀ and dP = dO Vᵀ read come stored
    transposed."""
    *ins, dq_g = refs
    if interpret:
        q_g, kt_g, vt_g, k_g, do_g, lse_g, delta_g, *segs = ins
        streamed = [kt_g, vt_g, k_g]
    else:
        q_g, k_g, v_g, do_g, lse_g, delta_g, *segs = ins
        streamed = [k_g, v_g]
    native = not interpret  # the hardware RNE convert when compiled; the bit-exact rounding under XLA
    dtype = q_g.dtype
    layout = (lambda x, _: x) if interpret else plgpu.layout_cast
    i, h, b, hk, first, end, rows = _query_program(nq, nk, g, bq, bk, causal, window)
    tiled = _swizzled(d, dtype)

    def with_q(q_s, do_s, lse_s, delta_s, bars, ds_s, qseg_s):
        pairs = [(x.at[b, h, rows], x_s) for x, x_s in ((q_g, q_s), (do_g, do_s), (lse_g, lse_s), (delta_g, delta_s))]
        _copy_in(pairs + ([(segs[0].at[b, rows], qseg_s)] if segments else []), bars)
        lse, delta = _vector(lse_s, 1, interpret), _vector(delta_s, 1, interpret)  # [bq] f32 rows
        q_seg = _vector(qseg_s, 1, interpret) if segments else None  # [bq] int32 rows

        def step(idx, *blocks):
            *blocks, dq = blocks
            if interpret:
                kt_s, vt_s, k_s, *kvseg_s = blocks
            else:
                k_s, v_s, *kvseg_s = blocks
                kt_s, vt_s = k_s.transpose((1, 0)), v_s.transpose((1, 0))
            j = first + idx[0]
            s = _mma(q_s, kt_s, (bq, bk)) * jnp.float32(scale)
            dp = _mma(do_s, vt_s, (bq, bk))
            kv_seg = _vector(kvseg_s[0], 0, interpret) if segments else None  # [bk] int32 columns
            valid = block_mask(i * bq, j * bk, s.shape, causal, window, interpret)
            valid = segment_mask(valid, q_seg, kv_seg, s.shape)
            _, ds = fm.backward_weights(s, valid, lse, dp, delta, dtype, native)  # round(dS) in the input dtype
            return _mma_add(dq, _operand(ds, ds_s, interpret), k_s, interpret)

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
            max_concurrent_steps=STAGES,
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


def _dkdv_kernel(*refs, causal, window, scale, tq, g, d, bq, bk, segments, interpret):
    """dK, dV of key block j (``bk`` = 64 rows) of kv head hk, batch b, summed over the G query heads of hk and the
    query blocks of query_blocks(j) (``bq`` rows each), with keys as rows (Sᵀ = K Qᵀ, the tiles' M = 64):

        Pᵀ, dSᵀ = backward_weights(Sᵀ, lse, dPᵀ = V dOᵀ, δ)   lse and δ broadcast along the key rows
        dv += round(Pᵀ) dO;  dk += round(dSᵀ) Q;  dk ·= scale after the last block

    q, do [B, Hkv, G·Tq, D] and lse, δ [B, Hkv, G·Tq] (a free reshape of [B, H, Tq, ·]): query head gi of the group
    reads rows gi·Tq …; query segments [B, Tq] are the same for every head. Operands (q, k, v, do, lse, δ, [q_seg,
    kv_seg], dk, dv) compiled; the interpreter gets (q, qᵀ, k, v, do, doᵀ, lse, δ, ...): its wgmma cannot transpose,
    so the Qᵀ and dOᵀ that Sᵀ and dPᵀ read come stored transposed."""
    *ins, dk_g, dv_g = refs
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
    tiled = _swizzled(d, dtype)

    def block(t):  # pipeline step t: query head gi = t // n_i of the group (outer), query block lo + t % n_i (inner)
        return lax.div(t, n_i) * nq + lo + lax.rem(t, n_i)

    def with_kv(k_s, v_s, bars, w_s, kvseg_s):
        pairs = [(k_g.at[b, hk, keys], k_s), (v_g.at[b, hk, keys], v_s)]
        _copy_in(pairs + ([(segs[1].at[b, keys], kvseg_s)] if segments else []), bars)
        kv_seg = _vector(kvseg_s, 1, interpret) if segments else None  # [bk] int32 rows

        def step(idx, *blocks):
            *blocks, (dk, dv) = blocks
            if interpret:
                q_s, do_s, lse_s, delta_s, qt_s, dot_s, *qseg_s = blocks
            else:
                q_s, do_s, lse_s, delta_s, *qseg_s = blocks
                qt_s, dot_s = q_s.transpose((1, 0)), do_s.transpose((1, 0))
            i = lo + lax.rem(idx[0], n_i)
            st = _mma(k_s, qt_s, (bk, bq)) * jnp.float32(scale)  # Sᵀ [bk, bq] f32
            dpt = _mma(v_s, dot_s, (bk, bq))  # dPᵀ [bk, bq] f32
            lse, delta = (lax.broadcast_in_dim(_vector(r, 0, interpret), st.shape, (1,)) for r in (lse_s, delta_s))
            q_seg = _vector(qseg_s[0], 0, interpret) if segments else None  # [bq] int32 columns
            valid = block_mask(i * bq, j * bk, st.shape, causal, window, interpret, keys_first=True)
            valid = segment_mask(valid, q_seg, kv_seg, st.shape, keys_first=True)
            pt, dst = fm.backward_weights(st, valid, lse, dpt, delta, dtype, native)  # round(Pᵀ), round(dSᵀ)
            dv = _mma_add(dv, _operand(pt, w_s, interpret), do_s, interpret)
            dk = _mma_add(dk, _operand(dst, w_s, interpret), q_s, interpret)
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
            max_concurrent_steps=STAGES,
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


def _validate_backward(q, k, v, q_seg, kv_seg, lse, do, delta, causal, window, block_q, block_k, interpret) -> int:
    _validate_common(q, k, v, q_seg, kv_seg, block_q, block_k, interpret)
    b, h, tq, d = q.shape
    if do.shape != q.shape or do.dtype != q.dtype or lse.shape != (b, h, tq) or delta.shape != (b, h, tq):
        raise ValueError(
            f"need do like q {q.shape} {q.dtype} and lse, delta [B, H, Tq] = {(b, h, tq)}; got do {do.shape} "
            f"{do.dtype}, lse {lse.shape}, delta {delta.shape}"
        )
    if lse.dtype != jnp.float32 or delta.dtype != jnp.float32:
        raise ValueError(f"lse and delta must be float32, got {lse.dtype}, {delta.dtype}")
    if d not in BACKWARD_HEAD_DIMS:
        raise ValueError(
            f"head dim D={d} is not supported by the Mosaic GPU backward; allowed: {BACKWARD_HEAD_DIMS} (its dK/dV "
            f"warpgroup holds dk and dv [64, D] f32, {d} registers per thread, beside the [64, block_k] tiles of "
            "one step: ptxas spills above D = 128)"
        )
    if d * block_k > BACKWARD_TILE_LIMIT:
        raise ValueError(
            f"D={d} with block_k={block_k} is not supported by the Mosaic GPU backward: its [64, block_k] f32 tiles "
            f"beside the [64, D] accumulators exceed a warpgroup's 255 registers per thread (ptxas spills); use "
            f"block_k={BLOCK_KS[0]}"
        )
    check(q, k, block_k, block_q, causal, window)  # the dK/dV kernel's roles: key blocks of block_q rows
    return check(q, k, block_q, block_k, causal, window)


def backward(
    q,
    k,
    v,
    q_seg,
    kv_seg,
    lse,
    do,
    delta,
    *,
    causal: bool,
    scale: float,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_KS[0],
    window: int = 0,
    interpret: bool = False,
):
    """The Mosaic GPU (Hopper) flash-attention backward, as :func:`lpt.kernels.flash_attention.kernel.backward`:
    given lse and δ = rowsum(dO ∘ O_residual) [B, H, Tq] f32, returns f32 (dq [B, H, Tq, D], dk, dv [B, Hkv, Tk,
    D]); the policy enters through lse (its forward) and δ (its residual). Two kernels: dQ, one CTA per (query block
    of ``block_q`` rows, head, batch) over the key blocks of ``key_blocks`` in steps of ``block_k`` keys; dK/dV, one
    CTA per (key block of ``block_q`` rows, kv head, batch) over the G query heads of the kv head and the query blocks
    of ``query_blocks`` in steps of ``block_k`` queries (GQA-native: no [B, H, Tk, D] buffer).

    Args: as :func:`forward` (q_seg, kv_seg: None or int32 segment ids), plus lse, δ [B, H, Tq] f32 and do
    [B, H, Tq, D] in q's dtype; D in :data:`BACKWARD_HEAD_DIMS`, D · block_k <= 8192 (registers); Tq and Tk multiples
    of ``block_q`` and of ``block_k``.
    """
    g = _validate_backward(q, k, v, q_seg, kv_seg, lse, do, delta, causal, window, block_q, block_k, interpret)
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    segments = q_seg is not None
    segs = (q_seg, kv_seg) if segments else ()
    common = dict(causal=causal, window=window, scale=scale, g=g, d=d, segments=segments, interpret=interpret)
    params = _interpret_params() if interpret else None
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
