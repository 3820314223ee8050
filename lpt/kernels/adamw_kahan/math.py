"""The per-element math of the fused AdamW + Kahan update, in stages, pure jnp (no Pallas): the XLA path
(``lpt.optim.kahan_adamw(impl="xla")``, ``lpt.optim.adamw``'s chain) and the Pallas kernel
(:mod:`lpt.kernels.adamw_kahan.kernel`) both call it, so they agree bit for bit.

One step for a parameter ``p`` with gradient ``g``, compensation ``c`` and moments ``m, v`` (all f32 arithmetic)::

    m' = Q_m(b1·m + (1−b1)·g)            v' = Q_m(b2·v + (1−b2)·g²)        (Q_m: nearest or stochastic rounding)
    u  = −lr · ( (m'·(1/c1)) / (sqrt(v'·(1/c2)) + eps) + wd·p )            (c1 = 1−b1^t, c2 = 1−b2^t)
    t  = p + (u − c)                                                         (Kahan: y = u − c, t = p + y)
    p' = Q_p(t)                          c' = Q_c(p' − t)                    (round to nearest, Zamirai et al. Alg. 1)

Every product that feeds an add is kept out of FMAs (:func:`no_fma`), and every square root is rounded to nearest
(:func:`lpt.kernels.sqrt_math.sqrt_rn`: a Mosaic GPU kernel's ``sqrt`` is PTX's approximate one), so that every
fusion and backend computes the same bits. Both moments of an element travel packed in one ``uint32`` (m's bf16
bits high, v's low). :func:`adamw_kahan_reference` is the kernel's XLA twin on one leaf (any shape).
:class:`StepOptions` holds a step's compile-time options, which every layer of the kernel family takes as one
object.

8-bit moments (:mod:`lpt.optim.moments8`): ``Q_m`` stores each moment as FP8 codes with one f32 scale per block of
128 consecutive elements of the last axis (:func:`encode_blocks`, :func:`decode_blocks`; :func:`leaf_math8` is the
kernel's step, ``lpt.optim.moments8`` calls the same block functions on the leaf blocked as ``(..., blocks, 128)``).
Their rounding and code conversions (:mod:`lpt.kernels.fp8_codes_math`) are integer and f32 operations that Mosaic
and Triton lower: the kernel holds no float8 arrays.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from lpt.kernels.adamw_kahan.options import LANES, StepOptions, check_leaf
from lpt.kernels.fp8_codes_math import decode_blocks, encode_blocks, fp8_code, fp8_value, round_fp8
from lpt.kernels.sqrt_math import sqrt_rn
from lpt.numerics import hash_bits, round_nearest
from lpt.numerics.random import hash_index  # hash_bits' keyed hash (Triton cannot lower hash_bits' key handling)

__all__ = [
    "adamw_direction",
    "adamw_kahan_reference",
    "decode_blocks",
    "encode_blocks",
    "f32",
    "flat_index",
    "fp8_code",
    "fp8_value",
    "kahan_round",
    "kahan_target",
    "v_floor",
    "leaf_math",
    "leaf_math8",
    "moment_update",
    "no_fma",
    "pack_bf16_pair",
    "round_fp8",
    "round_moments",
    "runtime_zero",
    "stochastic_bf16",
    "unpack_bf16_pair",
]

_HI = 0xFFFF0000


def _bf16_bits_to_f32(x_u32: jax.Array) -> jax.Array:
    """bf16 bit patterns in the HIGH half of a u32 (low half ignored) -> their f32 values (exact)."""
    return lax.bitcast_convert_type(x_u32 & jnp.uint32(_HI), jnp.float32)  # u32 -> f32


def pack_bf16_pair(hi_f32: jax.Array, lo_f32: jax.Array) -> jax.Array:
    """Two f32 arrays already on the bf16 grid -> one u32 (``hi``'s bf16 bits high, ``lo``'s low). Exact."""
    hi = lax.bitcast_convert_type(hi_f32, jnp.uint32) & jnp.uint32(_HI)  # f32 -> u32 bits
    lo = lax.bitcast_convert_type(lo_f32, jnp.uint32) >> jnp.uint32(16)  # f32 -> u32 bits
    return hi | lo


def unpack_bf16_pair(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`pack_bf16_pair`: u32 -> (hi, lo) as f32 (exact)."""
    return _bf16_bits_to_f32(packed), _bf16_bits_to_f32(packed << jnp.uint32(16))


def no_fma(x32, zero_u32):
    """``x`` unchanged, but opaque to FMA contraction: its bits are OR-ed with a runtime zero (a u32 scalar the
    compiler cannot see is 0). XLA:CPU (and Triton) contract ``a·b + c`` into one FMA wherever the product has a
    single use, so the same expression rounds differently in different fusions; every product that feeds an add
    goes through here, which makes the XLA path, the kernel and the chain agree bit for bit."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x32, jnp.uint32) | zero_u32, jnp.float32)


def runtime_zero(count):
    """A u32 zero from the int32 step count (never negative: optax's increment saturates), opaque to compilers."""
    return (count >> 31).astype(jnp.uint32)  # int32 -> u32


def f32(h) -> jax.Array:
    """A hyperparameter as an f32 scalar: Python numbers exactly as ``jnp.float32(h)``, traced ones (from
    ``optax.inject_hyperparams``, maybe in bf16) converted."""
    return jnp.asarray(h).astype(jnp.float32)  # hyperparameter -> f32


def _one_minus(h) -> jax.Array:
    """``1 − h`` as f32: in f64 then rounded for Python numbers (as the chain always did), in f32 for traced ones."""
    if isinstance(h, (int, float)):
        return jnp.float32(1 - h)
    return jnp.float32(1) - f32(h)


def _is_static_zero(h) -> bool:
    return isinstance(h, (int, float)) and h == 0


def moment_update(g32, m32, v32, zero_u32, *, b1: float, b2: float):
    """Unrounded f32 moments: ``b1·m + (1−b1)·g`` and ``b2·v + (1−b2)·g²`` (the order of lpt.optim.scale_by_adam),
    products not contracted into FMAs (:func:`no_fma`).

    Args:
      g32, m32, v32: the gradient and both stored moments, f32 arrays of one shape.
      zero_u32: the runtime zero (:func:`runtime_zero`), u32, a scalar or an array of that shape.
      b1, b2: the decay rates (Python numbers, or traced scalars from ``optax.inject_hyperparams``).
    """
    m_new = no_fma(f32(b1) * m32, zero_u32) + no_fma(_one_minus(b1) * g32, zero_u32)
    v_new = no_fma(f32(b2) * v32, zero_u32) + no_fma(_one_minus(b2) * (g32 * g32), zero_u32)
    return m_new, v_new


def adamw_direction(mq32, vq32, p32, inv_c1, inv_c2, zero_u32, *, eps: float, weight_decay: float):
    """``(m·(1/c1)) / (sqrt(v·(1/c2)) + eps) + wd·p`` in f32: the AdamW update before ``−lr``.

    The bias corrections are multiplications by precomputed reciprocals (what XLA's simplifier makes of a division
    by a broadcast scalar anyway), so every backend computes the same bits.

    Args:
      mq32, vq32, p32: the stored (rounded) moments and the param, f32 arrays of one shape.
      inv_c1, inv_c2: f32 scalars ``1/c1`` and ``1/c2``, the reciprocal bias corrections.
      zero_u32: the runtime zero (:func:`runtime_zero`).
      eps, weight_decay: AdamW's epsilon and decoupled weight decay (a static 0 adds no term).
    """
    a = (mq32 * inv_c1) / (sqrt_rn(vq32 * inv_c2) + f32(eps))
    if not _is_static_zero(weight_decay):
        a = a + no_fma(f32(weight_decay) * p32, zero_u32)
    return a


def kahan_target(direction, p32, c32, neg_lr, zero_u32):
    """``t = p + (u − c)`` with the AdamW step ``u = −lr · direction`` (all f32, no FMA).

    Args:
      direction: :func:`adamw_direction` of the stored moments and the param, f32.
      p32, c32: the param and its compensation, f32 arrays of the direction's shape.
      neg_lr: the f32 scalar ``−lr``.
      zero_u32: the runtime zero (:func:`runtime_zero`).
    """
    u = no_fma(neg_lr * direction, zero_u32)
    return p32 + (u - c32)


def kahan_round(t, param_dtype, compensation_dtype):
    """``p' = Q_p(t)`` and ``c' = Q_c(p' − t)`` (round to nearest even), both returned as f32 on their grids."""
    s32 = round_nearest(t, param_dtype, out_dtype=jnp.float32)
    c32 = round_nearest(s32 - t, compensation_dtype, out_dtype=jnp.float32)
    return s32, c32


def stochastic_bf16(x32, r16):
    """bf16 stochastic rounding of f32 ``x`` with 16 uniform random bits ``r16`` (u32 < 2^16), as f32.

    ``(bits(x) + r16) & 0xFFFF0000``: exactly :func:`lpt.numerics.round_stochastic` into bf16 when ``r16`` are the
    top 16 bits of its random word. bf16 shares f32's exponent range, so there is no subnormal case, a carry out of
    the largest bf16 lands exactly on ±inf (IEEE overflow) and ±inf stay ±inf (their low 16 bits are 0); only NaN
    must be passed through (a payload could carry into the sign bit)."""
    b = lax.bitcast_convert_type(x32, jnp.uint32)  # f32 -> u32 bits
    r = lax.bitcast_convert_type((b + r16) & jnp.uint32(_HI), jnp.float32)  # u32 -> f32
    return jnp.where(x32 != x32, x32, r)


def _moment_bits(shape, key_words, index=None):
    """One uniform u32 per element: :func:`lpt.numerics.hash_bits` of ``(k0, k1)`` and the element's flat index.

    ``index=None``: the whole leaf, via ``hash_bits``. Inside a kernel ``index`` is each element's flat index in the
    leaf (:func:`flat_index`) and the same mixer runs on it here, because Triton cannot lower ``hash_bits``' key
    handling (it stacks and indexes the two key words)."""
    k0, k1 = key_words
    if index is None:
        return hash_bits(jnp.stack([k0, k1]), shape)
    return hash_index(index, k0, k1)  # = hash_bits((k0, k1), leaf shape)[index]


def flat_index(shape, base, index_map=None):
    """The u32 flat index in the leaf of every element of a 2-D ``shape`` block whose first element has flat index
    ``base`` (a u32 scalar), counted row-major as ``hash_bits`` numbers them; on a shard of a leaf, ``index_map``
    (from :func:`shard_index_map`) maps that local flat index to the leaf's global one."""
    idx = base + (
        lax.broadcasted_iota(jnp.uint32, shape, 0) * jnp.uint32(shape[1]) + lax.broadcasted_iota(jnp.uint32, shape, 1)
    )
    return idx if index_map is None else index_map(idx)


def shard_index_map(local_shape, global_shape, offset):
    """``f -> global flat index`` of the element at local flat index ``f`` (u32) of a shard of ``local_shape`` whose
    first element sits at global flat index ``offset`` (u32 scalar) of a leaf of ``global_shape``.

    Only the dims up to the last split one need a div/mod: the trailing whole dims keep their strides, so a leaf
    split along its first dim only costs one add."""
    split = [i for i, (lo, gl) in enumerate(zip(local_shape, global_shape, strict=True)) if lo != gl]
    last = split[-1] if split else 0
    tail = math.prod(local_shape[last + 1 :])  # = prod(global_shape[last + 1:])
    strides = [math.prod(global_shape[i + 1 :]) for i in range(len(global_shape))]

    def index_map(f):
        if last == 0:
            return offset + f
        q = f // jnp.uint32(tail)
        out = f % jnp.uint32(tail)
        for i in range(last, 0, -1):
            out = out + (q % jnp.uint32(local_shape[i])) * jnp.uint32(strides[i])
            q = q // jnp.uint32(local_shape[i])
        return offset + out + q * jnp.uint32(strides[0])

    return index_map


def round_moments(m32, v32, *, stochastic: bool, key_words=None, index=None):
    """Q_m of both moments into bf16, returned as f32: nearest, or stochastic from ONE hash word per element.

    Stochastic: the top 16 bits of :func:`_moment_bits` round ``m`` (bit-identical to
    ``lpt.numerics.round_stochastic(m, bf16, key)``), the low 16 bits round ``v``. bf16 stochastic rounding uses 16
    random bits, so one 32-bit hash serves both moments: half the hashing of two ``round_stochastic`` calls (what
    the hash costs in the fused step: docs/results.md).

    Args:
      m32, v32: the unrounded moments, f32 arrays of one shape.
      stochastic: stochastic rounding (True) or round to nearest even (False).
      key_words, index: stochastic only: the raw key ``(k0, k1)`` and the elements' flat indices in the leaf
        (:func:`flat_index`; None: the arrays are the whole leaf).
    """
    if not stochastic:
        return round_nearest(m32, jnp.bfloat16, out_dtype=jnp.float32), round_nearest(
            v32, jnp.bfloat16, out_dtype=jnp.float32
        )
    rnd = _moment_bits(m32.shape, key_words, index)
    return stochastic_bf16(m32, rnd >> jnp.uint32(16)), stochastic_bf16(v32, rnd & jnp.uint32(0xFFFF))


# 8-bit moments. Every function takes blocks along the LAST axis of its arrays: values ``y[..., b]`` and their scales
# ``s[..., 1]`` (lpt.optim.moments8 passes a leaf blocked as (..., blocks, 128), the kernel its (rows, 128) tiles).
_Moments8 = tuple  # (m's format, v's format, v stored as sqrt(v)): the kernel's view of a lpt.optim.moments8.Moment8


def _load8(codes_u32, ms, vs, moments8: _Moments8):
    """Packed codes (m's high byte, v's low) and their scales -> both moments in f32."""
    m_format, v_format, v_sqrt = moments8
    m = decode_blocks(codes_u32 >> jnp.uint32(8), ms, m_format)
    y = decode_blocks(codes_u32 & jnp.uint32(0xFF), vs, v_format)
    return m, (y * y if v_sqrt else y)


def v_floor(mq32, vq32, *, b1: float, b2: float):
    """``max(v, (m / C)^2)`` with ``C = (1 − b1) / sqrt((1 − b2) · (1 − b1²/b2))``: the second moment an Adam update
    reads from 8-bit moments. For the exact EMAs of the same gradients Cauchy–Schwarz gives ``|m| <= C·sqrt(v)``
    (``C = 7.27`` for b1 = 0.9, b2 = 0.999; it needs ``b1² < b2``), so the floor changes nothing there; where ``v``'s
    8-bit code underflowed while ``m``'s did not, it keeps ``|m̂| / sqrt(v̂)`` at Adam's own bound instead of
    ``m / eps``. With ``b1² >= b2`` there is no such bound: ``v`` unchanged. ``1 / C`` is computed in f64 and rounded
    for Python numbers, in f32 for traced hyperparameters (``optax.inject_hyperparams``)."""
    if isinstance(b1, (int, float)) and isinstance(b2, (int, float)):
        if b1 * b1 >= b2:
            return vq32
        inv_c = f32(((1 - b2) * (1 - b1 * b1 / b2)) ** 0.5 / (1 - b1))  # 1 / C in f64, rounded to f32
    else:
        b1_, b2_ = f32(b1), f32(b2)
        bound = (1 - b1_ * b1_ / b2_) > 0
        inv_c = jnp.where(bound, jnp.sqrt((1 - b2_) * jnp.maximum(1 - b1_ * b1_ / b2_, 0.0)) / (1 - b1_), 0.0)
    r = mq32 * inv_c
    return jnp.maximum(vq32, r * r)


def leaf_math8(g, p, c, codes, scales, scalars, words, *, options: StepOptions, index=None):
    """One step with 8-bit moments on ``(rows, 128)`` arrays, one block per row: ``codes`` u16 (m's code high, v's
    low, as ``lpt.optim.moments8.pack_codes``), ``scales`` the rows' f32 scales of m and v, ``[rows, 1]`` columns or
    ``[rows]`` (a Mosaic GPU kernel's row vectors: the new scales come back in the same form). Stochastic rounding:
    ``m`` from :func:`_moment_bits` of key words ``words[0:2]``, ``v`` of ``words[2:4]``, one word per element each
    (what ``round_stochastic`` draws for the blocked leaf, whose flat index is the leaf's when its last axis is a
    multiple of 128). Returns ``(p', c', codes', ms', vs')``.

    Args:
      g, p, c, codes: the gradient (any float dtype), bf16 param and compensation, and the packed u16 codes, all
        ``(rows, 128)``.
      scales: ``(ms, vs)``, m's and v's f32 scales per row, ``[rows, 1]`` or ``[rows]``.
      scalars: ``(1/c1, 1/c2, −lr, 0)``, the last the runtime zero as f32 (a scalar, or an array of the leaf's shape).
      words: u32 key words, m's two then v's two.
      options: the step's :class:`StepOptions`, with ``moments8``.
      index: the elements' flat indices in the leaf (:func:`flat_index`); None: the arrays are the whole leaf.
    """
    m_format, v_format, v_sqrt = options.moments8
    ms, vs = scales
    inv_c1, inv_c2, neg_lr = scalars[0], scalars[1], scalars[2]
    zero = lax.bitcast_convert_type(scalars[3], jnp.uint32)  # f32 0.0 -> u32 0 (runtime: see no_fma)
    g32 = g.astype(jnp.float32)  # grad dtype -> f32
    p32 = p.astype(jnp.float32)  # bf16 -> f32 (exact)
    c32 = c.astype(jnp.float32)  # bf16 -> f32 (exact)
    codes32 = codes.astype(jnp.uint32)  # u16 -> u32
    b1, b2 = options.b1, options.b2
    m_new, v_new = moment_update(g32, *_load8(codes32, ms, vs, options.moments8), zero, b1=b1, b2=b2)
    rnd_m = rnd_v = None
    if options.stochastic:
        rnd_m = _moment_bits(m_new.shape, (words[0], words[1]), index)
        rnd_v = _moment_bits(m_new.shape, (words[2], words[3]), index)
    keep = ms.ndim == g.ndim  # [rows, 1] columns, else [rows] row vectors
    mc, ms_new = encode_blocks(m_new, m_format, rnd_m, keepdims=keep)
    vc, vs_new = encode_blocks(sqrt_rn(v_new) if v_sqrt else v_new, v_format, rnd_v, keepdims=keep)
    packed = (mc << jnp.uint32(8)) | vc
    mq, vq = _load8(packed, ms_new, vs_new, options.moments8)  # the stored moments
    vq = v_floor(mq, vq, b1=b1, b2=b2)
    direction = adamw_direction(mq, vq, p32, inv_c1, inv_c2, zero, eps=options.eps, weight_decay=options.weight_decay)
    s32, c_new32 = kahan_round(kahan_target(direction, p32, c32, neg_lr, zero), jnp.bfloat16, jnp.bfloat16)
    # f32 -> bf16 casts below are exact: the values are on the bf16 grid; u32 -> u16 keeps the two 8-bit codes
    return s32.astype(jnp.bfloat16), c_new32.astype(jnp.bfloat16), packed.astype(jnp.uint16), ms_new, vs_new


def leaf_math(g, p, c, mv, scalars, words, *, options: StepOptions, index=None):
    """One step on arrays of any (equal) shape; returns ``(p', c', mv')`` in bf16, bf16, u32.

    Args:
      g, p, c, mv: the gradient (any float dtype), bf16 param and compensation, and the packed bf16 moments (u32).
      scalars: ``(1/c1, 1/c2, −lr, 0)``, the last the runtime zero as f32 (a scalar, or an array of the leaf's shape).
      words: the moments' raw key ``(k0, k1)`` (u32).
      options: the step's :class:`StepOptions` (16-bit moments: no ``moments8``).
      index: the elements' flat indices in the leaf (:func:`flat_index`); None: the arrays are the whole leaf.
    """
    inv_c1, inv_c2, neg_lr = scalars[0], scalars[1], scalars[2]
    zero = lax.bitcast_convert_type(scalars[3], jnp.uint32)  # f32 0.0 -> u32 0 (runtime: see no_fma)
    g32 = g.astype(jnp.float32)  # grad dtype -> f32
    p32 = p.astype(jnp.float32)  # bf16 -> f32 (exact)
    c32 = c.astype(jnp.float32)  # bf16 -> f32 (exact)
    m_new, v_new = moment_update(g32, *unpack_bf16_pair(mv), zero, b1=options.b1, b2=options.b2)
    key = (words[0], words[1])
    mq, vq = round_moments(m_new, v_new, stochastic=options.stochastic, key_words=key, index=index)
    direction = adamw_direction(mq, vq, p32, inv_c1, inv_c2, zero, eps=options.eps, weight_decay=options.weight_decay)
    s32, c_new32 = kahan_round(kahan_target(direction, p32, c32, neg_lr, zero), jnp.bfloat16, jnp.bfloat16)
    # f32 -> bf16 casts below are exact: the values are on the bf16 grid
    return s32.astype(jnp.bfloat16), c_new32.astype(jnp.bfloat16), pack_bf16_pair(mq, vq)


def adamw_kahan_reference(g, p, c, mv, scalars, words, scales=None, *, options: StepOptions):
    """XLA twin of :func:`adamw_kahan`: the same math on the whole leaf, in the same order (8-bit moments: on the
    leaf as ``(rows, 128)``, one block per row).

    Args:
      g, p, c, mv, scalars, words, scales: as :func:`lpt.kernels.adamw_kahan.kernel.adamw_kahan`.
      options: the step's :class:`StepOptions` (its ``block_rows`` and ``interpret`` are the kernel's: unused here).
    """
    check_leaf(g, p, c, mv, scalars, words, scales, options=options)
    if options.moments8 is None:
        return leaf_math(g, p, c, mv, scalars, words, options=options)
    rows = (-1, LANES)
    col = lambda s: s.reshape(-1, 1)
    ms, vs = col(jnp.real(scales)), col(jnp.imag(scales))  # complex64 -> its two f32 parts
    leaf = (x.reshape(rows) for x in (g, p, c, mv))
    new_p, new_c, new_mv, ms, vs = leaf_math8(*leaf, (ms, vs), scalars, words, options=options)
    out = (x.reshape(p.shape) for x in (new_p, new_c, new_mv))
    return (*out, lax.complex(ms[:, 0], vs[:, 0]).reshape(scales.shape))  # f32 -> complex64 (m + i·v)
