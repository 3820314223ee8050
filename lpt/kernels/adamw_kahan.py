"""Fused AdamW + Kahan update of bf16 params with 16-bit moments as one Pallas kernel per leaf.

The math (the update equations, :func:`~lpt.kernels.adamw_kahan_math.moment_update`, ``round_moments``,
``kahan_target``, ``kahan_round``) and the kernel's XLA twin (``adamw_kahan_reference``) are in
:mod:`lpt.kernels.adamw_kahan_math`, pure jnp, which the XLA path (``lpt.optim.kahan_adamw(impl="xla")``) calls as
well, so the two agree bit for bit (tested in interpret mode).

:func:`adamw_kahan` makes one pass over ``(g, p, c, mv)`` -> ``(p', c', mv')`` with the outputs aliased to the
inputs. Memory traffic: reads 2+2+2+4, writes 2+2+4 = 18 bytes/param (an f32-master AdamW moves 14 + 12 + a bf16
compute copy = 28). Leaves are flattened and zero-padded to whole ``(rows, 128)`` blocks; the padding is sliced
off. Stochastic moment rounding draws one ``hash_bits`` word per element from its global flat index (block base +
in-block index, or a shard's global index map), so the kernel draws the same bits as the XLA path. The platform
switch is :mod:`lpt.kernels.dispatch`; per-shard wrappers are in :mod:`lpt.kernels.adamw_kahan_sharded`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lpt.kernels import dispatch
from lpt.kernels.adamw_kahan_math import LANES, check_leaf, leaf_math, shard_index_map

__all__ = ["TPU_BLOCK_ROWS", "TRITON_BLOCK_ROWS", "adamw_kahan"]


def _kernel(sc_ref, w_ref, g_ref, p_ref, c_ref, mv_ref, p_out, c_out, mv_out, *, block, hp, shapes):
    scalars = (sc_ref[0], sc_ref[1], sc_ref[2], sc_ref[3])
    words = (w_ref[0], w_ref[1])
    base = (pl.program_id(0) * block).astype(jnp.uint32) if hp["stochastic"] else None  # int32 -> u32
    index_map = None if shapes is None else shard_index_map(*shapes, w_ref[2])
    p_new, c_new, mv_new = leaf_math(
        g_ref[...], p_ref[...], c_ref[...], mv_ref[...], scalars, words, base=base, index_map=index_map, **hp
    )
    p_out[...] = p_new
    c_out[...] = c_new
    mv_out[...] = mv_new


def _pallas(sc, w, g2, p2, c2, mv2, *, block_rows, hp, shapes, mode):
    rows = p2.shape[0]
    tile = pl.BlockSpec((block_rows, LANES), lambda i: (i, 0))
    if mode == "mosaic":
        scalar_specs = [pl.BlockSpec(memory_space=pltpu.SMEM)] * 2
    else:
        scalar_specs = [pl.BlockSpec((4,), lambda i: (0,)), pl.BlockSpec(w.shape, lambda i: (0,))]
    kernel = functools.partial(_kernel, block=block_rows * LANES, hp=hp, shapes=shapes)
    return pl.pallas_call(
        kernel,
        grid=(rows // block_rows,),
        in_specs=[*scalar_specs, tile, tile, tile, tile],
        out_specs=[tile, tile, tile],
        out_shape=[
            jax.ShapeDtypeStruct(p2.shape, jnp.bfloat16),
            jax.ShapeDtypeStruct(c2.shape, jnp.bfloat16),
            jax.ShapeDtypeStruct(mv2.shape, jnp.uint32),
        ],
        input_output_aliases={3: 0, 4: 1, 5: 2},
        name="lpt_adamw_kahan",
        # per element: ~40 elementwise flops, one sqrt; reads g, p, c, mv and writes p, c, mv
        cost_estimate=pl.CostEstimate(
            flops=40 * p2.size,
            transcendentals=p2.size,
            bytes_accessed=p2.size * (g2.dtype.itemsize + 2 + 2 + 4 + 2 + 2 + 4),
        ),
        **dispatch.mode_kwargs(mode, grid_rank=1),
    )(sc, w, g2, p2, c2, mv2)


TPU_BLOCK_ROWS = 512  # 64K elements per program: ~1.2 MB of VMEM per buffer set, double-buffered
TRITON_BLOCK_ROWS = 16  # 2K elements per program: 16 per thread with 4 warps (a big block would spill registers)


def adamw_kahan(
    g,
    p,
    c,
    mv,
    scalars,
    words,
    *,
    b1,
    b2,
    eps,
    weight_decay,
    stochastic,
    block_rows=None,
    interpret=None,
    global_shape=None,
    offset=None,
):
    """Pallas kernel: one pass ``(g, p, c, mv) -> (p', c', mv')`` for one leaf of any shape (see module doc).

    Args:
      g, p, c, mv: gradient (any float dtype), bf16 param, bf16 compensation, packed bf16 moments (uint32).
      scalars: f32[4] ``(1/c1, 1/c2, -lr, 0)`` (the 0 is :func:`no_fma`'s runtime zero).
      words: uint32[2], the raw key of the moments' stochastic rounding (see :func:`round_moments`).
      block_rows: rows of 128 lanes per program, a power of two >= 16 (shrinks for small leaves). None: per
        platform, :data:`TPU_BLOCK_ROWS` on TPU and in the interpreter, :data:`TRITON_BLOCK_ROWS` on CUDA.
      interpret: ``True`` runs the Pallas interpreter on every platform; ``None`` picks per platform
        (:func:`lpt.kernels.dispatch.platform_call`): interpreter on CPU, Triton on CUDA, Mosaic on TPU.
      global_shape, offset: the arrays are one shard of a leaf of ``global_shape`` whose first element has global
        flat index ``offset`` (u32 scalar); the stochastic rounding hashes each element's global flat index, so
        the bits do not depend on the sharding. None: the arrays are the whole leaf.
    """
    check_leaf(g, p, c, mv, scalars, words)
    if (global_shape is None) != (offset is None):
        raise ValueError(f"pass global_shape and offset together, got {global_shape=} and offset={offset!r}")
    shapes = None if global_shape is None or tuple(global_shape) == p.shape else (p.shape, tuple(global_shape))
    extra = jnp.zeros((1,), jnp.uint32) if offset is None else jnp.reshape(offset, (1,)).astype(jnp.uint32)  # -> u32
    words = jnp.concatenate([words, extra])  # (k0, k1, offset)
    if block_rows is not None and (block_rows < 16 or block_rows & (block_rows - 1)):
        raise ValueError(f"block_rows must be a power of two >= 16, got {block_rows}")
    dispatch.check_interpret(interpret)
    n = math.prod(p.shape)
    if n == 0:
        return p, c, mv
    rows = -(-n // LANES)
    fit = max(16, 1 << (rows - 1).bit_length())  # blocks never exceed the next power of two of the leaf's rows
    big = min(TPU_BLOCK_ROWS if block_rows is None else block_rows, fit)
    small = min(TRITON_BLOCK_ROWS if block_rows is None else block_rows, fit)
    rows_pad = -(-rows // big) * big  # a multiple of both block sizes (powers of two, small <= big)

    def flat(x):
        return jnp.pad(x.reshape(-1), (0, rows_pad * LANES - n)).reshape(rows_pad, LANES)

    args = (scalars, words, flat(g), flat(p), flat(c), flat(mv))
    hp = dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, stochastic=stochastic)
    rows_of = lambda mode: small if mode == "triton" else big
    build = lambda mode: functools.partial(_pallas, block_rows=rows_of(mode), hp=hp, shapes=shapes, mode=mode)
    outs = dispatch.platform_call(build, *args, interpret=interpret)
    return tuple(x.reshape(-1)[:n].reshape(p.shape) for x in outs)
