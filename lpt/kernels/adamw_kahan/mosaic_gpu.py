"""Hopper and Blackwell variant of the fused AdamW + Kahan step with 16-bit moments: Mosaic GPU, TMA copies.

The same per-element math as the Pallas kernel (:func:`~lpt.kernels.adamw_kahan.math.leaf_math`), on the same 2-D
operands that :func:`lpt.kernels.adamw_kahan.kernel.adamw_kahan` prepares (a leaf as ``(rows, width)``: its ``(m, n)``
view, or flattened and zero-padded to ``(rows, 128)``)::

    CTA (i, j) owns rows [i·S·br, (i+1)·S·br) of the 128 columns [128 j, 128 j + 128)
    for s in 0 .. S-1:                               # emit_pipeline: the TMA copies of block s+1 overlap step s
        g, p, c, mv <- SMEM (br, 128) tiles         # one TMA copy each
        p', c', mv' = leaf_math(...)                 # registers, one warpgroup, f32
        SMEM slot s mod 2 <- p', c', mv'  ->  TMA copies to HBM, in place (outputs aliased to p, c, mv)

Each element's stochastic bits hash its flat index in the leaf (``(row·width + column)``, mapped through the shard's
index map on a mesh), so the bits are those of the XLA twin and of the Pallas kernel. ``sqrt`` and the division are
IEEE (correctly rounded): the results are the twin's bit for bit.

``p``, ``c`` and ``mv`` are updated in place (:func:`lpt.kernels.compat.mgpu_in_place`): a CTA reads each block before
it writes it. ``interpret=True`` runs the Mosaic GPU interpreter on CPU; register layout casts are skipped there (they
only annotate layouts). ``interpret=False`` lowers for CUDA only (custom call ``mosaic_gpu_v2``).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lpt.kernels import compat
from lpt.kernels.adamw_kahan.math import LANES, leaf_math, shard_index_map

__all__ = ["MGPU_BLOCK_ROWS", "MGPU_MAX_STEPS", "adamw_kahan_mgpu"]

MGPU_BLOCK_ROWS = 16  # rows of 128 per step: 2K elements, 16 per thread of the warpgroup per array
MGPU_MAX_STEPS = 8  # blocks per CTA, pipelined (two in flight)
_WORDS = 32  # the scalars and the key words travel as 32-word arrays: a TMA copy moves a multiple of 128 bytes


def _cta(cta, sc_g, w_g, g_g, p_g, c_g, mv_g, *outs, steps, br, width, hp, shapes, interpret):
    """CTA ``cta = (i, j)``: its ``steps`` blocks of ``(br, 128)``, read from ``(g, p, c, mv)`` and written to
    ``outs`` (the refs of ``p', c', mv'``)."""
    i, j = cta
    row0, col0 = i * (steps * br), j * LANES
    rows, cols = pl.ds(row0, steps * br), pl.ds(col0, LANES)
    strided = plgpu.Layout.WG_STRIDED((br, LANES), vec_size=2)
    layout = (lambda x: x) if interpret else (lambda x: plgpu.layout_cast(x, strided))
    load = (lambda r: r[...]) if interpret else (lambda r: compat.mgpu_load(r, layout=strided))

    def scoped(sc_s, w_s, bar, *slots):
        plgpu.copy_gmem_to_smem(sc_g, sc_s, bar)
        plgpu.copy_gmem_to_smem(w_g, w_s, bar)
        plgpu.barrier_wait(bar)
        # the runtime zero as a register array: jax 0.12 lowers a scalar bitcast (f32 -> u32) to a 0-d vector
        zero = layout(jnp.broadcast_to(sc_s[3], (br, LANES)))
        scalars = (sc_s[0], sc_s[1], sc_s[2], zero)
        words = (w_s[0], w_s[1])
        index_map = None if shapes is None else shard_index_map(*shapes, w_s[2])

        def body(idx, g_s, p_s, c_s, mv_s):
            (s,) = idx
            base = None
            if hp["stochastic"]:  # the flat index in the leaf of every element of the block
                iota = lambda d: layout(lax.broadcasted_iota(jnp.uint32, (br, LANES), d))
                first = ((row0 + s * br) * width + col0).astype(jnp.uint32)  # int32 -> u32
                base = first + (iota(0) * jnp.uint32(width) + iota(1))
                base = base if index_map is None else index_map(base)
            new = leaf_math(*(load(r) for r in (g_s, p_s, c_s, mv_s)), scalars, words, base=base, **hp)
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


def adamw_kahan_mgpu(
    sc, w, g2, p2, c2, mv2, *, hp: dict, shapes=None, block_rows: int = MGPU_BLOCK_ROWS, interpret: bool = False
):
    """Mosaic GPU kernel: ``(g, p, c, mv) -> (p', c', mv')`` on ``(rows, width)`` operands, 16-bit moments.

    Args:
      sc: f32[4] ``(1/c1, 1/c2, -lr, 0)``.
      w: uint32[3] ``(k0, k1, offset)``: the moments' raw key and the global flat index of the leaf's first element
        (0 unless ``shapes``).
      g2, p2, c2, mv2: the leaf as ``(rows, width)``: gradient (bf16 or f32), bf16 param, bf16 compensation, packed
        bf16 moments (uint32); ``width`` a multiple of 128 and ``rows`` of ``block_rows``.
      hp: ``b1, b2, eps, weight_decay, stochastic``.
      shapes: ``(local_shape, global_shape)`` of a shard of a leaf (the stochastic rounding hashes global flat
        indices), or None.
      block_rows: rows of 128 per pipeline step, a power of two >= 8.
      interpret: False lowers for CUDA (Hopper, Blackwell); True runs the Mosaic GPU interpreter (CPU tests).
    """
    compat.ensure_mgpu_math()
    rows, width = p2.shape
    if width % LANES or block_rows < 8 or block_rows & (block_rows - 1) or rows % block_rows:
        raise ValueError(
            f"adamw_kahan_mgpu needs (rows, width) operands with width a multiple of {LANES} and rows of whole blocks "
            f"of block_rows (a power of two >= 8); got {p2.shape} with block_rows={block_rows}"
        )
    blocks = rows // block_rows
    steps = min(MGPU_MAX_STEPS, blocks & -blocks)  # the largest power of two <= MGPU_MAX_STEPS dividing the blocks
    sc32 = jnp.pad(sc, (0, _WORDS - sc.shape[0]))
    w32 = jnp.pad(w, (0, _WORDS - w.shape[0]))
    kernel = functools.partial(_cta, steps=steps, br=block_rows, width=width, hp=hp, shapes=shapes, interpret=interpret)
    return compat.mgpu_in_place(
        kernel,
        *(sc32, w32, g2, p2, c2, mv2),
        n_in_place=3,  # p, c, mv
        grid=(blocks // steps, width // LANES),
        grid_names=("i", "j"),
        name="lpt_adamw_kahan",
        interpret=interpret,
    )
