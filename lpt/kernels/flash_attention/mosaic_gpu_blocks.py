"""What the Mosaic GPU flash attention kernels share (:mod:`lpt.kernels.flash_attention.mosaic_gpu` the forward,
:mod:`lpt.kernels.flash_attention.mosaic_gpu_backward` dQ and dK/dV): tile sizes and limits, shared memory per CTA,
the position and segment masks of a tile, the TMA copies in, the wgmma helpers (from SMEM or, in the interpreter,
via an SMEM tile), a query program's block range, and the checks both entry points make."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lpt.kernels import compat
from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention.tiles import key_blocks

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


def interpret_params():
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
    allocation is rounded up to 1 KiB. No T in it.

    Args:
      d: head dim.
      itemsize, o_itemsize: bytes per element of q/k/v and of O.
      block_k, block_q: key rows per pipeline step and query rows per CTA.
      segments: whether segment ids are passed.
    """
    q = _aligned(block_q * d * itemsize) + segments * _aligned(block_q * 4)
    pipeline = 2 * _aligned(STAGES * block_k * d * itemsize) + segments * _aligned(STAGES * block_k * 4)
    epilogue = _aligned(block_q * d * o_itemsize) + _aligned(block_q * 4)
    return q + max(pipeline + _REDUCTION_SCRATCH, epilogue) + _BARRIER * (1 + segments + STAGES)


def dq_smem_bytes(d: int, itemsize: int, block_k: int, block_q: int = BLOCK_Q, segments: bool = False) -> int:
    """Shared memory of one dQ CTA: the Q and dO blocks, its lse and δ rows (and query segments), then the larger of
    the pipeline's K/V slots (and kv segment slots) and the epilogue's dq tile (f32), and the barriers (each
    allocation rounded up to 1 KiB; the backward reduces nothing, so no reduction scratch). No T in it.

    Args:
      d: head dim.
      itemsize: bytes per element of the inputs.
      block_k, block_q: key rows per pipeline step and query rows per CTA.
      segments: whether segment ids are passed.
    """
    resident = 2 * _aligned(block_q * d * itemsize) + (2 + segments) * _aligned(block_q * 4)
    pipeline = 2 * _aligned(STAGES * block_k * d * itemsize) + segments * _aligned(STAGES * block_k * 4)
    epilogue = _aligned(block_q * d * 4)
    return resident + max(pipeline, epilogue) + _BARRIER * (4 + segments + STAGES)


def dkdv_smem_bytes(d: int, itemsize: int, block_q: int, block_k: int = BLOCK_Q, segments: bool = False) -> int:
    """Shared memory of one dK/dV CTA (``block_k`` key rows; ``block_q`` query rows per pipeline step): the K and V
    blocks (and kv segments), then the larger of the pipeline's Q/dO slots with their lse/δ rows (and query segment
    slots) and the epilogue's dk, dv tiles (f32), and the barriers (each allocation rounded up to 1 KiB). No T in
    it.

    Args:
      d: head dim.
      itemsize: bytes per element of the inputs.
      block_q, block_k: query rows per pipeline step and key rows per CTA.
      segments: whether segment ids are passed.
    """
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
    tiles); True when nothing is masked by position.

    Args:
      q_start, k_start: int32 positions of the block's first query and first key.
      shape: the tile's shape, ``(bq, bk)`` (``(bk, bq)`` with ``keys_first``).
      causal, window: the position rule.
      interpret: True in the Mosaic GPU interpreter (no register layout casts).
      keys_first: the tile has keys as rows (the dK/dV kernel).
    """
    if not causal:
        return True
    q_dim, k_dim = (1, 0) if keys_first else (0, 1)
    q_pos = q_start + _iota(shape, q_dim, interpret)
    k_pos = k_start + _iota(shape, k_dim, interpret)
    return fm.position_mask(q_pos, k_pos, causal, window)


def segment_mask(valid, q_seg, kv_seg, shape, keys_first: bool = False):
    """``valid`` (a block's position mask, or True) and q_seg == kv_seg on the block: q_seg, kv_seg int32 vectors
    along its query and key axis ([bq] rows and [bk] columns of a [bq, bk] tile; the other way round with
    ``keys_first``). ``valid`` itself when there are no segments (None).

    Args:
      valid: the block's position mask (bool, of ``shape``) or True.
      q_seg, kv_seg: int32 segment ids of the block's queries and keys, or None (no segments).
      shape: the tile's shape.
      keys_first: the tile has keys as rows.
    """
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


def forward_init(bq: int, d: int, interpret: bool):
    """The online softmax's starting carry (M = −inf, n = c = ℓ = 0 as [bq] rows, acc = 0 [bq, D]) in the WGMMA
    layouts (interpreter: plain arrays).

    Args:
      bq, d: the query rows and the head dim.
      interpret: True in the Mosaic GPU interpreter (no layout casts).
    """
    layout = (lambda x, _: x) if interpret else plgpu.layout_cast
    row = layout(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    return row - jnp.inf, row, row, row, layout(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)


def logits(q_s, k_t, bk: int, scale: float):
    """S = Q Kᵀ · scale, f32 [bq, bk] in registers (WGMMA layout), by wgmma from SMEM; returns once the wgmma has
    read K (the caller may release K's slot then).

    Args:
      q_s: the Q block [bq, D] in SMEM.
      k_t: Kᵀ [D, bk] as wgmma's B operand: a transposed view of the K slot (interpreter: Kᵀ as stored).
      bk: key rows of the block.
      scale: the logit scale.
    """
    return _mma(q_s, k_t, (q_s.shape[0], bk)) * jnp.float32(scale)


def forward_block(carry, s, v_s, p_s, q_start, k_start, *, options, q_seg, kv_seg):
    """One key block of the Mosaic GPU forward given its logits: the block's position (and segment) mask and
    math.py's online-softmax step (:func:`lpt.kernels.flash_attention.math.forward_step`), its P̃V by wgmma from V in
    SMEM. Returns the new carry. Every Mosaic GPU forward schedule runs this per key block.

    Args:
      carry: (M, n, c, ℓ, acc): [bq] row statistics and acc [bq, D], f32.
      s: the block's logits [bq, bk] (:func:`logits`).
      v_s: the V block [bk, D] in SMEM (its dtype is the P̃V dtype).
      p_s: the interpreter's SMEM tile [bq, bk] for P̃ (None when compiled).
      q_start, k_start: int32 positions of the block's first query and first key.
      options: the :class:`~lpt.kernels.flash_attention.options.FlashOptions` (its policy, position rule and
        ``interpret``: True in the Mosaic GPU interpreter).
      q_seg, kv_seg: [bq] / [bk] int32 segment ids of the block's rows and columns, or None.
    """
    interpret = options.interpret
    valid = block_mask(q_start, k_start, s.shape, options.causal, options.window, interpret)
    valid = segment_mask(valid, q_seg, kv_seg, s.shape)

    def matmul(w):  # w [bq, bk] in the pv dtype -> w V f32 [bq, D]
        return _mma(_operand(w, p_s, interpret), v_s, (s.shape[0], v_s.shape[1]))

    return fm.forward_step(carry, s, valid, matmul, options.policy, jnp.dtype(v_s.dtype), not interpret)


def store_outputs(o, lse, o_s, lse_s, o_g, lse_g, rows, native: bool):
    """A forward's epilogue: ``o`` (f32 [bq, D], rounded to nearest into O's dtype) and ``lse`` (f32 [bq]) through
    the SMEM tiles ``o_s``, ``lse_s`` into ``o_g[rows]`` / ``lse_g[rows]`` (GMEM refs already indexed by batch and
    head) by TMA, waited on.

    Args:
      o, lse: the finalized rows (:func:`lpt.kernels.flash_attention.math.finalize`).
      o_s, lse_s: SMEM tiles of O's dtype [bq, D] and f32 [bq].
      o_g, lse_g: the GMEM outputs at (b, h): [Tq, D] and [Tq].
      rows: the query rows (a ``pl.ds``).
      native: the hardware RNE convert (compiled) or lpt.numerics' bit-exact rounding (interpreter).
    """
    o_s[...] = fm.round_to(o, o_s.dtype, native)  # f32 -> O dtype (RNE; a no-op for f32)
    lse_s[...] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_g.at[rows])
    plgpu.copy_smem_to_gmem(lse_s, lse_g.at[rows])
    plgpu.wait_smem_to_gmem(0)


def launch(kernel, out_type, grid, name: str, interpret: bool, **threads):
    """``plgpu.kernel`` of a forward over ``grid`` = (query blocks, heads, batch), named ("q", "h", "b"), compiled
    for CUDA or run in the Mosaic GPU interpreter.

    Args:
      kernel: the per-CTA kernel function.
      out_type: the outputs' ``jax.ShapeDtypeStruct`` (or a tuple of them).
      grid: (query blocks, heads, batch).
      name: the kernel's name in the compiled program.
      interpret: True runs the Mosaic GPU interpreter; False compiles for CUDA.
      **threads: ``num_threads`` and ``thread_name`` of a warp-specialized kernel.
    """
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=grid,
        grid_names=("q", "h", "b"),
        kernel_name=name,
        interpret=interpret_params() if interpret else None,
        **threads,
    )


def forward_launch(q, k, options, *, g):
    """What both forwards' launches share: the static keywords of the per-CTA kernel (``options, nq, nk, g, d``; nq,
    nk the query and key blocks of 64 and ``options.block_k`` rows), the output types (O in the input dtype when
    ``options.policy.residual == "input"``, else f32; lse f32 [B, H, Tq]) and K as the kernel reads it (stored
    transposed for the interpreter's wgmma). Returns ``(static, out_type, k_op)``.

    Args:
      q: [B, H, Tq, D].
      k: [B, Hkv, Tk, D].
      options: the forward's :class:`~lpt.kernels.flash_attention.options.FlashOptions`.
      g: query heads per kv head (GQA).
    """
    b, h, tq, d = q.shape
    o_dtype = q.dtype if options.policy.residual == "input" else jnp.float32  # bf16 O halves the write if it suffices
    static = dict(options=options, g=g, d=d, nq=tq // BLOCK_Q, nk=k.shape[2] // options.block_k)
    out_type = (jax.ShapeDtypeStruct((b, h, tq, d), o_dtype), jax.ShapeDtypeStruct((b, h, tq), jnp.float32))
    return static, out_type, jnp.swapaxes(k, 2, 3) if options.interpret else k


def _query_program(nq, nk, g, bq, bk, causal, window):
    """This CTA's query block i (the last first: the causal blocks with the longest ranges start first), head h,
    batch b, kv head hk = h // G (GQA), its key-block range [first, end) and its rows of Tq."""
    i = nq - 1 - lax.axis_index("q")
    h, b = lax.axis_index("h"), lax.axis_index("b")
    hk = lax.div(h, jnp.int32(g))
    first, end = key_blocks(i, bq=bq, bk=bk, nk=nk, causal=causal, window=window)
    return i, h, b, hk, first, end, pl.ds(pl.multiple_of(i * bq, bq), bq)


def _validate_common(q, k, v, q_seg, kv_seg, options) -> None:
    """The checks the forward and the backward share."""
    block_q, block_k, interpret = options.block_q, options.block_k, options.interpret
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
