"""Fused AdamW + Kahan update of bf16 params with 16-bit moments: the per-element math, its XLA twin, a Pallas kernel.

One step for a parameter ``p`` with gradient ``g``, compensation ``c`` and moments ``m, v`` (all f32 arithmetic)::

    m' = Q_m(b1·m + (1−b1)·g)            v' = Q_m(b2·v + (1−b2)·g²)        (Q_m: nearest or stochastic rounding)
    u  = −lr · ( (m'·(1/c1)) / (sqrt(v'·(1/c2)) + eps) + wd·p )            (c1 = 1−b1^t, c2 = 1−b2^t)
    t  = p + (u − c)                                                         (Kahan: y = u − c, t = p + y)
    p' = Q_p(t)                          c' = Q_c(p' − t)                    (round to nearest, seed 000 Alg. 1)

This is exactly ``lpt.optim.scale_by_adam -> add_decayed_weights -> scale_by_learning_rate -> kahan_summation``
(the moments feed the update after rounding, as in the chain). Both moments of an element travel packed in one
``uint32`` (m's bf16 bits high, v's low), so the state is 8 bytes/param: p, c (2 each) and the packed moments (4).

* :func:`moment_update`, :func:`kahan_target`, :func:`kahan_round`: the math above in three stages, pure jnp; the
  XLA path (``lpt.optim.kahan_adamw(impl="xla")``) and the kernel both call them, so they agree bit for bit.
* :func:`adamw_kahan_reference`: the XLA twin of the kernel on one leaf (any shape).
* :func:`adamw_kahan`: the Pallas kernel, one pass over ``(g, p, c, mv)`` -> ``(p', c', mv')`` with the outputs
  aliased to the inputs. Memory traffic: reads 2+2+2+4, writes 2+2+4 = 18 bytes/param (an f32-master AdamW moves
  14 + 12 + a bf16 compute copy = 28). Leaves are flattened and zero-padded to whole ``(rows, 128)`` blocks; the
  padding is sliced off. Stochastic moment rounding is :func:`lpt.numerics.round_stochastic` (``hash_bits`` of
  the element's global flat index), so the kernel draws the same bits as the XLA path (the block size is a power
  of two, so the global index of a block element is ``base | local`` and ``(base | local) ^ k0 = local ^ (k0 ^
  base)``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from lpt.numerics import round_nearest, round_stochastic
from lpt.numerics.random import _mix  # the hash_bits mixer (Triton cannot lower hash_bits' key handling)

__all__ = [
    "adamw_direction",
    "adamw_kahan",
    "adamw_kahan_reference",
    "kahan_round",
    "kahan_target",
    "moment_update",
    "pack_bf16_pair",
    "unpack_bf16_pair",
]

LANES = 128
_HI = 0xFFFF0000


def bf16_bits_to_f32(x_u32: jax.Array) -> jax.Array:
    """bf16 bit patterns in the HIGH half of a u32 (low half ignored) -> their f32 values (exact)."""
    return lax.bitcast_convert_type(x_u32 & jnp.uint32(_HI), jnp.float32)  # u32 -> f32


def pack_bf16_pair(hi_f32: jax.Array, lo_f32: jax.Array) -> jax.Array:
    """Two f32 arrays already on the bf16 grid -> one u32 (``hi``'s bf16 bits high, ``lo``'s low). Exact."""
    hi = lax.bitcast_convert_type(hi_f32, jnp.uint32) & jnp.uint32(_HI)  # f32 -> u32 bits
    lo = lax.bitcast_convert_type(lo_f32, jnp.uint32) >> jnp.uint32(16)  # f32 -> u32 bits
    return hi | lo


def unpack_bf16_pair(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`pack_bf16_pair`: u32 -> (hi, lo) as f32 (exact)."""
    return bf16_bits_to_f32(packed), bf16_bits_to_f32(packed << jnp.uint32(16))


def no_fma(x32, zero_u32):
    """``x`` unchanged, but opaque to FMA contraction: its bits are OR-ed with a runtime zero (a u32 scalar the
    compiler cannot see is 0). XLA:CPU (and Triton) contract ``a·b + c`` into one FMA wherever the product has a
    single use, so the same expression rounds differently in different fusions; every product that feeds an add
    goes through here, which makes the XLA path, the kernel and the chain agree bit for bit."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x32, jnp.uint32) | zero_u32, jnp.float32)


def runtime_zero(count):
    """A u32 zero from the int32 step count (never negative: optax's increment saturates), opaque to compilers."""
    return (count >> 31).astype(jnp.uint32)  # int32 -> u32


def moment_update(g32, m32, v32, zero_u32, *, b1: float, b2: float):
    """Unrounded f32 moments: ``b1·m + (1−b1)·g`` and ``b2·v + (1−b2)·g²`` (the order of lpt.optim.scale_by_adam),
    products not contracted into FMAs (:func:`no_fma`)."""
    m_new = no_fma(jnp.float32(b1) * m32, zero_u32) + no_fma(jnp.float32(1 - b1) * g32, zero_u32)
    v_new = no_fma(jnp.float32(b2) * v32, zero_u32) + no_fma(jnp.float32(1 - b2) * (g32 * g32), zero_u32)
    return m_new, v_new


def adamw_direction(mq32, vq32, p32, inv_c1, inv_c2, zero_u32, *, eps: float, weight_decay: float):
    """``(m·(1/c1)) / (sqrt(v·(1/c2)) + eps) + wd·p`` in f32: the AdamW update before ``−lr``.

    The bias corrections are multiplications by precomputed reciprocals (what XLA's simplifier makes of a division
    by a broadcast scalar anyway), so every backend computes the same bits."""
    a = (mq32 * inv_c1) / (jnp.sqrt(vq32 * inv_c2) + jnp.float32(eps))
    if weight_decay:
        a = a + no_fma(jnp.float32(weight_decay) * p32, zero_u32)
    return a


def kahan_target(mq32, vq32, p32, c32, inv_c1, inv_c2, neg_lr, zero_u32, *, eps: float, weight_decay: float):
    """``t = p + (u − c)`` with the AdamW step ``u = −lr · adamw_direction(...)`` (all f32, no FMA)."""
    direction = adamw_direction(mq32, vq32, p32, inv_c1, inv_c2, zero_u32, eps=eps, weight_decay=weight_decay)
    u = no_fma(neg_lr * direction, zero_u32)
    return p32 + (u - c32)


def kahan_round(t, param_dtype, compensation_dtype):
    """``p' = Q_p(t)`` and ``c' = Q_c(p' − t)`` (round to nearest even), both returned as f32 on their grids."""
    s32 = round_nearest(t, param_dtype, out_dtype=jnp.float32)
    c32 = round_nearest(s32 - t, compensation_dtype, out_dtype=jnp.float32)
    return s32, c32


def round_moment(x32, *, stochastic: bool, key_words=None, base=None):
    """Q_m into bf16, returned as f32: nearest, or stochastic with the bits of :func:`lpt.numerics.hash_bits`.

    ``key_words = (k0, k1)`` (u32 scalars) is the raw key of the moment. ``base=None`` (the XLA path, ``x32`` is the
    whole leaf) calls :func:`lpt.numerics.round_stochastic`. Inside the kernel (``base`` = global flat index of the
    block's first element) the same bits and rounding are computed here, because Triton cannot lower the key
    handling of ``hash_bits`` (it stacks and indexes the two key words): ``r = hash(k, base + i)`` with
    lpt.numerics.random's mixer, then bf16 stochastic rounding ``(bits + r >> 16) & 0xFFFF0000`` with IEEE overflow
    to ±inf and non-finite inputs passed through (bf16 shares f32's exponent range: no subnormal case). The
    interpret-mode test checks it against ``round_stochastic`` bit for bit.
    """
    if not stochastic:
        return round_nearest(x32, jnp.bfloat16, out_dtype=jnp.float32)
    k0, k1 = key_words
    if base is None:
        return round_stochastic(x32, jnp.bfloat16, jnp.stack([k0, k1]), out_dtype=jnp.float32)
    rows, lanes = x32.shape
    idx = base + (
        lax.broadcasted_iota(jnp.uint32, x32.shape, 0) * jnp.uint32(lanes)
        + lax.broadcasted_iota(jnp.uint32, x32.shape, 1)
    )  # global flat (row-major) index of each element, as hash_bits numbers them
    rnd = _mix(_mix(idx ^ k0) + k1)  # = lpt.numerics.hash_bits((k0, k1), leaf shape) at these indices
    b = lax.bitcast_convert_type(x32, jnp.uint32)  # f32 -> u32 bits
    r = lax.bitcast_convert_type((b + (rnd >> jnp.uint32(16))) & jnp.uint32(_HI), jnp.float32)  # u32 -> f32
    inf = lax.bitcast_convert_type((b & jnp.uint32(0x80000000)) | jnp.uint32(0x7F800000), jnp.float32)  # ±inf
    r = jnp.where(jnp.abs(r) > jnp.float32(float(jnp.finfo(jnp.bfloat16).max)), inf, r)
    return jnp.where(jnp.abs(x32) < jnp.float32(jnp.inf), r, x32)  # non-finite (inf, NaN) inputs pass through


def _leaf_math(g, p, c, mv, scalars, words, *, b1, b2, eps, weight_decay, stochastic, base=None):
    """One step on arrays of any (equal) shape; returns ``(p', c', mv')`` in bf16, bf16, u32."""
    inv_c1, inv_c2, neg_lr = scalars[0], scalars[1], scalars[2]
    zero = lax.bitcast_convert_type(scalars[3], jnp.uint32)  # f32 0.0 -> u32 0 (runtime: see no_fma)
    g32 = g.astype(jnp.float32)  # grad dtype -> f32
    p32 = p.astype(jnp.float32)  # bf16 -> f32 (exact)
    c32 = c.astype(jnp.float32)  # bf16 -> f32 (exact)
    m_new, v_new = moment_update(g32, *unpack_bf16_pair(mv), zero, b1=b1, b2=b2)
    mq = round_moment(m_new, stochastic=stochastic, key_words=(words[0], words[1]), base=base)
    vq = round_moment(v_new, stochastic=stochastic, key_words=(words[2], words[3]), base=base)
    t = kahan_target(mq, vq, p32, c32, inv_c1, inv_c2, neg_lr, zero, eps=eps, weight_decay=weight_decay)
    s32, c_new32 = kahan_round(t, jnp.bfloat16, jnp.bfloat16)
    # f32 -> bf16 casts below are exact: the values are on the bf16 grid
    return s32.astype(jnp.bfloat16), c_new32.astype(jnp.bfloat16), pack_bf16_pair(mq, vq)


def _check(g, p, c, mv, scalars, words):
    if p.dtype != jnp.bfloat16 or c.dtype != jnp.bfloat16:
        raise ValueError(f"adamw_kahan needs bf16 params and compensation, got {p.dtype} and {c.dtype}")
    if mv.dtype != jnp.uint32:
        raise ValueError(f"adamw_kahan needs the packed bf16 moments as uint32, got {mv.dtype}")
    if not jnp.issubdtype(g.dtype, jnp.floating):
        raise ValueError(f"adamw_kahan: gradient dtype {g.dtype} is not floating point")
    if not (g.shape == p.shape == c.shape == mv.shape):
        raise ValueError(f"adamw_kahan: shapes differ: g {g.shape}, p {p.shape}, c {c.shape}, mv {mv.shape}")
    if scalars.shape != (4,) or scalars.dtype != jnp.float32:
        raise ValueError(f"scalars must be f32[4] (1/c1, 1/c2, -lr, 0), got {scalars.dtype}{list(scalars.shape)}")
    if words.shape != (4,) or words.dtype != jnp.uint32:
        raise ValueError(f"words must be uint32[4] (raw keys of m and v), got {words.dtype}{list(words.shape)}")


def adamw_kahan_reference(g, p, c, mv, scalars, words, *, b1, b2, eps, weight_decay, stochastic):
    """XLA twin of :func:`adamw_kahan`: the same math on the whole leaf, in the same order."""
    _check(g, p, c, mv, scalars, words)
    hp = dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, stochastic=stochastic)
    return _leaf_math(g, p, c, mv, scalars, words, **hp)


def _kernel(sc_ref, w_ref, g_ref, p_ref, c_ref, mv_ref, p_out, c_out, mv_out, *, block, hp):
    scalars = (sc_ref[0], sc_ref[1], sc_ref[2], sc_ref[3])
    words = (w_ref[0], w_ref[1], w_ref[2], w_ref[3])
    base = (pl.program_id(0) * block).astype(jnp.uint32) if hp["stochastic"] else None  # int32 -> u32
    p_new, c_new, mv_new = _leaf_math(g_ref[...], p_ref[...], c_ref[...], mv_ref[...], scalars, words, base=base, **hp)
    p_out[...] = p_new
    c_out[...] = c_new
    mv_out[...] = mv_new


def _pallas(sc, w, g2, p2, c2, mv2, *, block_rows, hp, interpret, compiler_params, smem):
    rows = p2.shape[0]
    tile = pl.BlockSpec((block_rows, LANES), lambda i: (i, 0))
    if smem:
        scalar_specs = [pl.BlockSpec(memory_space=pltpu.SMEM)] * 2
    else:
        scalar_specs = [pl.BlockSpec((4,), lambda i: (0,))] * 2
    kernel = functools.partial(_kernel, block=block_rows * LANES, hp=hp)
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
        interpret=interpret,
        compiler_params=compiler_params,
    )(sc, w, g2, p2, c2, mv2)


def adamw_kahan(g, p, c, mv, scalars, words, *, b1, b2, eps, weight_decay, stochastic, block_rows=512, interpret=None):
    """Pallas kernel: one pass ``(g, p, c, mv) -> (p', c', mv')`` for one leaf of any shape (see module doc).

    Args:
      g, p, c, mv: gradient (any float dtype), bf16 param, bf16 compensation, packed bf16 moments (uint32).
      scalars: f32[4] ``(1/c1, 1/c2, -lr, 0)`` (the 0 is :func:`no_fma`'s runtime zero).
      words: uint32[4], the raw keys of m's and v's stochastic rounding.
      block_rows: rows of 128 lanes per program (a power of two >= 16; shrinks for small leaves).
      interpret: ``True`` runs the Pallas interpreter on every platform; ``None`` picks per platform with
        ``lax.platform_dependent``: interpreter on CPU, Triton on CUDA, Mosaic on TPU.
    """
    _check(g, p, c, mv, scalars, words)
    if block_rows < 16 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two >= 16, got {block_rows}")
    if interpret not in (None, True):
        raise ValueError(f"interpret must be None (choose per platform) or True, got {interpret!r}")
    n = math.prod(p.shape)
    rows = -(-n // LANES)
    block_rows = min(block_rows, max(16, 1 << (rows - 1).bit_length()))
    rows_pad = -(-rows // block_rows) * block_rows

    def flat(x):
        return jnp.pad(x.reshape(-1), (0, rows_pad * LANES - n)).reshape(rows_pad, LANES)

    args = (scalars, words, flat(g), flat(p), flat(c), flat(mv))
    hp = dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, stochastic=stochastic)
    run = functools.partial(_pallas, block_rows=block_rows, hp=hp)
    if interpret:
        outs = run(*args, interpret=True, compiler_params=None, smem=False)
    else:
        outs = lax.platform_dependent(
            *args,
            cpu=functools.partial(run, interpret=True, compiler_params=None, smem=False),
            cuda=functools.partial(run, interpret=False, compiler_params=pltriton.CompilerParams(), smem=False),
            tpu=functools.partial(
                run,
                interpret=False,
                compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
                smem=True,
            ),
        )
    return tuple(x.reshape(-1)[:n].reshape(p.shape) for x in outs)
