"""Block-scaled narrow formats: MXFP8 / MXFP4 (OCP Microscaling Formats (MX) v1.0) and NVFP4.

Both store a tensor as narrow float *codes* plus one scale per block of consecutive elements; the value of an
element is ``code · scale``. See docs/fp8.md ("Block formats: MXFP8, MXFP4 and NVFP4") for the rules, their sources
and the edge cases; the summary:

MX (:func:`mx_quantize`, :func:`mx_dequantize`): blocks of ``block_size`` (32) elements along ``axis``, elements in
float8_e4m3fn, float8_e5m2 or float4_e2m1fn, one e8m0 scale (a power of two, ``jnp.float8_e8m0fnu``) per block::

    e     = clamp(floor(log2(amax)) - emax_elem, -127, 127)    (emax_elem = 8, 15, 2 for e4m3, e5m2, e2m1)
    scale = 2^e                                                (e8m0 byte e + 127)
    code  = round(x / 2^e) into the element format, saturating at its max ("clamp to max normal")

    amax == 0 (all-zero block)     -> e = -127 (byte 0x00), codes ±0
    amax is inf or NaN             -> scale NaN (byte 0xFF); codes NaN (float8 elements) or +0 (e2m1: no NaN)

NVFP4 (:func:`nvfp4_quantize`, :func:`nvfp4_dequantize`): float4_e2m1fn codes in 1x16 blocks (or 16x16 tiles for
weights), a float8_e4m3fn scale per block and one f32 tensor scale, in the f32 order of operations of
TransformerEngine's NVFP4 recipe::

    S_enc        = 2688 / max(amax, 2688 · 2^-116)          (2688 = 6 · 448; S_enc = 1 if amax is 0, inf or NaN)
    tensor_scale = 1 / S_enc                                (NaN if amax is inf or NaN)
    block_scale  = e4m3(block_amax · (S_enc · (1/6)))       (RNE, saturating at 448; NaN for a non-finite block)
    code         = e2m1(x · min(1 / (block_scale · tensor_scale), f32 max))   (RNE, saturating at ±6)
    value        = (code · block_scale) · tensor_scale

f32 subnormal inputs: MX scales them exactly (every step works on the f32 bits, so XLA's flush-to-zero of
subnormal operands never applies); NVFP4 treats them as ±0 (the recipe is f32 arithmetic, which XLA flushes).
Rounding of the codes is nearest-even (``rounding="nearest"``) or unbiased stochastic (``rounding="stochastic"``
with a ``key``), through :func:`lpt.numerics.round_nearest` / :func:`lpt.numerics.round_stochastic`, so ``jit`` can
never skip it; the scales are deterministic in both modes (MX: the floor rule; NVFP4: e4m3 nearest-even).

Each function checks its arguments in Python first (a one-line ValueError naming the value and what is allowed),
then runs its array math as one jitted program, its static arguments the element dtype, the block layout, the
rounding mode and the output dtype: an eager call compiles once per shape and options, and a call under ``jit``
inlines it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lpt.fp8.microscaling._layout import (
    ROUNDINGS,
    block_tiles,
    check_float,
    check_rounding,
    check_scales,
    grouped_shape,
)
from lpt.fp8.recipe import check_dtype_in
from lpt.numerics import exponent_of, get_format, round_nearest, round_stochastic

__all__ = [
    "E8M0_MAX_EXP",
    "E8M0_MIN_EXP",
    "MxScales",
    "NVFP4_BLOCK",
    "NVFP4_TILE",
    "NvScales",
    "ROUNDINGS",
    "mx_block_exponents",
    "mx_dequantize",
    "mx_quantize",
    "nvfp4_block_scales",
    "nvfp4_dequantize",
    "nvfp4_quantize",
]

_MX_ELEM_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2), jnp.dtype(jnp.float4_e2m1fn))
NVFP4_BLOCK = 16
NVFP4_TILE = (NVFP4_BLOCK, NVFP4_BLOCK)  # the 2-D tiles of a weight that is used transposed as well
_E8M0 = jnp.dtype(jnp.float8_e8m0fnu)

_E8M0_BIAS = 127
_E8M0_NAN = 0xFF
E8M0_MIN_EXP = -127  # the exponents of e8m0's finite scales 2^-127 ... 2^127
E8M0_MAX_EXP = 127
_F32_INF_BITS = 0x7F800000
_F32_SIGN = 0x80000000
_F32_ABS = 0x7FFFFFFF
_F32_MAX = float(np.finfo(np.float32).max)
_E2M1_MAX = 6.0
_E4M3_MAX = 448.0
_NVFP4_RANGE = _E2M1_MAX * _E4M3_MAX  # 2688: S_enc maps the tensor's amax onto 6 · 448
# The floor on amax keeps every f32 intermediate of the recipe normal (tensor_scale >= 2^-116, so
# code·block_scale·tensor_scale >= 2^-10 · 2^-116); XLA flushes f32 subnormals to zero on CPU, GPU and TPU.
_NVFP4_AMAX_FLOOR = _NVFP4_RANGE * 2.0**-116
_ONE_SIXTH_F32 = float(np.float32(1.0) / np.float32(_E2M1_MAX))  # TE's fp4_max_inv: 1/6 rounded to f32


# ---------------------------------------------------------------------------------------------------------------
# f32 bit arithmetic (the block layout and the argument checks: lpt.fp8.microscaling._layout)
# ---------------------------------------------------------------------------------------------------------------


def _bits(x_f32: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x_f32, jnp.uint32)  # f32 -> u32 bit pattern


def _from_bits(b: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(b, jnp.float32)  # u32 bit pattern -> f32


def _amax_bits(x_f32: jax.Array, axes) -> jax.Array:
    """max |x| over ``axes`` as the u32 bits of an f32 (keepdims). On the integer bits: exact for f32 subnormals,
    and any NaN (bits above 0x7F800000) wins over inf, so ``>= 0x7F800000`` flags a non-finite block."""
    return jnp.max(_bits(x_f32) & jnp.uint32(_F32_ABS), axis=axes, keepdims=True)


def _mul_pow2(x_f32: jax.Array, k: jax.Array, *, subnormals: bool) -> jax.Array:
    """``x · 2^k`` for finite f32 ``x`` (normal, subnormal or zero) and int32 ``k``, built on the bits.

    Exact whenever the result is a normal f32. A result below 2^-126 is the f32 subnormal ``x · 2^k`` truncated
    toward zero (exact when representable) with ``subnormals=True``, ±0 with ``subnormals=False``. The callers keep
    results below 2^128."""
    b = _bits(x_f32)
    sign = b & jnp.uint32(_F32_SIGN)
    e = ((b >> 23) & jnp.uint32(0xFF)).astype(jnp.int32)  # u32 -> i32 biased exponent
    normal = e > 0
    sig = jnp.where(normal, (b & jnp.uint32(0x7FFFFF)) | jnp.uint32(0x800000), b & jnp.uint32(0x7FFFFF))
    q = jnp.where(normal, e - 150, -149)  # x = sig · 2^q, sig < 2^24
    lz = lax.clz(sig).astype(jnp.int32) - 8  # u32 -> i32: shifts that bring sig's top bit to bit 23 (24 for 0)
    sig_n = sig << jnp.clip(lz, 0, 23).astype(jnp.uint32)  # i32 -> u32 shift amount
    be = q - lz + k.astype(jnp.int32) + 150  # biased exponent of the result (<= 0: subnormal)
    out_normal = (jnp.clip(be, 1, 254).astype(jnp.uint32) << 23) | (sig_n & jnp.uint32(0x7FFFFF))  # i32 -> u32
    if subnormals:
        shift = jnp.clip(1 - be, 0, 31).astype(jnp.uint32)  # i32 -> u32
        out_sub = jnp.where(1 - be < 32, sig_n >> shift, jnp.uint32(0))
    else:
        out_sub = jnp.uint32(0)
    out = jnp.where(be >= 1, out_normal, out_sub)
    out = jnp.where(sig == 0, jnp.uint32(0), out)
    return _from_bits(out | sign)


def _round_codes(y_f32: jax.Array, dtype, rounding: str, key) -> jax.Array:
    """Codes of ``y`` in ``dtype`` as f32 values on its grid, saturating at its max (nearest-even or stochastic)."""
    if rounding == "stochastic":
        return round_stochastic(y_f32, dtype, key, saturate=True, out_dtype=jnp.float32)  # f32 -> dtype grid (SR)
    return round_nearest(y_f32, dtype, saturate=True, out_dtype=jnp.float32)  # f32 -> dtype grid (RNE)


def _check_out_dtype(dtype) -> jnp.dtype:
    d = jnp.dtype(dtype)
    if not jnp.issubdtype(d, jnp.floating):
        raise ValueError(f"dtype must be a floating-point dtype, got {d}")
    return d


def _cast_out(v_f32: jax.Array, dtype: jnp.dtype) -> jax.Array:
    if dtype == jnp.float32:
        return v_f32
    return round_nearest(v_f32, dtype)  # f32 -> dtype (RNE, IEEE overflow)


# ---------------------------------------------------------------------------------------------------------------
# MX (OCP Microscaling Formats v1.0)
# ---------------------------------------------------------------------------------------------------------------


class MxScales(NamedTuple):
    """The steps of MX's scale rule (module docstring) for one tensor, before the exponent is clamped to e8m0."""

    x32: jax.Array  # x in f32, each tiled axis split into (blocks, block length)
    inner: tuple[int, ...]  # the block-length axes of x32
    block_amax: jax.Array  # f32 max |x| of each block (x32's shape with the inner axes 1; exact, subnormals kept)
    block_nonfinite: jax.Array  # bool: the block holds inf or NaN
    exponent: jax.Array  # int32 floor(log2 block_amax) - emax_elem, unclamped (-126 - emax_elem for 0 / subnormal)


def mx_blocks(shape, elem_dtype, block_size, axis, block_shape):
    """``(elem dtype, grouped shape, inner axes)`` of MX blocks on an array of ``shape``: a one-line ValueError
    for an element dtype or a block layout :func:`mx_quantize` does not take (the checks of its arguments).

    Args:
      shape: the array's shape.
      elem_dtype, block_size, axis, block_shape: as :func:`mx_quantize`.
    """
    elem = check_dtype_in(elem_dtype, _MX_ELEM_DTYPES, "elem_dtype")
    return (elem, *grouped_shape(tuple(shape), block_tiles(tuple(shape), axis, block_size, block_shape)))


def _mx_layout(x, elem_dtype, block_size, axis, block_shape):
    """The checked arguments of the MX quantizer: ``(x, elem, grouped shape, inner axes)``."""
    x = check_float(x)
    return (x, *mx_blocks(x.shape, elem_dtype, block_size, axis, block_shape))


@functools.partial(jax.jit, static_argnames=("elem", "grouped", "inner"))
def _mx_exponents(x, elem, grouped, inner):
    """MxScales' arrays: ``(x32, block_amax, block_nonfinite, exponent)``."""
    x32 = x.astype(jnp.float32).reshape(grouped)  # any float -> f32 (exact below f32)
    amax_bits = _amax_bits(x32, inner)
    nonfinite = amax_bits >= jnp.uint32(_F32_INF_BITS)
    # floor(log2 amax) from the bits; exponent_of reports -126 for subnormal and zero amax, which the clamp maps to
    # -127 exactly as the true floor(log2) would (emax_elem >= 2).
    e = exponent_of(_from_bits(amax_bits)) - get_format(elem).emax
    return x32, _from_bits(amax_bits), nonfinite, e


def mx_block_exponents(
    x, elem_dtype, block_size: int = 32, axis: int = -1, *, block_shape: tuple[int, int] | None = None
) -> MxScales:
    """The block maxima and unclamped scale exponents :func:`mx_quantize` computes for ``x`` (same arguments).

    Args:
      x: floating-point array.
      elem_dtype: float8_e4m3fn, float8_e5m2 or float4_e2m1fn.
      block_size: elements per block along ``axis``.
      axis: the blocked axis; its length a multiple of ``block_size``.
      block_shape: ``(rows, cols)`` 2-D tiles on the last two axes instead; ``axis`` stays -1.
    """
    x, elem, grouped, inner = _mx_layout(x, elem_dtype, block_size, axis, block_shape)
    x32, block_amax, nonfinite, e = _mx_exponents(x, elem, grouped, inner)
    return MxScales(x32, inner, block_amax, nonfinite, e)


def mx_quantize(
    x,
    elem_dtype,
    block_size: int = 32,
    axis: int = -1,
    *,
    block_shape: tuple[int, int] | None = None,
    rounding: str = "nearest",
    key=None,
) -> tuple[jax.Array, jax.Array]:
    """MX-quantize ``x``: ``(codes, scales)`` with ``x ≈ codes · scales`` per block (module docstring).

    Args:
      x: floating-point array (computed in f32).
      elem_dtype: float8_e4m3fn (MXFP8), float8_e5m2 (MXFP8) or float4_e2m1fn (MXFP4).
      block_size: elements per block along ``axis`` (the spec's k = 32).
      axis: the blocked axis; its length must be a multiple of ``block_size``.
      block_shape: ``(rows, cols)`` for 2-D tiles on the last two axes (e.g. (32, 32) for a weight that is used
        transposed as well); replaces ``block_size`` and ``axis`` (axis must stay -1).
      rounding: "nearest" (ties to even) or "stochastic" (unbiased; needs ``key``). Only the codes are rounded
        stochastically; scales follow the spec's floor rule.
      key: JAX PRNG key for ``rounding="stochastic"``.

    Returns:
      codes: x's shape in ``elem_dtype``.
      scales: ``float8_e8m0fnu`` of x's shape with each blocked axis divided by its block length.
    """
    check_rounding(rounding, key)
    x, elem, grouped, inner = _mx_layout(x, elem_dtype, block_size, axis, block_shape)
    return _mx_quantize(x, key, elem, grouped, inner, rounding)


@functools.partial(jax.jit, static_argnames=("elem", "grouped", "inner", "rounding"))
def _mx_quantize(x, key, elem, grouped, inner, rounding):
    x32, _, nonfinite, exponent = _mx_exponents(x, elem, grouped, inner)
    fmt = get_format(elem)
    e = jnp.clip(exponent, E8M0_MIN_EXP, E8M0_MAX_EXP)
    e = jnp.where(nonfinite, 0, e)

    # x / 2^e on the bits: exact (subnormal inputs included); quotients below 2^-126 become ±0, which is what
    # every element format rounds them to.
    y = _mul_pow2(x32, -e, subnormals=False)
    codes = _round_codes(y, elem, rounding, key)
    bad = jnp.float32(jnp.nan) if fmt.has_nan else jnp.float32(0.0)
    codes = jnp.where(nonfinite, bad, codes)
    codes = codes.astype(elem).reshape(x.shape)  # f32 (on elem's grid, or NaN) -> elem: exact

    biased = jnp.where(nonfinite, _E8M0_NAN, e + _E8M0_BIAS).astype(jnp.uint8)  # i32 -> u8 e8m0 byte
    scales = lax.bitcast_convert_type(jnp.squeeze(biased, inner), _E8M0)  # u8 byte -> e8m0
    return codes, scales


def mx_dequantize(
    codes,
    scales,
    block_size: int = 32,
    axis: int = -1,
    dtype=jnp.float32,
    *,
    block_shape: tuple[int, int] | None = None,
) -> jax.Array:
    """``codes · scales`` (each scale over its block) as ``dtype``; inverse of :func:`mx_quantize`.

    Exact in f32 (a power-of-two scaling on the bits): f32 subnormal results are returned as such, although XLA
    flushes them to zero in any later arithmetic. A NaN scale makes its block NaN; inf / NaN codes stay inf / NaN.
    ``scales`` is ``float8_e8m0fnu`` or ``uint8`` (the e8m0 byte: biased exponent, 0xFF = NaN).

    Args:
      codes: float8_e4m3fn, float8_e5m2 or float4_e2m1fn, at least 1-D.
      scales: one per block: codes' shape with each blocked axis divided by its block length.
      block_size, axis, block_shape: the blocks, as given to :func:`mx_quantize`.
      dtype: floating-point output dtype (f32 exact; others rounded to nearest even).
    """
    codes = jnp.asarray(codes)
    if codes.dtype not in _MX_ELEM_DTYPES:
        raise ValueError(f"codes must be one of {[d.name for d in _MX_ELEM_DTYPES]}, got dtype {codes.dtype}")
    scales = jnp.asarray(scales)
    if scales.dtype not in (_E8M0, jnp.uint8):
        raise ValueError(f"scales must be float8_e8m0fnu or uint8 (the e8m0 byte), got dtype {scales.dtype}")
    if codes.ndim == 0:
        raise ValueError("codes must have at least one axis, got a scalar")
    tiles = block_tiles(codes.shape, axis, block_size, block_shape)
    check_scales(scales, codes.shape, tiles, "scales")
    grouped, inner = grouped_shape(codes.shape, tiles)
    return _mx_dequantize(codes, scales, grouped, inner, _check_out_dtype(dtype))


@functools.partial(jax.jit, static_argnames=("grouped", "inner", "dtype"))
def _mx_dequantize(codes, scales, grouped, inner, dtype):
    if scales.dtype == _E8M0:
        scales = lax.bitcast_convert_type(scales, jnp.uint8)  # e8m0 -> u8 byte
    sb = jnp.expand_dims(scales, inner)
    c32 = codes.astype(jnp.float32).reshape(grouped)  # elem -> f32 (exact)
    e = sb.astype(jnp.int32) - _E8M0_BIAS  # u8 -> i32 exponent
    v = _mul_pow2(c32, jnp.broadcast_to(e, grouped), subnormals=True)
    v = jnp.where((_bits(c32) & jnp.uint32(_F32_INF_BITS)) == jnp.uint32(_F32_INF_BITS), c32, v)  # inf/NaN codes
    v = jnp.where(sb == _E8M0_NAN, jnp.float32(jnp.nan), v)
    return _cast_out(v.reshape(codes.shape), dtype)


# ---------------------------------------------------------------------------------------------------------------
# NVFP4
# ---------------------------------------------------------------------------------------------------------------


def _nvfp4_tiles(shape, axis, block_shape):
    if block_shape is not None and tuple(block_shape) != NVFP4_TILE:
        raise ValueError(f"NVFP4 block_shape must be None (1x16 blocks) or (16, 16), got {block_shape!r}")
    return block_tiles(tuple(shape), axis, NVFP4_BLOCK, block_shape)


class NvScales(NamedTuple):
    """The f32 steps of NVFP4's scales (module docstring) for one tensor, before the block scales are rounded."""

    x32: jax.Array  # x in f32, f32 subnormals as ±0, each tiled axis split into (blocks, block length)
    inner: tuple[int, ...]  # the block-length axes of x32
    tensor_scale: jax.Array  # f32 scalar 1 / S_enc (finite: S_enc is 1 for a zero or non-finite amax)
    tensor_nonfinite: jax.Array  # bool scalar: the tensor holds inf or NaN
    block_amax: jax.Array  # f32, x32's shape with the inner axes 1; 0 for a non-finite block
    block_nonfinite: jax.Array  # bool, block_amax's shape
    block_scale_f32: jax.Array  # f32 block_amax · (S_enc · 1/6): the block decode scale, unrounded (e4m3 rounds it)


def nvfp4_blocks(shape, axis, block_shape):
    """``(grouped shape, inner axes)`` of NVFP4 blocks on an array of ``shape``: a one-line ValueError for a block
    layout :func:`nvfp4_quantize` does not take."""
    return grouped_shape(tuple(shape), _nvfp4_tiles(shape, axis, block_shape))


def _nvfp4_layout(x, axis, block_shape):
    """The checked arguments of the NVFP4 quantizer: ``(x, grouped shape, inner axes)``."""
    x = check_float(x)
    return (x, *nvfp4_blocks(x.shape, axis, block_shape))


@functools.partial(jax.jit, static_argnames=("grouped", "inner"))
def _nvfp4_scales(x, grouped, inner):
    """NvScales' arrays, without ``inner``."""
    x32 = x.astype(jnp.float32).reshape(grouped)  # any float -> f32 (exact below f32)
    b = _bits(x32)
    tiny = (b & jnp.uint32(_F32_INF_BITS)) == 0
    x32 = jnp.where(tiny, _from_bits(b & jnp.uint32(_F32_SIGN)), x32)  # f32 subnormals -> ±0, as XLA's arithmetic

    amax_bits = _amax_bits(x32, tuple(range(x32.ndim)))
    t_nonfinite = jnp.squeeze(amax_bits >= jnp.uint32(_F32_INF_BITS))
    amax = jnp.squeeze(_from_bits(amax_bits))
    degenerate = (amax_bits == 0).squeeze() | t_nonfinite
    s_enc = jnp.float32(_NVFP4_RANGE) / jnp.maximum(amax, jnp.float32(_NVFP4_AMAX_FLOOR))  # f32, <= 2^116
    s_enc = jnp.where(degenerate, jnp.float32(1.0), s_enc)
    s_dec = jnp.float32(1.0) / s_enc  # f32 tensor (decode) scale

    block_bits = _amax_bits(x32, inner)
    b_nonfinite = block_bits >= jnp.uint32(_F32_INF_BITS)
    block_amax = jnp.where(b_nonfinite, jnp.float32(0.0), _from_bits(block_bits))
    bs = block_amax * (s_enc * jnp.float32(_ONE_SIXTH_F32))  # f32 decode scale of the block (rounded to e4m3 next)
    return x32, s_dec, t_nonfinite, block_amax, b_nonfinite, bs


def nvfp4_block_scales(x, axis: int = -1, *, block_shape: tuple[int, int] | None = None) -> NvScales:
    """The tensor scale and the unrounded block scales :func:`nvfp4_quantize` computes for ``x`` (same arguments)."""
    x, grouped, inner = _nvfp4_layout(x, axis, block_shape)
    x32, *scales = _nvfp4_scales(x, grouped, inner)
    return NvScales(x32, inner, *scales)


def nvfp4_quantize(
    x,
    axis: int = -1,
    *,
    block_shape: tuple[int, int] | None = None,
    rounding: str = "nearest",
    key=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """NVFP4-quantize ``x``: ``(codes, block_scales, tensor_scale)`` with ``x ≈ codes · block_scales ·
    tensor_scale`` (module docstring).

    Args:
      x: floating-point array (computed in f32; f32 subnormals count as ±0).
      axis: the axis of the 1x16 blocks; its length must be a multiple of 16.
      block_shape: ``(16, 16)`` for 16x16 tiles on the last two axes (weights, so that the transposed weight has
        the same quantization); ``axis`` must stay -1.
      rounding: "nearest" (ties to even) or "stochastic" (unbiased; needs ``key``); the codes only.
      key: JAX PRNG key for ``rounding="stochastic"``.

    Returns:
      codes: x's shape in float4_e2m1fn.
      block_scales: float8_e4m3fn, x's shape with each blocked axis divided by 16.
      tensor_scale: f32 scalar (the decode scale, about amax / 2688).
    """
    check_rounding(rounding, key)
    x, grouped, inner = _nvfp4_layout(x, axis, block_shape)
    return _nvfp4_quantize(x, key, grouped, inner, rounding)


@functools.partial(jax.jit, static_argnames=("grouped", "inner", "rounding"))
def _nvfp4_quantize(x, key, grouped, inner, rounding):
    x32, s_dec, t_nonfinite, _, b_nonfinite, bs_f32 = _nvfp4_scales(x, grouped, inner)
    bs = round_nearest(bs_f32, jnp.float8_e4m3fn, saturate=True, out_dtype=jnp.float32)  # f32 -> e4m3
    enc = jnp.minimum(jnp.float32(1.0) / (bs * s_dec), jnp.float32(_F32_MAX))  # f32 encode scale; bs = 0 -> f32 max

    codes = _round_codes(x32 * enc, jnp.float4_e2m1fn, rounding, key)  # f32 -> e2m1 grid (saturating at ±6)
    codes = jnp.where(b_nonfinite, jnp.float32(0.0), codes)
    codes = codes.astype(jnp.float4_e2m1fn).reshape(x.shape)  # f32 (on e2m1's grid) -> e2m1: exact
    bs = jnp.where(b_nonfinite, jnp.float32(jnp.nan), bs)
    block_scales = jnp.squeeze(bs, inner).astype(jnp.float8_e4m3fn)  # f32 (on e4m3's grid, or NaN) -> e4m3: exact
    tensor_scale = jnp.where(t_nonfinite, jnp.float32(jnp.nan), s_dec)
    return codes, block_scales, tensor_scale


def nvfp4_dequantize(
    codes,
    block_scales,
    tensor_scale,
    axis: int = -1,
    dtype=jnp.float32,
    *,
    block_shape: tuple[int, int] | None = None,
) -> jax.Array:
    """``(codes · block_scales) · tensor_scale`` as ``dtype``; inverse of :func:`nvfp4_quantize`.

    ``codes · block_scales`` is exact in f32 (a 2-bit by 4-bit significand product, at least 2^-10 when non-zero);
    the multiplication by ``tensor_scale`` rounds once, to nearest even, so the f32 result is the f32 nearest to the
    exact product. NaN scales give NaN.

    Args:
      codes: float4_e2m1fn, at least 1-D.
      block_scales: float8_e4m3fn, codes' shape with each blocked axis divided by 16.
      tensor_scale: one float (any shape of size 1).
      axis, block_shape: the blocks, as given to :func:`nvfp4_quantize`.
      dtype: floating-point output dtype (f32 as computed; others rounded to nearest even from f32).
    """
    codes = jnp.asarray(codes)
    if codes.dtype != jnp.float4_e2m1fn:
        raise ValueError(f"codes must be float4_e2m1fn, got dtype {codes.dtype}")
    block_scales = jnp.asarray(block_scales)
    if block_scales.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"block_scales must be float8_e4m3fn, got dtype {block_scales.dtype}")
    tensor_scale = jnp.asarray(tensor_scale)
    if tensor_scale.size != 1 or not jnp.issubdtype(tensor_scale.dtype, jnp.floating):
        raise ValueError(
            f"tensor_scale must be one float, got shape {tuple(tensor_scale.shape)} dtype {tensor_scale.dtype}"
        )
    if codes.ndim == 0:
        raise ValueError("codes must have at least one axis, got a scalar")
    tiles = _nvfp4_tiles(codes.shape, axis, block_shape)
    check_scales(block_scales, codes.shape, tiles, "block_scales")
    grouped, inner = grouped_shape(codes.shape, tiles)
    return _nvfp4_dequantize(codes, block_scales, tensor_scale, grouped, inner, _check_out_dtype(dtype))


@functools.partial(jax.jit, static_argnames=("grouped", "inner", "dtype"))
def _nvfp4_dequantize(codes, block_scales, tensor_scale, grouped, inner, dtype):
    bs = jnp.expand_dims(block_scales, inner)
    c32 = codes.astype(jnp.float32).reshape(grouped)  # e2m1 -> f32 (exact)
    prod = c32 * bs.astype(jnp.float32)  # e4m3 -> f32 (exact); the product is exact
    v = prod * tensor_scale.reshape(()).astype(jnp.float32)  # f32: one rounding (RNE)
    return _cast_out(v.reshape(codes.shape), dtype)
