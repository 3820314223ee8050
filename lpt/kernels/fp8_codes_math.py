"""8-bit float codes in integer and f32 operations that Mosaic and Triton lower: rounding into an 8-bit float
(:func:`round_fp8`, equal to ``lpt.numerics.round_nearest`` / ``round_stochastic`` with saturation), the codes of
values on its grid and back (:func:`fp8_code`, :func:`fp8_value`), and blocks with one f32 scale each
(:func:`encode_blocks`, :func:`decode_blocks`). Pure jnp, no Pallas: the fused AdamW kernel with 8-bit moments
(:mod:`lpt.kernels.adamw_kahan.math`) and its XLA path (:mod:`lpt.optim.moments8`) share it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from lpt.numerics import block_scale, get_format

__all__ = ["check_fp8_format", "decode_blocks", "encode_blocks", "fp8_code", "fp8_value", "per_block", "round_fp8"]

_SIGN, _ABS, _EXP, _QNAN = 0x80000000, 0x7FFFFFFF, 0x7F800000, 0x7FC00000


def _bits(x32):
    return lax.bitcast_convert_type(x32, jnp.uint32)  # f32 -> u32 bits


def _from_bits(b):
    return lax.bitcast_convert_type(b, jnp.float32)  # u32 bits -> f32


def _bits_of(x: float) -> int:
    """The f32 bits of a Python number, at trace time (Triton cannot bitcast a constant)."""
    return int(np.float32(x).view(np.uint32))  # f32 -> u32 bits


def check_fp8_format(dtype):
    """The FloatFormat of ``dtype``; ValueError (one line) unless it is an 8-bit float."""
    fmt = get_format(dtype)
    if fmt.bits != 8:
        raise ValueError(f"8-bit moments need an 8-bit float format, got {fmt.name}")
    return fmt


def fp8_code(q32, dtype):
    """f32 values on the grid of the 8-bit float ``dtype`` (±inf and NaN pass) -> their 8-bit codes, in a u32.

    Normal values: the f32 exponent rebiased and the top mantissa bits, one integer subtraction and shift (exact on
    the grid); subnormal ones: ``|q| / smallest_subnormal`` as an integer (exact); non-finite ones: the format's inf
    or NaN code (e4m3fn, which has no inf: NaN, 0x7F). The sign goes to bit 7."""
    fmt = check_fp8_format(dtype)
    mb = fmt.mantissa_bits
    b = _bits(q32)
    mag = b & jnp.uint32(_ABS)
    normal = (mag - jnp.uint32((126 + fmt.emin) << 23)) >> jnp.uint32(23 - mb)  # exponent rebiased to 1 - emin
    tiny = mag < jnp.uint32(_bits_of(fmt.smallest_normal))
    small = _from_bits(jnp.where(tiny, mag, jnp.uint32(0)))  # |q| below the smallest normal (else 0)
    sub = (small * jnp.float32(1 / fmt.smallest_subnormal)).astype(jnp.int32).astype(jnp.uint32)  # f32 -> i32 -> u32
    top = ((1 << fmt.exponent_bits) - 1) << mb  # the all-ones exponent
    if fmt.has_inf:
        special = jnp.where(mag > jnp.uint32(_EXP), jnp.uint32(top | 1 << (mb - 1)), jnp.uint32(top))  # NaN, inf
    else:
        special = jnp.uint32(0x7F)  # NaN (inf has no code: it becomes NaN, as XLA's convert does)
    code = jnp.where(mag >= jnp.uint32(_EXP), special, jnp.where(tiny, sub, normal))
    return ((b >> jnp.uint32(31)) << jnp.uint32(7)) | code


def fp8_value(code_u32, dtype):
    """Inverse of :func:`fp8_code`: 8-bit codes of ``dtype`` (u32 < 256) -> their f32 values (exact)."""
    fmt = check_fp8_format(dtype)
    mb = fmt.mantissa_bits
    mag = code_u32 & jnp.uint32(0x7F)
    normal = (mag << jnp.uint32(23 - mb)) + jnp.uint32((126 + fmt.emin) << 23)
    sub = _bits(mag.astype(jnp.int32).astype(jnp.float32) * jnp.float32(fmt.smallest_subnormal))  # u32 -> i32 -> f32
    top = ((1 << fmt.exponent_bits) - 1) << mb
    if fmt.has_inf:
        special_code = mag >= jnp.uint32(top)  # the all-ones exponent: inf, or NaN with a nonzero mantissa
        special = jnp.uint32(_EXP) | ((mag - jnp.uint32(top)) << jnp.uint32(23 - mb))
    else:
        special_code, special = mag == jnp.uint32(0x7F), jnp.uint32(_QNAN)
    bits = jnp.where(special_code, special, jnp.where(mag < jnp.uint32(1 << mb), sub, normal))
    return _from_bits(((code_u32 >> jnp.uint32(7)) << jnp.uint32(31)) | bits)


def _with_sign_of(mag32, b):
    """|mag| with the sign bit of the u32 bits ``b``."""
    return _from_bits((_bits(mag32) & jnp.uint32(_ABS)) | (b & jnp.uint32(_SIGN)))


def round_fp8(x32, dtype, rnd=None):
    """``x`` rounded into the 8-bit float ``dtype``, saturating, as f32 on its grid.

    ``rnd`` None: to nearest even, equal to ``lpt.numerics.round_nearest(x, dtype, saturate=True)``; else a uniform
    u32 per element: stochastic, equal to ``lpt.numerics.round_stochastic(x, dtype, key, saturate=True)`` when
    ``rnd`` is its ``hash_bits(key, x.shape)`` (both tested). Their algorithms, in operations Mosaic and Triton lower
    (no ``lax.round``, ``floor``, ``sign`` or ``isfinite``; below the smallest normal, the integer part (a conversion to
    int32) and the fraction's comparison with 1/2 round ``|x| / s`` to the nearest integer, ties to even)."""
    fmt = check_fp8_format(dtype)
    drop = 23 - fmt.mantissa_bits
    b = _bits(x32)
    a32 = _from_bits(b & jnp.uint32(_ABS))  # |x|
    keep = jnp.uint32(~((1 << drop) - 1) & 0xFFFFFFFF)
    s = fmt.smallest_subnormal
    tiny = a32 < jnp.float32(fmt.smallest_normal)  # the subnormal range, where r_sub below is taken (False for NaN)
    y = jnp.where(tiny, a32 * jnp.float32(1.0 / s), jnp.float32(0))  # |x| in subnormal spacings (exact; < 2^mb)
    fl = y.astype(jnp.int32).astype(jnp.float32)  # f32 -> i32 -> f32: floor(y), y >= 0 and below 2^mantissa_bits
    if rnd is None:
        lsb = (b >> jnp.uint32(drop)) & jnp.uint32(1)
        r = _from_bits((b + jnp.uint32((1 << (drop - 1)) - 1) + lsb) & keep)
        odd = (fl.astype(jnp.int32) & 1) == 1  # f32 -> i32 (an integer below 2^mantissa_bits where it is used)
        up = (y - fl > jnp.float32(0.5)) | ((y - fl == jnp.float32(0.5)) & odd)  # ties to even
    else:
        r = _from_bits((b + (rnd >> jnp.uint32(32 - drop))) & keep)
        u = (rnd >> jnp.uint32(8)).astype(jnp.int32).astype(jnp.float32) * jnp.float32(2.0**-24)  # u32 -> f32, < 2^24
        up = u < y - fl
    r_sub = _with_sign_of((fl + up.astype(jnp.float32)) * jnp.float32(s), b)  # bool -> f32
    r = jnp.where(tiny, r_sub, r)
    big = _from_bits(_bits(r) & jnp.uint32(_ABS)) > jnp.float32(fmt.max)
    r = jnp.where(big, _from_bits(jnp.uint32(_bits_of(fmt.max)) | (b & jnp.uint32(_SIGN))), r)  # saturate
    return jnp.where((b & jnp.uint32(_EXP)) == jnp.uint32(_EXP), x32, r)  # inf and NaN pass


def per_block(scale, shape):
    """Block scales as an array of ``shape`` (blocks along its last axis): ``scale[..., 1]`` as it is (it broadcasts),
    ``scale[...]`` (the block axis dropped: a row vector, the form a Mosaic GPU kernel holds) broadcast along it."""
    if scale.ndim == len(shape):
        return scale
    return lax.broadcast_in_dim(scale, shape, tuple(range(len(shape) - 1)))


def encode_blocks(y32, dtype, rnd=None, *, keepdims: bool = True):
    """f32 blocks ``y[..., b]`` -> ``(codes u32, scales f32[..., 1])``: per block ``scale = block_scale(amax)`` and
    ``code = Q(y / scale)`` (:func:`round_fp8`: nearest without ``rnd``, stochastic with it). ``keepdims=False``:
    the scales as ``f32[...]`` (see :func:`per_block`); the same numbers."""
    scale = block_scale(jnp.max(jnp.abs(y32), axis=-1, keepdims=keepdims), dtype)  # f32, 1 for an all-zero block
    return fp8_code(round_fp8(y32 / per_block(scale, y32.shape), dtype, rnd), dtype), scale


def decode_blocks(codes_u32, scale, dtype):
    """Inverse of :func:`encode_blocks` (up to its rounding): ``code · scale`` in f32, the scales in either form of
    :func:`per_block`."""
    return fp8_value(codes_u32, dtype) * per_block(scale, codes_u32.shape)
