"""Fused AdamW + Kahan update of bf16 params with 16-bit or 8-bit moments as one Pallas kernel per leaf.

The math (the update equations, :func:`~lpt.kernels.adamw_kahan.math.moment_update`, ``round_moments``,
``kahan_target``, ``kahan_round``) and the kernel's XLA twin (``adamw_kahan_reference``) are in
:mod:`lpt.kernels.adamw_kahan.math`, pure jnp, which the XLA path (``lpt.optim.kahan_adamw(impl="xla")``) calls as
well, so the two agree bit for bit (tested in interpret mode).

:func:`adamw_kahan` makes one pass over ``(g, p, c, mv)`` -> ``(p', c', mv')`` with the outputs aliased to the
inputs. Memory traffic: reads 2+2+2+4, writes 2+2+4 = 18 bytes/param (an f32-master AdamW moves 14 + 12 + a bf16
compute copy = 28). A leaf whose last axis is several 128s and whose rows (the other axes) split into blocks of
16 (8-bit moments: of 1024, or one block of a power of two >= 128) is tiled in place, ``(rows, 128)`` tiles of its
``(m, n)`` view on a 2-D grid (on a TPU a reshape into ``(rows, 128)`` rows would be a relayout of every array);
other leaves are flattened and zero-padded to whole ``(rows, 128)`` blocks, the padding sliced off. Stochastic
moment rounding draws one ``hash_bits`` word per element from its global flat index (block base + in-block
index, mapped back to the row-major position on the 2-D grid, or a shard's global index map), so the kernel draws
the same bits as the XLA path. The platform switch is :mod:`lpt.kernels.dispatch`; per-shard wrappers are in
:mod:`lpt.kernels.adamw_kahan.sharded`.

8-bit moments (``StepOptions.moments8 = (m_format, v_format, v_sqrt)``, :mod:`lpt.optim.moments8`): ``mv`` is the uint16
pair of FP8 codes per element and ``scales`` one complex64 per block of 128 along the last axis (m's scale real, v's
imaginary). The last axis must be a multiple of 128: a ``(rows, 128)`` tile row is then exactly one block, and the
kernel requantizes each row from its own amax (:func:`~lpt.kernels.adamw_kahan.math.leaf_math8`). The scales enter as
two f32 arrays, lane-dense ``(rows / 128, 128)`` on TPU and in the interpreter (:func:`_chunks8`; a ``(rows, 1)`` f32
array would be tiled (8, 128) in TPU memory, 128 times its size) and ``(rows, 1)`` columns on Triton (the same bytes,
row-major). Memory traffic: reads g 2, p 2, c 2, codes 2, scales 8/128; writes p 2, c 2, codes 2, scales 8/128 = 14.125
bytes/param (18 with 16-bit moments). Stochastic rounding hashes the element's global flat index with m's and v's key
words (``words`` uint32[4]), one word per moment and element: what ``round_stochastic`` draws for the blocked leaf.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lpt.kernels import dispatch
from lpt.kernels.adamw_kahan.math import (
    flat_index,
    leaf_math,
    leaf_math8,
    shard_index_map,
)
from lpt.kernels.adamw_kahan.mosaic_gpu import adamw_kahan8_mgpu, adamw_kahan_mgpu
from lpt.kernels.adamw_kahan.options import LANES, StepOptions, check_leaf

__all__ = ["adamw_kahan"]


def _grid2d_index_map(m: int, n: int, outer):
    """Flat index map of the 2-D grid over an ``(m, n)`` view: tile ``(i, j)``'s element ``(r, c)`` has the virtual
    index ``v = j·m·128 + (i·br + r)·128 + c`` (column blocks one after another), whose row-major index in the view
    is ``(v / 128 mod m)·n + (v / (m·128))·128 + v mod 128``; ``outer`` (a shard's map, or None) maps that on."""
    rows_m, block_col = jnp.uint32(m), jnp.uint32(m * LANES)

    def index_map(v):
        f = ((v >> 7) % rows_m) * jnp.uint32(n) + (v // block_col) * jnp.uint32(LANES) + (v & jnp.uint32(LANES - 1))
        return f if outer is None else outer(f)

    return index_map


def _kernel(sc_ref, w_ref, g_ref, p_ref, c_ref, mv_ref, *refs, block, options, shapes, chunked, grid2d=None):
    """One tile. 16-bit moments: ``refs`` = the outputs ``(p, c, mv)``; 8-bit: the scales ``(ms, vs)``, then the
    outputs ``(p, c, codes, ms, vs)``, the scales as ``(rows, 1)`` columns (Triton) or lane-dense ``(rows / 128,
    128)`` rows (Mosaic and the interpreter: see :func:`_chunks8`). ``grid2d`` = ``(m, n)``: the tiles are ``(rows,
    128)`` blocks of an ``(m, n)`` view on a 2-D grid (:func:`_grid2d_index_map`), else of the flattened leaf."""
    eight_bit = options.moments8 is not None
    scalars = (sc_ref[0], sc_ref[1], sc_ref[2], sc_ref[3])
    nw = 4 if eight_bit else 2  # key words: m's and v's (8-bit) or one key for both moments
    words = tuple(w_ref[i] for i in range(nw))
    index_map = None if shapes is None else shard_index_map(*shapes, w_ref[nw])
    if not options.stochastic:
        base = None
    elif grid2d is None:
        base = (pl.program_id(0) * block).astype(jnp.uint32)  # int32 -> u32
    else:
        m, n = grid2d
        col = pl.program_id(1).astype(jnp.uint32) * jnp.uint32(m * LANES)  # int32 -> u32
        base = col + pl.program_id(0).astype(jnp.uint32) * jnp.uint32(block)  # int32 -> u32
        index_map = _grid2d_index_map(m, n, index_map)
    if chunked:
        ctx = dict(scalars=scalars, words=words, base=base, index_map=index_map, options=options)
        _chunks8(g_ref, p_ref, c_ref, mv_ref, *refs, **ctx)
        return
    leaf = (g_ref[...], p_ref[...], c_ref[...], mv_ref[...])
    index = None if base is None else flat_index(p_ref.shape, base, index_map)
    if eight_bit:
        ms_ref, vs_ref, *outs = refs
        new = leaf_math8(*leaf, (ms_ref[...], vs_ref[...]), scalars, words, options=options, index=index)
    else:
        outs = refs
        new = leaf_math(*leaf, scalars, words, options=options, index=index)
    for ref, x in zip(outs, new, strict=True):
        ref[...] = x


def _chunks8(g_ref, p_ref, c_ref, mv_ref, ms_ref, vs_ref, *outs, scalars, words, base, index_map, options):
    """8-bit moments with lane-dense scales: scale row ``a`` holds the scales of the tile's rows ``128a ..
    128a + 127``, and the tile is updated in chunks of 128 rows. A chunk's scales become a column by a broadcast and
    a 128 x 128 transpose, and its new scales (a column: the rows' amax) a row the same way: exact data movement,
    so the numbers are those of :func:`leaf_math8` on ``(rows, 1)`` columns."""
    p_out, c_out, mv_out, ms_out, vs_out = outs
    square = (LANES, LANES)
    for a in range(ms_ref.shape[0]):
        rows = slice(a * LANES, (a + 1) * LANES)
        leaf = tuple(ref[rows, :] for ref in (g_ref, p_ref, c_ref, mv_ref))
        ms, vs = (jnp.transpose(jnp.broadcast_to(ref[a : a + 1, :], square)) for ref in (ms_ref, vs_ref))
        index = None if base is None else flat_index(square, base + jnp.uint32(a * LANES * LANES), index_map)
        new = leaf_math8(*leaf, (ms, vs), scalars, words, options=options, index=index)
        for ref, x in zip((p_out, c_out, mv_out), new[:3], strict=True):
            ref[rows, :] = x
        for ref, col in zip((ms_out, vs_out), new[3:], strict=True):
            ref[a : a + 1, :] = jnp.transpose(jnp.broadcast_to(col, square))[0:1, :]


def _pallas(sc, w, g2, p2, c2, mv2, *scales, block_rows, options, shapes, mode):
    if mode == "mosaic_gpu" and scales:  # lane-dense scales are [cols, rows] row-major: reshapes are bitcasts
        cols = p2.shape[1] // LANES
        ms, vs = (s.reshape(cols, -1) for s in scales)
        outs = adamw_kahan8_mgpu(sc, w, g2, p2, c2, mv2, (ms, vs), options=options, shapes=shapes)
        return (*outs[:3], *(s.reshape(scales[0].shape) for s in outs[3:]))
    if mode == "mosaic_gpu":
        return adamw_kahan_mgpu(sc, w, g2, p2, c2, mv2, options=options, shapes=shapes, block_rows=block_rows)
    rows, n = p2.shape[0], p2.size
    cols = p2.shape[1] // LANES  # > 1: an (m, n) view of the leaf on a 2-D grid (16-bit moments)
    tile = pl.BlockSpec((block_rows, LANES), (lambda i: (i, 0)) if cols == 1 else (lambda i, j: (i, j)))
    columns = mode == "triton"  # 8-bit moments' scales: (rows, 1) columns on Triton, lane-dense rows elsewhere
    # the scales of the 2-D grid come column block by column block: (cols, rows / 128, 128), one per tile column
    dense_shape = scales[0].shape if scales else None
    if scales and columns:
        scales = tuple(s.reshape(-1, 1) for s in scales)  # lane-dense -> one (rows·cols, 1) column: a bitcast
        per_col = rows // block_rows  # row blocks of one column block
        scale_spec = pl.BlockSpec(
            (block_rows, 1), (lambda i: (i, 0)) if cols == 1 else (lambda i, j: (j * per_col + i, 0))
        )
    elif cols == 1:
        scale_spec = pl.BlockSpec((block_rows // LANES, LANES), lambda i: (i, 0))
    else:
        scale_spec = pl.BlockSpec((None, block_rows // LANES, LANES), lambda i, j: (j, i, 0))
    if mode == "mosaic":
        scalar_specs = [pl.BlockSpec(memory_space=pltpu.SMEM)] * 2
    else:
        scalar_specs = [pl.BlockSpec((4,), lambda *_: (0,)), pl.BlockSpec(w.shape, lambda *_: (0,))]
    chunked = bool(scales) and not columns
    grid2d = None if cols == 1 else p2.shape
    kernel = functools.partial(
        _kernel, block=block_rows * LANES, options=options, shapes=shapes, chunked=chunked, grid2d=grid2d
    )
    leaf_out = [jax.ShapeDtypeStruct(p2.shape, jnp.bfloat16), jax.ShapeDtypeStruct(c2.shape, jnp.bfloat16)]
    leaf_out.append(jax.ShapeDtypeStruct(mv2.shape, mv2.dtype))
    scale_out = [jax.ShapeDtypeStruct(s.shape, jnp.float32) for s in scales]
    g_bytes = g2.dtype.itemsize
    if scales:
        # per element: ~130 elementwise flops (two hashes, two requantizations), two sqrt and three divisions;
        # reads g, p, c, the codes (2 bytes) and 2 f32 scales per 128; writes p, c, the codes and the scales
        cost = pl.CostEstimate(
            flops=130 * n, transcendentals=5 * n, bytes_accessed=n * (g_bytes + 2 + 2 + 2 + 2 + 2 + 2) + n // LANES * 16
        )
    else:
        # per element: ~40 elementwise flops, one sqrt; reads g, p, c, mv and writes p, c, mv
        cost = pl.CostEstimate(flops=40 * n, transcendentals=n, bytes_accessed=n * (g_bytes + 2 + 2 + 4 + 2 + 2 + 4))
    aliases = {3 + i: i for i in range(3 + len(scales))}  # p, c, mv (and the scales) updated in place
    outs = pl.pallas_call(
        kernel,
        grid=(rows // block_rows,) if cols == 1 else (rows // block_rows, cols),
        in_specs=[*scalar_specs, tile, tile, tile, tile, *[scale_spec] * len(scales)],
        out_specs=[tile, tile, tile, *[scale_spec] * len(scales)],
        out_shape=[*leaf_out, *scale_out],
        input_output_aliases=aliases,
        name="lpt_adamw_kahan8" if scales else "lpt_adamw_kahan",
        cost_estimate=cost,
        **dispatch.mode_kwargs(mode, grid_rank=1 if cols == 1 else 2),
    )(sc, w, g2, p2, c2, mv2, *scales)
    if scales and columns:
        outs = (*outs[:3], *(s.reshape(dense_shape) for s in outs[3:]))  # the column -> lane-dense, a bitcast
    return outs


_TPU_BLOCK_ROWS = 512  # 64K elements per program: ~1.2 MB of VMEM per buffer set, double-buffered
_TPU_BLOCK_ROWS_8BIT = 1024  # 8-bit moments: 128K elements, whose scales are one (8, 128) f32 tile per moment
# (a leaf of fewer rows is one block of the next power of two >= 128 rows)
_TRITON_BLOCK_ROWS = 16  # 2K elements per program: 16 per thread with 4 warps (a big block would spill registers)


def adamw_kahan(g, p, c, mv, scalars, words, scales=None, *, options: StepOptions, shard=None):
    """Pallas kernel: one pass ``(g, p, c, mv) -> (p', c', mv')`` for one leaf of any shape (see module doc); with
    8-bit moments ``(g, p, c, mv, scales) -> (p', c', mv', scales')``.

    Args:
      g, p, c, mv: gradient (any float dtype), bf16 param, bf16 compensation, packed bf16 moments (uint32), or
        with ``options.moments8`` the two moments' FP8 codes (uint16, m's high: ``lpt.optim.moments8.pack_codes``).
      scalars: f32[4] ``(1/c1, 1/c2, -lr, 0)`` (the 0 is :func:`no_fma`'s runtime zero).
      words: uint32[2], the raw key of the moments' stochastic rounding (see :func:`round_moments`); with
        ``options.moments8`` uint32[4], m's key words then v's.
      scales: 8-bit moments: complex64 ``p.shape[:-1] + (p.shape[-1] // 128,)``, m's and v's scale per block of 128
        of the last axis (which must be a multiple of 128); None: 16-bit moments.
      options: the step's :class:`~lpt.kernels.adamw_kahan.options.StepOptions`: the hyperparameters, the moments'
        rounding and 8-bit formats, compiled into the kernel, and how the kernel runs. ``options.block_rows`` None:
        per platform, :data:`_TPU_BLOCK_ROWS` on TPU and in the interpreter, :data:`_TRITON_BLOCK_ROWS` on CUDA
        (either shrinks for small leaves); 8-bit moments on TPU and in the interpreter: at least
        :data:`_TPU_BLOCK_ROWS_8BIT` (whole (8, 128) scale tiles), or one block of the leaf's rows (at least 128)
        when it has fewer. ``options.interpret`` None picks per platform (:func:`lpt.kernels.dispatch.platform_call`):
        interpreter on CPU, Mosaic on TPU, and on CUDA Mosaic GPU (:mod:`lpt.kernels.adamw_kahan.mosaic_gpu`) on
        Hopper, else Triton; True runs the Pallas interpreter on every platform.
      shard: ``(global_shape, offset)``: the arrays are one shard of a leaf of ``global_shape`` whose first element
        has global flat index ``offset`` (u32 scalar); the stochastic rounding hashes each element's global flat
        index, so the bits do not depend on the sharding. None: the arrays are the whole leaf.
    """
    check_leaf(g, p, c, mv, scalars, words, scales, options=options)
    if shard is not None and len(shard) != 2:
        raise ValueError(f"shard must be (global_shape, offset) or None, got {shard!r}")
    global_shape, offset = (None, None) if shard is None else shard
    shapes = None if global_shape is None or tuple(global_shape) == p.shape else (p.shape, tuple(global_shape))
    extra = jnp.zeros((1,), jnp.uint32) if offset is None else jnp.reshape(offset, (1,)).astype(jnp.uint32)  # -> u32
    words = jnp.concatenate([words, extra])  # (k0, k1, offset)
    block_rows = options.block_rows
    n = math.prod(p.shape)
    eight_bit = options.moments8 is not None
    if n == 0:
        return (p, c, mv, scales) if eight_bit else (p, c, mv)
    rows = -(-n // LANES)
    fit = max(16, 1 << (rows - 1).bit_length())  # blocks never exceed the next power of two of the leaf's rows
    big = min(_TPU_BLOCK_ROWS if block_rows is None else block_rows, fit)
    if eight_bit:  # lane-dense scales: whole (8, 128) tiles of them per block, or one block holding the whole leaf
        big = max(_TPU_BLOCK_ROWS_8BIT, block_rows or 0)
        big = big if rows > big else max(LANES, fit)  # one block: its (rows / 128, 128) scales are the whole array
    small = min(_TRITON_BLOCK_ROWS if block_rows is None else block_rows, fit)
    rows_pad = -(-rows // big) * big  # a multiple of both block sizes (powers of two, small <= big)
    width = p.shape[-1] if p.ndim >= 2 else 0
    view_rows = n // width if width else 0
    tall = view_rows & -view_rows  # the largest power of two dividing the view's rows
    # a last axis of several 128s and rows in whole blocks: (rows, 128) tiles of the (m, n) view on a 2-D grid, so no
    # array is reshaped into (rows, 128) rows (on TPU a relayout: one more pass over each input and output)
    grid2d = width % LANES == 0 and width > LANES and tall >= 16
    tile_rows = min(max(_TPU_BLOCK_ROWS_8BIT, block_rows or 0) if eight_bit else big, tall)
    if grid2d and eight_bit:  # lane-dense scale blocks: (8, 128) tiles of them, or the view's whole rows
        grid2d = tile_rows >= _TPU_BLOCK_ROWS_8BIT or (tile_rows == view_rows and tile_rows >= LANES)
    if grid2d:
        big, small = tile_rows, min(small, tall)

    def flat(x):
        if grid2d:
            return x.reshape(view_rows, width)  # merges leading dims only
        return jnp.pad(x.reshape(-1), (0, rows_pad * LANES - n)).reshape(rows_pad, LANES)

    def lane_dense(s):  # one f32 scale per row of 128 (the last axis is whole blocks), 128 rows' scales per row
        if grid2d:  # (m, n / 128) -> per column block, its m scales in rows of 128
            return jnp.transpose(s.reshape(view_rows, width // LANES)).reshape(width // LANES, -1, LANES)
        return jnp.pad(s.reshape(-1), (0, rows_pad - rows)).reshape(rows_pad // LANES, LANES)

    args = (scalars, words, flat(g), flat(p), flat(c), flat(mv))
    if eight_bit:
        args += (lane_dense(jnp.real(scales)), lane_dense(jnp.imag(scales)))  # complex64 -> its two f32 parts
    rows_of = lambda mode: small if mode in ("triton", "mosaic_gpu") else big
    build = lambda mode: functools.partial(_pallas, block_rows=rows_of(mode), options=options, shapes=shapes, mode=mode)
    outs = dispatch.platform_call(build, *args, interpret=options.interpret, mosaic_gpu=True)
    if grid2d:
        leaf = tuple(x.reshape(p.shape) for x in outs[:3])
        if not eight_bit:
            return leaf
        ms, vs = (jnp.transpose(x.reshape(width // LANES, view_rows)) for x in outs[3:])  # -> (m, n / 128)
        return (*leaf, lax.complex(ms, vs).reshape(scales.shape))  # f32 -> complex64 (m + i·v)
    leaf = tuple(x.reshape(-1)[:n].reshape(p.shape) for x in outs[:3])
    if not eight_bit:
        return leaf
    ms, vs = (x.reshape(-1)[:rows] for x in outs[3:])
    return (*leaf, lax.complex(ms, vs).reshape(scales.shape))  # f32 -> complex64 (m + i·v)
