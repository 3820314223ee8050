"""The scale of a block of values stored in a narrow float: one f32 (or power-of-two) number per block.

Shared by blockwise FP8 (:mod:`lpt.fp8.blockwise.quantize`, through :mod:`lpt.fp8.recipe`) and Adam's 8-bit moments
(:mod:`lpt.optim.moments8`)::

    r     = max(amax / F, 2^-126)             (f32; F the format's largest finite value, 2^-126 the smallest normal f32)
    scale = r                                 (scale_format="f32")
    scale = 2 ** ceil(log2(r))                (scale_format="pow2": dividing by it is exact, amax/scale <= F)
    scale = 1                                 if amax == 0

The floor keeps ``amax / F`` out of the f32 subnormals, which XLA flushes to zero (``t / 0 = inf``); a NaN or inf
amax gives a non-finite scale, so the block dequantizes to NaN instead of hiding it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lpt.numerics.formats import exponent_of, get_format, pow2

SCALE_FORMATS = ("f32", "pow2")
_F32_SMALLEST_NORMAL = 2.0**-126  # the smallest scale: t / scale stays exact and finite for every normal f32 t


def check_scale_format(scale_format: str) -> None:
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format must be one of {SCALE_FORMATS}, got {scale_format!r}")


def block_scale(amax_f32: jax.Array, dtype, scale_format: str = "f32") -> jax.Array:
    """f32 scale with ``amax / scale <= max(dtype)``, never below 2^-126; 1 where amax == 0 (module docstring)."""
    fmax = jnp.float32(get_format(dtype).max)
    check_scale_format(scale_format)
    # f32 / f32, floored at the smallest normal f32: a subnormal quotient would be flushed to 0 (x / 0 = inf).
    # maximum() propagates NaN, so a NaN amax still gives a NaN scale.
    ratio = jnp.maximum(amax_f32 / fmax, jnp.float32(_F32_SMALLEST_NORMAL))
    if scale_format == "pow2":
        e = exponent_of(ratio)  # floor(log2 ratio) from the f32 bits
        e = e + (ratio > pow2(e)).astype(jnp.int32)  # bool -> int32: ceil(log2 ratio)
        ratio = jnp.where(jnp.isfinite(ratio), pow2(e), ratio)
    return jnp.where(amax_f32 == 0, jnp.float32(1.0), ratio)  # NaN / inf amax stay non-finite
