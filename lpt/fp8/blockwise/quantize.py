"""Fine-grained FP8 quantization: 1 x B tiles (activations, gradients), B x B blocks (weights), one scale per tile.

For a tile ``t`` (B consecutive elements along one axis, or a B x B block) and FP8 format with largest finite value
``F`` (448 for float8_e4m3fn, 57344 for float8_e5m2), with the scale of :func:`lpt.fp8.recipe.block_scale`::

    amax  = max |t|
    r     = max(amax / F, 2^-126)             (f32; 2^-126 is the smallest normal f32)
    scale = r                                 (scale_format="f32")
    scale = 2 ** ceil(log2(r))                (scale_format="pow2": dividing by it is exact, amax/scale <= F)
    scale = 1                                 if amax == 0
    q     = round_nearest(t / scale, fp8)     (saturating, so f32 round-off in t/scale can never give inf)
    t     ~ q * scale                         (dequantize)

The floor at 2^-126 applies to tiles with ``amax < F * 2^-126`` (about 5.3e-36 for e4m3, 6.7e-34 for e5m2), whose
``amax / F`` would be an f32 subnormal, which XLA flushes to zero (CPU, GPU, TPU), leaving ``t / 0 = inf`` and NaN
codes. With the floor the scale is exactly 2^-126, so ``t / scale = t * 2^126`` is exact and every normal f32 element
gets a code in [1, F): a normal FP8 value, rounded with the format's full relative precision, and ``q * scale`` is
again a normal f32. The only elements lost are f32 subnormals (below 2^-126), which XLA already flushes to zero on
input; a tile of nothing but f32 subnormals compares equal to zero and gets scale 1. No amax clamp is applied, so
small tiles are not flushed to zero (DeepGEMM clamps amax at 1e-4, torchao at 1e-12). Tiles with
``amax >= F * 2^-126`` are untouched by the floor.

Design decision — shapes: the tiled axis (and both axes of a weight) must be a multiple of the block size; anything
else raises ``ValueError``. We do not pad silently, because a padded weight would change the layer's shape.
(``lpt.fp8.blockwise_dot`` zero-pads only the *token* axis of its dW GEMM, which is exact: zeros add nothing to the
sum and never raise a tile's amax.) A NaN or inf input makes its tile's scale NaN or inf, so the whole tile
dequantizes to NaN and the GEMM output surfaces it instead of clipping it away.

Each function checks its arguments in Python, then runs its array math as one jitted program (dtypes, axis, block
and scale format static), so an eager call compiles once per shape and options; under ``jit`` it is inlined.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lpt.fp8.recipe import block_scale, check_dtype_in
from lpt.numerics import get_format, round_nearest
from lpt.numerics.scaling import check_scale_format

__all__ = [
    "FP8_DTYPES",
    "QuantStats",
    "check_fp8_dtype",
    "dequantize_blocks",
    "dequantize_tiles",
    "quantize_blocks",
    "quantize_tensor",
    "quantize_tiles",
    "quantization_stats",
]

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def check_fp8_dtype(dtype, what: str = "dtype") -> jnp.dtype:
    return check_dtype_in(dtype, FP8_DTYPES, what)


def _check_float(x, what: str) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{what} must be a floating-point array, got dtype {x.dtype}")
    return x


def _quantize_grouped(x_f32: jax.Array, dtype, scale_format: str, reduce_axes: tuple[int, ...]):
    amax = jnp.max(jnp.abs(x_f32), axis=reduce_axes, keepdims=True)
    scale = block_scale(amax, dtype, scale_format)
    q = round_nearest(x_f32 / scale, dtype, saturate=True)  # f32 -> fp8, RNE, saturating
    return q, scale


def quantize_tiles(x, dtype=jnp.float8_e4m3fn, *, axis: int = -1, block: int = 128, scale_format: str = "f32"):
    """Quantize ``x`` in 1 x ``block`` tiles along ``axis``.

    Returns ``(q, scale)``: ``q`` has x's shape in ``dtype``; ``scale`` is f32 with ``x.shape[axis] // block`` in
    place of ``axis``. Raises ValueError if ``x.shape[axis]`` is not a multiple of ``block``.

    Args:
      x: floating-point array.
      dtype: FP8 format of ``q`` (float8_e4m3fn or float8_e5m2).
      axis: the tiled axis.
      block: tile length.
      scale_format: ``"f32"`` (scale = amax / max) or ``"pow2"`` (rounded up to a power of two).
    """
    dtype = check_fp8_dtype(dtype)
    x = _check_float(x, "x")
    axis = axis % x.ndim
    size = x.shape[axis]
    if block <= 0 or size % block:
        raise ValueError(
            f"x.shape[{axis}]={size} (shape {x.shape}) must be a multiple of the tile size {block}; "
            "pad the tensor or choose a block size that divides it"
        )
    check_scale_format(scale_format)
    return _quantize_tiles(x, dtype, axis, block, scale_format)


@functools.partial(jax.jit, static_argnames=("dtype", "axis", "block", "scale_format"))
def _quantize_tiles(x, dtype, axis: int, block: int, scale_format: str):
    x32 = x.astype(jnp.float32)  # any float -> f32
    shape_g = x.shape[:axis] + (x.shape[axis] // block, block) + x.shape[axis + 1 :]
    q, scale = _quantize_grouped(x32.reshape(shape_g), dtype, scale_format, (axis + 1,))
    return q.reshape(x.shape), jnp.squeeze(scale, axis + 1)


def dequantize_tiles(q, scale, *, axis: int = -1, block: int = 128, dtype=jnp.float32) -> jax.Array:
    """Inverse of :func:`quantize_tiles`: ``q * scale`` (each scale repeated over its tile), cast to ``dtype``.

    Args:
      q: FP8 codes.
      scale: f32 scales, ``q.shape[axis] // block`` in place of ``axis``.
      axis, block: as given to :func:`quantize_tiles`.
      dtype: output dtype.
    """
    return _dequantize_tiles(q, scale, axis % jnp.ndim(q), block, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("axis", "block", "dtype"))
def _dequantize_tiles(q, scale, axis: int, block: int, dtype) -> jax.Array:
    s = jnp.repeat(scale, block, axis=axis)
    return (q.astype(jnp.float32) * s).astype(dtype)  # fp8 -> f32 exact; product f32 -> dtype


def quantize_blocks(w, dtype=jnp.float8_e4m3fn, *, block: int = 128, scale_format: str = "f32"):
    """Quantize a 2-D weight ``w[K, N]`` in ``block`` x ``block`` blocks; returns ``(q[K, N], scale[K/b, N/b])``."""
    dtype = check_fp8_dtype(dtype)
    w = _check_float(w, "w")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [K, N], got shape {w.shape}")
    k, n = w.shape
    if block <= 0 or k % block or n % block:
        raise ValueError(f"weight shape {w.shape} must have both dims multiples of the block size {block}")
    check_scale_format(scale_format)
    return _quantize_blocks(w, dtype, block, scale_format)


@functools.partial(jax.jit, static_argnames=("dtype", "block", "scale_format"))
def _quantize_blocks(w, dtype, block: int, scale_format: str):
    k, n = w.shape
    w32 = w.astype(jnp.float32).reshape(k // block, block, n // block, block)  # any float -> f32
    q, scale = _quantize_grouped(w32, dtype, scale_format, (1, 3))
    return q.reshape(k, n), scale[:, 0, :, 0]


def dequantize_blocks(q, scale, *, block: int = 128, dtype=jnp.float32) -> jax.Array:
    """Inverse of :func:`quantize_blocks`."""
    return _dequantize_blocks(q, scale, block, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("block", "dtype"))
def _dequantize_blocks(q, scale, block: int, dtype) -> jax.Array:
    s = jnp.repeat(jnp.repeat(scale, block, axis=0), block, axis=1)
    return (q.astype(jnp.float32) * s).astype(dtype)  # fp8 -> f32 exact; product f32 -> dtype


def quantize_tensor(x, dtype=jnp.float8_e4m3fn, *, scale_format: str = "f32"):
    """Per-tensor baseline: one scale for the whole tensor; returns ``(q, scale[])``."""
    dtype = check_fp8_dtype(dtype)
    x = _check_float(x, "x")
    check_scale_format(scale_format)
    return _quantize_tensor(x, dtype, scale_format)


@functools.partial(jax.jit, static_argnames=("dtype", "scale_format"))
def _quantize_tensor(x, dtype, scale_format: str):
    x32 = x.astype(jnp.float32)  # any float -> f32
    q, scale = _quantize_grouped(x32, dtype, scale_format, tuple(range(x.ndim)))
    return q, scale.reshape(())


class QuantStats(NamedTuple):
    """Counts of what quantization lost: values clipped at the format max, nonzeros flushed to zero, and nonzeros
    stored as subnormals (fewer mantissa bits)."""

    saturated: jax.Array  # int32: |x / scale| > max(dtype) before rounding
    underflowed: jax.Array  # int32: x != 0 but q == 0
    total: jax.Array  # int32: number of elements
    subnormal: jax.Array  # int32: x != 0 and |q| < smallest normal of dtype (flushed entries included)


def quantization_stats(x, q, scale, *, axis: int | None = -1, block: int = 128) -> QuantStats:
    """Saturation / underflow / subnormal counts for ``q, scale = quantize_*(x)``.

    ``axis=None`` means ``scale`` is per-block of a 2-D weight (``quantize_blocks``) or a scalar (per-tensor).

    Args:
      x: the floating-point array that was quantized.
      q: its FP8 codes.
      scale: its f32 scales (tiles, blocks or a scalar).
      axis: the tiled axis of :func:`quantize_tiles`; None: blocks of :func:`quantize_blocks` or a per-tensor scale.
      block: tile / block length.
    """
    x = _check_float(x, "x")
    axis = None if axis is None or scale.ndim == 0 else axis % x.ndim
    return _quantization_stats(x, q, scale, axis, block, scale.ndim == 0)


@functools.partial(jax.jit, static_argnames=("axis", "block", "per_tensor"))
def _quantization_stats(x, q, scale, axis: int | None, block: int, per_tensor: bool) -> QuantStats:
    x32 = x.astype(jnp.float32)  # any float -> f32
    if per_tensor:
        s = scale
    elif axis is None:
        s = jnp.repeat(jnp.repeat(scale, block, axis=0), block, axis=1)
    else:
        s = jnp.repeat(scale, block, axis=axis)
    fmax = jnp.float32(get_format(q.dtype).max)
    saturated = jnp.sum((jnp.abs(x32 / s) > fmax).astype(jnp.int32))  # bool -> int32
    q32 = q.astype(jnp.float32)  # fp8 -> f32 (exact)
    nonzero = x32 != 0
    underflowed = jnp.sum((nonzero & (q32 == 0)).astype(jnp.int32))  # bool -> int32
    tiny = jnp.float32(get_format(q.dtype).smallest_normal)
    subnormal = jnp.sum((nonzero & (jnp.abs(q32) < tiny)).astype(jnp.int32))  # bool -> int32
    return QuantStats(saturated, underflowed, jnp.int32(x32.size), subnormal)
