"""Health of the block scales of MXFP8 and NVFP4: blocks whose scale leaves the scale format's range, blocks whose
largest element clips at the element format's max, and the quantize-dequantize round trip.

:func:`block_scale_health` counts, for one tensor quantized as ``recipe`` quantizes it (``"mxfp8"``:
:func:`lpt.fp8.mx_quantize` with e4m3 codes and e8m0 scales in 1x32 blocks; ``"nvfp4"``:
:func:`lpt.fp8.nvfp4_quantize` with e2m1 codes and e4m3 block scales after the f32 tensor scale, 1x16 blocks or
16x16 tiles), the blocks that are

* **saturated**: the scale the block needs lies above the scale format's largest. MX: ``floor(log2 amax) - 8 >
  127`` (e8m0's largest exponent); NVFP4: ``block_amax · S_enc / 6`` rounds (nearest even) above 448, e4m3's max.
  A block holding inf or NaN counts here too (its scale is NaN). With finite inputs neither happens: a finite f32
  has ``floor(log2 amax) <= 127``, so MX's exponent is at most 119, and S_enc maps the tensor's amax onto 448 · 6,
  so no block of the same tensor needs more (an inf elsewhere in the tensor sets S_enc to 1, and then large finite
  blocks do).
* **underflow**: non-zero and finite, with a scale below the scale format's smallest normal. MX: ``floor(log2
  amax) - 8 < -127`` (amax below 2^-119): the scale stays at 2^-127 and the codes lose their leading bits or flush
  to 0; NVFP4: the block scale rounds to an e4m3 subnormal (below 2^-6, fewer than 3 significant bits) or to 0
  (the block decodes to 0): a block amax below about 2^-14.8 (3.5e-5) of the tensor's.
* **clipped**: finite, with a non-zero scale, whose largest element divided by its scale rounds (nearest even,
  unbounded exponent) above the element format's max, so that it saturates there. MX's floor rule puts
  ``amax / scale`` in [256, 512): e4m3 clips the blocks above 464 (their maximum up to 12.5% too small), about one
  block in seven if the mantissas of the block maxima are log-uniform; NVFP4's rounded block scale keeps
  ``amax / scale`` within 6 · (1 ± 2^-4) for a normal scale, which e2m1 rounds to 6: it clips only under a
  subnormal block scale.

:func:`gemm_block_health` applies it to the operands of :func:`lpt.fp8.block_scaled_dot`'s forward GEMM (x in blocks
along K; w MXFP8 along K, NVFP4 in 16x16 tiles); :func:`quantize_dequantize` is one operand's round trip in f32.
Everything is jittable; counts are int32 scalars.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lpt.fp8.microscaling._layout import check_float, check_rounding
from lpt.fp8.microscaling.dot import BLOCKS, check_recipe
from lpt.fp8.microscaling.formats import (
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    NVFP4_TILE,
    mx_block_exponents,
    mx_blocks,
    mx_dequantize,
    mx_quantize,
    nvfp4_block_scales,
    nvfp4_blocks,
    nvfp4_dequantize,
    nvfp4_quantize,
)
from lpt.numerics import get_format, round_nearest

__all__ = ["BlockHealth", "block_scale_health", "gemm_block_health", "operand_layout", "quantize_dequantize"]

_MX_BLOCK = BLOCKS["mxfp8"]
_E4M3 = jnp.dtype(jnp.float8_e4m3fn)
_E2M1 = jnp.dtype(jnp.float4_e2m1fn)


class BlockHealth(NamedTuple):
    """Block counts of one tensor (int32 scalars) and its number of blocks (a Python int)."""

    saturated: jax.Array
    underflow: jax.Array
    clipped: jax.Array
    blocks: int

    def shares(self) -> dict[str, jax.Array]:
        """``{"saturated", "underflow", "clipped"}`` as f32 shares of all blocks."""
        n = jnp.float32(self.blocks)
        return {k: getattr(self, k).astype(jnp.float32) / n for k in ("saturated", "underflow", "clipped")}  # i32->f32


def _rounds_above_max(v_f32: jax.Array, dtype) -> jax.Array:
    """``v`` (f32, >= 0) rounds to nearest even above ``dtype``'s max on an unbounded exponent range: above the
    midpoint to the next value, or on it when the max has an odd significand (the tie goes up)."""
    fmt = get_format(dtype)
    ulp = 2.0 ** (fmt.emax - fmt.mantissa_bits)  # spacing of the binade of the max
    mid = jnp.float32(fmt.max + ulp / 2)  # exact in f32
    odd = int(round(fmt.max / ulp)) % 2 == 1
    return (v_f32 >= mid) if odd else (v_f32 > mid)


def _count(mask: jax.Array) -> jax.Array:
    return jnp.sum(mask.astype(jnp.int32))  # bool -> int32 count


def _blocks(shape, recipe: str, axis, block_shape=None) -> tuple[int, tuple[int, ...] | None]:
    """Checks ``recipe``'s blocks on an array of ``shape``; ``(number of blocks, block_shape as a tuple)``."""
    if recipe == "mxfp8":
        _, grouped, inner = mx_blocks(shape, _E4M3, _MX_BLOCK, axis, block_shape)
    else:
        grouped, inner = nvfp4_blocks(shape, axis, block_shape)
    blocks = math.prod(n for i, n in enumerate(grouped) if i not in inner)
    return blocks, None if block_shape is None else tuple(block_shape)


def block_scale_health(x, recipe: str, axis: int = -1, *, block_shape: tuple[int, int] | None = None) -> BlockHealth:
    """Saturated, underflowing and clipped blocks of ``x`` quantized in ``recipe`` (module docstring).

    ``axis`` / ``block_shape`` as for the quantizer: 1x32 (MXFP8) or 1x16 (NVFP4) blocks along ``axis``, or 2-D
    tiles of the last two axes (NVFP4: only (16, 16)). ValueError for an unknown recipe or a shape the blocks do
    not divide."""
    check_recipe(recipe)
    x = check_float(x)
    blocks, block_shape = _blocks(x.shape, recipe, axis, block_shape)
    return BlockHealth(*_block_counts(x, recipe, axis, block_shape), blocks)


@functools.partial(jax.jit, static_argnames=("recipe", "axis", "block_shape"))
def _block_counts(x, recipe: str, axis, block_shape) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(saturated, underflow, clipped)`` of :func:`block_scale_health` (its arguments checked)."""
    if recipe == "mxfp8":
        mx = mx_block_exponents(x, _E4M3, _MX_BLOCK, axis, block_shape=block_shape)
        finite = ~mx.block_nonfinite
        saturated = mx.block_nonfinite | (mx.exponent > E8M0_MAX_EXP)
        underflow = finite & (mx.block_amax > 0) & (mx.exponent < E8M0_MIN_EXP)
        e = jnp.clip(mx.exponent, E8M0_MIN_EXP, E8M0_MAX_EXP)
        # amax · 2^-e: exact in f32 for e in [-127, 119] (e4m3: e <= 119 for finite amax); 0 for a subnormal amax
        scaled = mx.block_amax * jnp.exp2(-e.astype(jnp.float32))  # i32 -> f32 exponent, exact power of two
        clipped = finite & ~underflow & _rounds_above_max(scaled, _E4M3)
    else:
        nv = nvfp4_block_scales(x, axis, block_shape=block_shape)
        raw = nv.block_scale_f32
        over = jnp.isnan(round_nearest(raw, _E4M3, saturate=False, out_dtype=jnp.float32))  # f32 -> e4m3, NaN above
        bs = round_nearest(raw, _E4M3, saturate=True, out_dtype=jnp.float32)  # f32 -> e4m3 grid (RNE), as quantized
        finite = ~nv.block_nonfinite
        saturated = nv.block_nonfinite | over
        underflow = finite & (nv.block_amax > 0) & (bs < jnp.float32(get_format(_E4M3).smallest_normal))
        enc = jnp.minimum(jnp.float32(1.0) / (bs * nv.tensor_scale), jnp.float32(jnp.finfo(jnp.float32).max))
        scaled = nv.block_amax * enc  # f32: the quantizer's x · enc for the block maximum
        clipped = finite & (bs > 0) & _rounds_above_max(scaled, _E2M1)
    return _count(saturated), _count(underflow), _count(clipped)


def operand_layout(recipe: str, operand: str) -> dict:
    """The blocks of ``block_scaled_dot``'s operands as ``block_scale_health`` / ``quantize_dequantize`` keywords:
    ``"x"`` [M, K] and the gradient ``"g"`` [M, N] of the dX GEMM along their last axis, ``"w"`` [K, N] along K
    (MXFP8) or in 16x16 tiles (NVFP4)."""
    check_recipe(recipe)
    if operand in ("x", "g"):
        return {"axis": -1}
    if operand == "w":
        return {"axis": -1, "block_shape": NVFP4_TILE} if recipe == "nvfp4" else {"axis": 0}
    raise ValueError(f"operand must be one of ('x', 'w', 'g'), got {operand!r}")


def gemm_block_health(x, w, recipe: str) -> tuple[BlockHealth, BlockHealth]:
    """``(x's, w's)`` :class:`BlockHealth` as ``block_scaled_dot(x[..., K], w[K, N], recipe)``'s forward GEMM
    quantizes them."""
    check_recipe(recipe)
    x, w = check_float(x), check_float(w, "w")
    if x.size % w.shape[0]:
        raise ValueError(f"x of shape {x.shape} does not split into rows of w.shape[0]={w.shape[0]}")
    x_shape = (x.size // w.shape[0], w.shape[0])
    x_blocks, _ = _blocks(x_shape, recipe, **operand_layout(recipe, "x"))
    w_blocks, _ = _blocks(w.shape, recipe, **operand_layout(recipe, "w"))
    hx, hw = _gemm_counts(x, w, recipe)
    return BlockHealth(*hx, x_blocks), BlockHealth(*hw, w_blocks)


@functools.partial(jax.jit, static_argnames="recipe")
def _gemm_counts(x, w, recipe: str):
    x2 = x.reshape(-1, w.shape[0])
    return tuple(
        _block_counts(a, recipe, layout["axis"], layout.get("block_shape"))
        for a, layout in ((x2, operand_layout(recipe, "x")), (w, operand_layout(recipe, "w")))
    )


def quantize_dequantize(
    x,
    recipe: str,
    axis: int = -1,
    *,
    block_shape: tuple[int, int] | None = None,
    rounding: str = "nearest",
    key=None,
) -> jax.Array:
    """``x`` quantized in ``recipe`` (blocks as in :func:`block_scale_health`) and dequantized, as f32.

    Args:
      x: floating-point array.
      recipe: ``"mxfp8"`` or ``"nvfp4"``.
      axis: the blocked axis (1x32 MXFP8 or 1x16 NVFP4 blocks); its length a multiple of the block length.
      block_shape: ``(rows, cols)`` 2-D tiles on the last two axes instead (NVFP4: only (16, 16)); ``axis`` stays -1.
      rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (needs ``key``); the codes only.
      key: JAX PRNG key for ``rounding="stochastic"``.
    """
    check_recipe(recipe)
    x = check_float(x)
    check_rounding(rounding, key)
    _, block_shape = _blocks(x.shape, recipe, axis, block_shape)
    return _quantize_dequantize(x, key, recipe, axis, block_shape, rounding)


@functools.partial(jax.jit, static_argnames=("recipe", "axis", "block_shape", "rounding"))
def _quantize_dequantize(x, key, recipe: str, axis, block_shape, rounding: str) -> jax.Array:
    q = dict(block_shape=block_shape, rounding=rounding, key=key)
    if recipe == "mxfp8":
        codes, scales = mx_quantize(x, _E4M3, _MX_BLOCK, axis, **q)
        return mx_dequantize(codes, scales, _MX_BLOCK, axis, jnp.float32, block_shape=block_shape)  # -> f32
    codes, bscales, tscale = nvfp4_quantize(x, axis, **q)
    return nvfp4_dequantize(codes, bscales, tscale, axis, jnp.float32, block_shape=block_shape)  # -> f32
