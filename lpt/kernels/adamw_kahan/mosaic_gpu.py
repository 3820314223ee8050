"""Hopper variant of the fused AdamW + Kahan step, 16-bit and 8-bit moments: Mosaic GPU, TMA copies.

The same per-element math as the Pallas kernel (:func:`~lpt.kernels.adamw_kahan.math.leaf_math`), on the same 2-D
operands that :func:`lpt.kernels.adamw_kahan.kernel.adamw_kahan` prepares (a leaf as ``(rows, width)``: its ``(m, n)``
view, or flattened and zero-padded to ``(rows, 128)``)::

    CTA (i, j) owns rows [i·S·br, (i+1)·S·br) of the 128 columns [128 j, 128 j + 128)
    for s in 0 .. S-1:                               # emit_pipeline: the TMA copies of block s+1 overlap step s
        g, p, c, mv <- SMEM (br, 128) tiles         # one TMA copy each
        p', c', mv' = leaf_math(...)                 # registers, one warpgroup, f32
        SMEM slot s mod 2 <- p', c', mv'  ->  TMA copies to HBM, in place (outputs aliased to p, c, mv)

16-bit moments: blocks of 16 rows in a strided register layout. 8-bit moments (:func:`adamw_kahan8_mgpu`): blocks of
64 rows in the WGMMA layout (one block of 128 per row), whose rows' amax are register row reductions and whose scales
are ``[64]`` row vectors (the math takes them as such: ``lpt.kernels.fp8_codes_math.per_block``); a CTA reads its
scales before its pipeline and writes them back after it, and its outputs go through one slot (the SMEM of two
input slots of four (64, 128) tiles is most of the 227 KiB).

Each element's stochastic bits hash its flat index in the leaf (``(row·width + column)``, mapped through the shard's
index map on a mesh), so the bits are those of the XLA twin and of the Pallas kernel. The square roots are
rounded to nearest by :func:`lpt.kernels.sqrt_math.sqrt_rn` (the kernel's own ``sqrt`` compiles to PTX's
``sqrt.approx.f32``, which left the compensation of 0.03% of elements a few bits from the twin's on an H200); the
f32 division compiles to ``div.full.f32`` here as in XLA:GPU (which sets ``-nvptx-prec-divf32=1`` for the process).
So the results are the twin's bit for bit where the twin divides as the kernel does (XLA:CPU turns some divisions by
a broadcast block scale into multiplications by its reciprocal).

The kernels compile for a B200 (sm_100a) too, but run only on Hopper: Blackwell keeps the Triton kernel until one runs
them (and jax's deviceless compiles of Mosaic GPU kernels for two architectures in one process are not reliable: a
B200 compile can leave ptxas the wrong target for a later H100 one).

``p``, ``c`` and ``mv`` are updated in place (:func:`lpt.kernels.compat.mgpu_in_place`): a CTA reads each block before
it writes it. ``options.interpret=True`` runs the Mosaic GPU interpreter on CPU; register layout casts are skipped
there (they only annotate layouts). ``options.interpret=None`` lowers for CUDA only (custom call ``mosaic_gpu_v2``).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lpt.kernels import compat
from lpt.kernels.adamw_kahan.math import leaf_math, leaf_math8, shard_index_map
from lpt.kernels.adamw_kahan.options import LANES, StepOptions

__all__ = ["adamw_kahan8_mgpu", "adamw_kahan_mgpu"]

_MGPU_BLOCK_ROWS = 16  # rows of 128 per step: 2K elements, 16 per thread of the warpgroup per array
_MGPU_BLOCK_ROWS_8BIT = 64  # 8-bit moments: one WGMMA-layout tile, whose rows' amax are register row reductions
_MGPU_MAX_STEPS = 8  # blocks per CTA, pipelined (two in flight)
_TMA_MAX = 256  # elements along one dimension of a TMA copy
_WORDS = 32  # the scalars and the key words travel as 32-word arrays: a TMA copy moves a multiple of 128 bytes


def _scalars(sc_g, w_g, sc_s, w_s, bar, zero_layout, shape, n_words):
    """Copy the scalars and key words into SMEM; returns ``(scalars, words, offset)`` with the runtime zero as a
    register array of ``shape`` (jax 0.12 lowers a scalar bitcast f32 -> u32 to a 0-d vector)."""
    plgpu.copy_gmem_to_smem(sc_g, sc_s, bar)
    plgpu.copy_gmem_to_smem(w_g, w_s, bar)
    plgpu.barrier_wait(bar)
    zero = zero_layout(jnp.broadcast_to(sc_s[3], shape))
    return (sc_s[0], sc_s[1], sc_s[2], zero), tuple(w_s[k] for k in range(n_words)), w_s[n_words]


def _flat_index(stochastic, first_row, col0, shape, width, layout, index_map):
    """The flat index in the leaf of every element of the ``shape`` block whose first element is at
    ``(first_row, col0)`` of the ``(rows, width)`` view, mapped by a shard's ``index_map`` (or None); None when the
    moments round to nearest (``stochastic`` False: nothing is hashed)."""
    if not stochastic:
        return None
    iota = lambda d: layout(lax.broadcasted_iota(jnp.uint32, shape, d))
    first = (first_row * width + col0).astype(jnp.uint32)  # int32 -> u32
    idx = first + (iota(0) * jnp.uint32(width) + iota(1))
    return idx if index_map is None else index_map(idx)


def _swizzled(dtype):
    """The SMEM transforms of a ``(rows, 128)`` tile of ``dtype`` that WGMMA-layout loads and stores read without
    bank conflicts (128-byte swizzled rows of 8-row tiles)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(LANES * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _cta(cta, sc_g, w_g, g_g, p_g, c_g, mv_g, *outs, steps, br, width, options, shapes, interpret):
    """CTA ``cta = (i, j)``: its ``steps`` blocks of ``(br, 128)``, read from ``(g, p, c, mv)`` and written to
    ``outs`` (the refs of ``p', c', mv'``)."""
    i, j = cta
    row0, col0 = i * (steps * br), j * LANES
    rows, cols = pl.ds(row0, steps * br), pl.ds(col0, LANES)
    strided = plgpu.Layout.WG_STRIDED((br, LANES), vec_size=2)
    layout = (lambda x: x) if interpret else (lambda x: plgpu.layout_cast(x, strided))
    load = (lambda r: r[...]) if interpret else (lambda r: compat.mgpu_load(r, layout=strided))

    def scoped(sc_s, w_s, bar, *slots):
        scalars, words, offset = _scalars(sc_g, w_g, sc_s, w_s, bar, layout, (br, LANES), 2)
        index_map = None if shapes is None else shard_index_map(*shapes, offset)

        def body(idx, g_s, p_s, c_s, mv_s):
            (s,) = idx
            index = _flat_index(options.stochastic, row0 + s * br, col0, (br, LANES), width, layout, index_map)
            new = leaf_math(*(load(r) for r in (g_s, p_s, c_s, mv_s)), scalars, words, options=options, index=index)
            slot = lax.rem(s, 2)
            plgpu.wait_smem_to_gmem(len(outs), wait_read_only=True)  # step s-2's copies out of this slot have read it
            for buf, x in zip(slots, new, strict=True):
                buf.at[slot][...] = x
            plgpu.commit_smem()
            block = pl.ds(row0 + s * br, br)
            for buf, out in zip(slots, outs, strict=True):
                plgpu.copy_smem_to_gmem(buf.at[slot], out.at[block, cols])

        tile = plgpu.BlockSpec((br, LANES), lambda s: (s, 0))
        plgpu.emit_pipeline(body, grid=(steps,), in_specs=[tile] * 4, max_concurrent_steps=2)(
            *(x.at[rows, cols] for x in (g_g, p_g, c_g, mv_g))
        )
        plgpu.wait_smem_to_gmem(0)

    slots = [plgpu.SMEM((2, br, LANES), r.dtype) for r in outs]
    words = (plgpu.SMEM((_WORDS,), jnp.float32), plgpu.SMEM((_WORDS,), jnp.uint32))
    pl.run_scoped(scoped, *words, plgpu.Barrier(num_arrivals=2), *slots)


def _cta8(cta, sc_g, w_g, g_g, p_g, c_g, cd_g, ms_g, vs_g, *outs, steps, width, options, shapes, interpret):
    """8-bit moments, CTA ``cta = (i, j)``: its ``steps`` blocks of ``(64, 128)`` (one block of 128 per row) in the
    WGMMA layout, the rows' scales as ``[64]`` row vectors; ``outs`` are the refs of ``p', c', codes', ms', vs'``
    (the scales ``[cols, rows]``: column block j's scales contiguous)."""
    i, j = cta
    br = _MGPU_BLOCK_ROWS_8BIT
    row0, col0 = i * (steps * br), j * LANES
    rows, cols = pl.ds(row0, steps * br), pl.ds(col0, LANES)
    wgmma, row = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)
    layout = (lambda x: x) if interpret else (lambda x: plgpu.layout_cast(x, wgmma))
    load = (lambda r, _: r[...]) if interpret else (lambda r, lay: compat.mgpu_load(r, layout=lay))
    tiled = (lambda _: ()) if interpret else _swizzled

    def scoped(sc_s, w_s, bar, ms_s, vs_s, *slots):
        for k in range(chunks):  # this CTA's scales, read before the pipeline (TMA: <= 256 per copy)
            part = pl.ds(k * size, size)
            plgpu.copy_gmem_to_smem(ms_g.at[j, rows].at[part], ms_s.at[part], bar)
            plgpu.copy_gmem_to_smem(vs_g.at[j, rows].at[part], vs_s.at[part], bar)
        scalars, words, offset = _scalars(sc_g, w_g, sc_s, w_s, bar, layout, (br, LANES), 4)
        index_map = None if shapes is None else shard_index_map(*shapes, offset)

        def body(idx, g_s, p_s, c_s, cd_s):
            (s,) = idx
            index = _flat_index(options.stochastic, row0 + s * br, col0, (br, LANES), width, layout, index_map)
            block = pl.ds(s * br, br)
            leaf = [load(r, wgmma) for r in (g_s, p_s, c_s, cd_s)]
            scales = tuple(load(r.at[block], row) for r in (ms_s, vs_s))
            new = leaf_math8(*leaf, scales, scalars, words, options=options, index=index)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # step s-1's copies out of the slots have read them
            for buf, x in zip(slots, new[:3], strict=True):
                buf[...] = x
            for buf, x in zip((ms_s, vs_s), new[3:], strict=True):  # each step's scales in place: read above
                buf.at[block][...] = x
            plgpu.commit_smem()
            for buf, out in zip(slots, outs[:3], strict=True):
                plgpu.copy_smem_to_gmem(buf, out.at[pl.ds(row0 + s * br, br), cols])

        leaf = (g_g, p_g, c_g, cd_g)
        specs = [plgpu.BlockSpec((br, LANES), lambda s: (s, 0), transforms=tiled(x.dtype)) for x in leaf]
        plgpu.emit_pipeline(body, grid=(steps,), in_specs=specs, max_concurrent_steps=2)(
            *(x.at[rows, cols] for x in leaf)
        )
        plgpu.commit_smem()
        for k in range(chunks):
            part = pl.ds(k * size, size)
            for buf, out in zip((ms_s, vs_s), outs[3:], strict=True):
                plgpu.copy_smem_to_gmem(buf.at[part], out.at[j, rows].at[part])
        plgpu.wait_smem_to_gmem(0)

    size = min(_TMA_MAX, steps * br)  # the scales' TMA copies: steps * br is 64 times a power of two
    chunks = steps * br // size
    slots = [plgpu.SMEM((br, LANES), r.dtype, transforms=tiled(r.dtype)) for r in outs[:3]]
    scales = [plgpu.SMEM((steps * br,), jnp.float32)] * 2
    words = (plgpu.SMEM((_WORDS,), jnp.float32), plgpu.SMEM((_WORDS,), jnp.uint32))
    pl.run_scoped(scoped, *words, plgpu.Barrier(num_arrivals=2 + 2 * chunks), *scales, *slots)


def adamw_kahan_mgpu(sc, w, g2, p2, c2, mv2, *, options: StepOptions, shapes=None, block_rows: int = _MGPU_BLOCK_ROWS):
    """Mosaic GPU kernel: ``(g, p, c, mv) -> (p', c', mv')`` on ``(rows, width)`` operands, 16-bit moments.

    Args:
      sc: f32[4] ``(1/c1, 1/c2, -lr, 0)``.
      w: uint32[3] ``(k0, k1, offset)``: the moments' raw key and the global flat index of the leaf's first element
        (0 unless ``shapes``).
      g2, p2, c2, mv2: the leaf as ``(rows, width)``: gradient (bf16 or f32), bf16 param, bf16 compensation, packed
        bf16 moments (uint32); ``width`` a multiple of 128 and ``rows`` of ``block_rows``.
      options: the step's :class:`~lpt.kernels.adamw_kahan.options.StepOptions`; ``options.interpret`` None lowers for
        CUDA (Hopper), True runs the Mosaic GPU interpreter (CPU tests); its ``block_rows`` is not read here.
      shapes: ``(local_shape, global_shape)`` of a shard of a leaf (the stochastic rounding hashes global flat
        indices), or None.
      block_rows: rows of 128 per pipeline step, a power of two >= 8.
    """
    compat.ensure_mgpu_math()
    rows, width = p2.shape
    if width % LANES or block_rows < 8 or block_rows & (block_rows - 1) or rows % block_rows:
        raise ValueError(
            f"adamw_kahan_mgpu needs (rows, width) operands with width a multiple of {LANES} and rows of whole blocks "
            f"of block_rows (a power of two >= 8); got {p2.shape} with block_rows={block_rows}"
        )
    blocks = rows // block_rows
    steps = min(_MGPU_MAX_STEPS, blocks & -blocks)  # the largest power of two <= _MGPU_MAX_STEPS dividing the blocks
    sc32 = jnp.pad(sc, (0, _WORDS - sc.shape[0]))
    w32 = jnp.pad(w, (0, _WORDS - w.shape[0]))
    interpret = bool(options.interpret)
    kernel = functools.partial(
        _cta, steps=steps, br=block_rows, width=width, options=options, shapes=shapes, interpret=interpret
    )
    return compat.mgpu_in_place(
        kernel,
        *(sc32, w32, g2, p2, c2, mv2),
        n_in_place=3,  # p, c, mv
        grid=(blocks // steps, width // LANES),
        grid_names=("i", "j"),
        name="lpt_adamw_kahan",
        interpret=interpret,
    )


def adamw_kahan8_mgpu(sc, w, g2, p2, c2, codes2, scales, *, options: StepOptions, shapes=None):
    """Mosaic GPU kernel with 8-bit moments: ``(g, p, c, codes, (ms, vs)) -> (p', c', codes', ms', vs')`` on
    ``(rows, width)`` operands, one block of 128 per row of each column block.

    Args:
      sc: f32[4] ``(1/c1, 1/c2, -lr, 0)``.
      w: uint32[5] ``(m's k0, k1, v's k0, k1, offset)``: the moments' raw keys and the global flat index of the
        leaf's first element (0 unless ``shapes``).
      g2, p2, c2, codes2: the leaf as ``(rows, width)``: gradient (bf16 or f32), bf16 param, bf16 compensation, the
        moments' FP8 codes (uint16, m's high); ``width`` a multiple of 128, ``rows`` of 64.
      scales: ``(ms, vs)``, f32 ``[width / 128, rows]``: m's and v's scale of each row's block of 128 in each column
        block.
      options: the step's :class:`~lpt.kernels.adamw_kahan.options.StepOptions`, with ``moments8``;
        ``options.interpret`` None lowers for CUDA (Hopper), True runs the Mosaic GPU interpreter (CPU tests).
      shapes: ``(local_shape, global_shape)`` of a shard of a leaf, or None.
    """
    compat.ensure_mgpu_math()
    ms, vs = scales
    rows, width = p2.shape
    br = _MGPU_BLOCK_ROWS_8BIT
    if width % LANES or rows % br or ms.shape != (width // LANES, rows) or vs.shape != ms.shape:
        raise ValueError(
            f"adamw_kahan8_mgpu needs (rows, width) operands with width a multiple of {LANES} and rows of {br}, and "
            f"scales [width / {LANES}, rows]; got {p2.shape}, scales {ms.shape} and {vs.shape}"
        )
    blocks = rows // br
    steps = min(_MGPU_MAX_STEPS, blocks & -blocks)
    sc32 = jnp.pad(sc, (0, _WORDS - sc.shape[0]))
    w32 = jnp.pad(w, (0, _WORDS - w.shape[0]))
    interpret = bool(options.interpret)
    kernel = functools.partial(_cta8, steps=steps, width=width, options=options, shapes=shapes, interpret=interpret)
    return compat.mgpu_in_place(
        kernel,
        *(sc32, w32, g2, p2, c2, codes2, ms, vs),
        n_in_place=5,  # p, c, codes, ms, vs
        grid=(blocks // steps, width // LANES),
        grid_names=("i", "j"),
        name="lpt_adamw_kahan8",
        interpret=interpret,
    )
