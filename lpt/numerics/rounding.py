"""Rounding into low-precision formats that survives ``jit``.

Why not ``x.astype(jnp.bfloat16)``? Under ``jit`` XLA may keep an intermediate you wrote in bf16 in f32
("excess precision", jax#23007), which silently skips the rounding that Kahan summation and stochastic rounding
depend on. Every function here computes in f32 and rounds with integer operations on the f32 bit pattern (or with
exact power-of-two scalings plus ``lax.round``), so the result is *on the target grid as an f32 value* before any
cast; the final cast to the narrow dtype is then exact and nothing XLA fuses can change it.

The normal range is rounded on the f32 bits: dropping ``k = 23 - p`` low mantissa bits (a carry into the exponent
is the correct result). The target's subnormal range, where the spacing is the constant ``s = smallest_subnormal``,
is rounded as ``round(x / s) · s`` (both scalings are exact). bf16 shares f32's exponent range, so its subnormals are
f32 subnormals: note that XLA:CPU (and TPUs) flush f32 subnormals to zero, so bf16 subnormal results become 0 there.

Overflow: with ``saturate=True`` values beyond the format's max become ±max; with ``saturate=False`` they become
±inf (or NaN for formats with NaN but no inf, like float8_e4m3fn). The default, ``saturate=None``, saturates exactly
the formats without an infinity (float8_e4m3fn, fp6, fp4) and gives IEEE ±inf for bf16, f16, float8_e5m2.
fp6/fp4 have neither inf nor NaN, so they always saturate (±inf inputs too). Otherwise infinite and NaN inputs are
passed through to the final cast unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lpt.numerics.formats import FloatFormat, get_format
from lpt.numerics.random import random_bits

_F32_MANTISSA = 23


def _as_f32(x) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"expected a floating-point array, got dtype {x.dtype}")
    return x.astype(jnp.float32)  # any float -> f32: exact for every format below f32 (f64 rounds once, RNE)


def _bits(x_f32: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x_f32, jnp.uint32)  # f32 -> u32 bit pattern


def _from_bits(b: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(b, jnp.float32)  # u32 bit pattern -> f32


def _nearest_even_bits(x_f32: jax.Array, drop: int) -> jax.Array:
    """Round f32 to nearest-even with ``drop`` fewer mantissa bits (unbounded exponent), on the bits."""
    if drop <= 0:
        return x_f32
    b = _bits(x_f32)
    lsb = (b >> drop) & jnp.uint32(1)
    b = (b + jnp.uint32((1 << (drop - 1)) - 1) + lsb) & jnp.uint32(~((1 << drop) - 1) & 0xFFFFFFFF)
    return _from_bits(b)


def _copysign(mag_f32: jax.Array, sign_of_f32: jax.Array) -> jax.Array:
    """|mag| with the sign bit of ``sign_of`` (bit operations: no ``sign`` op, which Mosaic TPU cannot lower
    without a device)."""
    m = _bits(jnp.broadcast_to(mag_f32, sign_of_f32.shape)) & jnp.uint32(0x7FFFFFFF)
    return _from_bits(m | (_bits(sign_of_f32) & jnp.uint32(0x80000000)))


def _overflow(x_f32: jax.Array, r_f32: jax.Array, fmt: FloatFormat, saturate: bool | None) -> jax.Array:
    """Apply the overflow policy to a rounded f32 value ``r`` and pass non-finite inputs through."""
    if saturate is None:
        saturate = not fmt.has_inf
    if saturate or not (fmt.has_inf or fmt.has_nan):  # fp6/fp4 have neither: saturation is the only option
        big = jnp.float32(fmt.max)
    else:
        big = jnp.float32(jnp.inf if fmt.has_inf else jnp.nan)
    r = jnp.where(jnp.abs(r_f32) > jnp.float32(fmt.max), _copysign(big, x_f32), r_f32)
    if not (fmt.has_inf or fmt.has_nan):  # ±inf -> ±max; NaN stays NaN in the f32 result
        return jnp.where(
            jnp.isinf(x_f32), _copysign(jnp.float32(fmt.max), x_f32), jnp.where(jnp.isnan(x_f32), x_f32, r)
        )
    return jnp.where(jnp.isfinite(x_f32), r, x_f32)


def _finish(r_f32: jax.Array, fmt: FloatFormat, out_dtype) -> jax.Array:
    if out_dtype is None:
        out_dtype = fmt.dtype if fmt.xla_storable else jnp.float32
    out = out_dtype
    return r_f32.astype(out)  # exact: r is already on fmt's grid (or non-finite)


def round_nearest(x, dtype, *, saturate: bool | None = None, out_dtype=None) -> jax.Array:
    """Round ``x`` to nearest (ties to even) into ``dtype``; identical eagerly and under ``jit``.

    Args:
      x: floating-point array (any float dtype; computed in f32).
      dtype: target format: bfloat16, float16, float8_e4m3fn, float8_e5m2, float6_e2m3fn, float6_e3m2fn,
        float4_e2m1fn (float32 returns x as f32).
      saturate: overflow policy (see module docstring); None = saturate iff the format has no inf.
      out_dtype: dtype of the returned array; default ``dtype`` (f32 for the fp6 formats, which XLA cannot
        store). Pass ``jnp.float32`` to get the rounded values as f32 (exactly on ``dtype``'s grid), which is
        what update rules need to form exact deltas.
    """
    fmt = get_format(dtype)
    x32 = _as_f32(x)
    if fmt.mantissa_bits >= _F32_MANTISSA:
        return _finish(x32, fmt, out_dtype)
    r = _nearest_even_bits(x32, _F32_MANTISSA - fmt.mantissa_bits)
    if fmt.emin == -126 and fmt.has_inf and not saturate:
        # bf16: f32's exponent range, so the bit carry already yields ±inf on overflow and infinities stay
        # infinite; only NaN needs a guard (a NaN payload could carry into the sign bit). Fast path.
        return _finish(jnp.where(x32 != x32, x32, r), fmt, out_dtype)
    if fmt.emin > -126:  # target subnormals lie in f32's normal range: fixed spacing s
        s = fmt.smallest_subnormal
        r_sub = lax.round(x32 * jnp.float32(1.0 / s), lax.RoundingMethod.TO_NEAREST_EVEN) * jnp.float32(s)
        r = jnp.where(jnp.abs(x32) < jnp.float32(fmt.smallest_normal), r_sub, r)
    return _finish(_overflow(x32, r, fmt, saturate), fmt, out_dtype)


def round_stochastic(x, dtype, key, *, saturate: bool | None = None, out_dtype=None, rng: str = "hash") -> jax.Array:
    """Unbiased stochastic rounding of ``x`` into ``dtype``: E[result] = x for every finite x inside the range.

    ``x`` rounds up in magnitude to the next grid point with probability (|x| - lo) / (hi - lo), else down to lo.
    Normal range: a uniform random integer of ``k = 23 - p`` bits is added below the kept mantissa bits and the
    result truncated (exactly unbiased). Subnormal range of the target: ``floor(|x|/s) + [u < frac(|x|/s)]`` with
    a 24-bit uniform u (bias below 2^-24 of one subnormal step). One u32 of randomness per element, from
    :func:`lpt.numerics.random_bits` (``rng="hash"``: a keyed hash of the element index, one mixer call per
    element instead of threefry's 20 rounds, with the key words mixed first, so a raw ``jax.random.key(seed)``
    serves as well as a derived key; ``rng="threefry"``: ``jax.random.bits``). Both are sharding-invariant.

    Args:
      x, dtype, saturate, out_dtype: as :func:`round_nearest`.
      key: a JAX PRNG key (typed or raw uint32).
      rng: ``"hash"`` or ``"threefry"`` (above).
    """
    fmt = get_format(dtype)
    x32 = _as_f32(x)
    if fmt.mantissa_bits >= _F32_MANTISSA:
        return _finish(x32, fmt, out_dtype)
    rnd = random_bits(key, x32.shape, rng)
    drop = _F32_MANTISSA - fmt.mantissa_bits
    b = _bits(x32) + (rnd >> jnp.uint32(32 - drop))
    r = _from_bits(b & jnp.uint32(~((1 << drop) - 1) & 0xFFFFFFFF))
    if fmt.emin > -126:
        s = fmt.smallest_subnormal
        y = jnp.abs(x32) * jnp.float32(1.0 / s)  # exact power-of-two scaling
        fl = jnp.floor(y)
        u = (rnd >> jnp.uint32(8)).astype(jnp.float32) * jnp.float32(2.0**-24)  # u32 -> f32, exact (< 2^24)
        r_sub = _copysign((fl + (u < y - fl).astype(jnp.float32)) * jnp.float32(s), x32)  # bool -> f32
        r = jnp.where(jnp.abs(x32) < jnp.float32(fmt.smallest_normal), r_sub, r)
    return _finish(_overflow(x32, r, fmt, saturate), fmt, out_dtype)


def round_to_bits(x, mantissa_bits: int, max_abs: float | None = None) -> jax.Array:
    """Emulate a float register with ``mantissa_bits`` explicit mantissa bits and f32's exponent range.

    Round-to-nearest-even on the f32 bits; the result is f32 (on the emulated grid). ``max_abs`` saturates the
    magnitude (e.g. 448 for an FP8 e4m3 accumulator). ``mantissa_bits`` must be an int in [0, 23].
    """
    if not isinstance(mantissa_bits, int) or not 0 <= mantissa_bits <= _F32_MANTISSA:
        raise ValueError(f"mantissa_bits must be an int in [0, 23], got {mantissa_bits!r}")
    if max_abs is not None and not max_abs > 0:
        raise ValueError(f"max_abs must be positive or None, got {max_abs!r}")
    x32 = _as_f32(x)
    r = _nearest_even_bits(x32, _F32_MANTISSA - mantissa_bits)
    if max_abs is not None:
        r = jnp.clip(r, jnp.float32(-max_abs), jnp.float32(max_abs))
    return jnp.where(jnp.isnan(x32), x32, r)


def update_dtype(param_dtype) -> jnp.dtype:
    """The dtype an update rule emits a parameter's change in: the param's own dtype for 16- and 32-bit floats
    (what ``jax.grad`` gives as the gradient's dtype, so optax's wrappers that build updates from the gradients
    see one type), float32 for narrower formats (a difference of two float8 values seldom fits float8)."""
    dt = jnp.dtype(param_dtype)
    return dt if dt.itemsize >= 2 else jnp.dtype(jnp.float32)


def change_to(p32, new32, param_dtype) -> jax.Array:
    """The update that moves ``p`` to ``new``, in :func:`update_dtype` of ``param_dtype``: ``RNE(new − p)`` (both f32,
    on the param's grid). It is exact, and adding it lands on ``new`` bit for bit, whenever ``new − p`` fits the
    update dtype: always for float32 updates, and for 16-bit ones whenever ``p/2 <= new <= 2p`` (Sterbenz). Otherwise
    (a weight that more than halves, doubles or changes sign in one step) the change is rounded to nearest: adding it
    lands within 2^-8 of the change (bf16; 2^-11 for float16) of ``new``."""
    udt = update_dtype(param_dtype)
    if udt.itemsize >= 4:
        return (new32 - p32).astype(udt)  # f32 difference -> update dtype (f32: no-op)
    return round_nearest(new32 - p32, udt)  # f32 -> 16-bit update, to nearest even
