"""The block layout of the microscaling formats (:mod:`lpt.fp8.microscaling.formats`): argument checks, the tiles
of a tensor along an axis (1-D blocks or 2-D tiles), the grouped shape a block reduction works on, and the scales'
shapes. The checks look at shapes and dtypes only (no array math), so they run before the jitted math of the
formats is traced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ROUNDINGS",
    "block_tiles",
    "check_float",
    "check_rounding",
    "check_scales",
    "grouped_shape",
]

ROUNDINGS = ("nearest", "stochastic")


def check_float(x, what: str = "x") -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{what} must be a floating-point array, got dtype {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{what} must have at least one axis, got a scalar")
    return x


def check_rounding(rounding: str, key) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a key (a JAX PRNG key), got key=None")


def _positive_int(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v <= 0:
        raise ValueError(f"{what} must be a positive int, got {v!r}")
    return int(v)


def block_tiles(shape: tuple[int, ...], axis: int, block_size, block_shape) -> dict[int, int]:
    """{axis: block length} of the blocks: 1 x block_size along ``axis``, or a 2-D ``block_shape`` tile on the last
    two axes. Raises ValueError if a tiled axis is not a multiple of its block length."""
    ndim = len(shape)
    if block_shape is None:
        if not isinstance(axis, int | np.integer) or not -ndim <= axis < ndim:
            raise ValueError(f"axis={axis!r} is out of range for an array of shape {shape}")
        tiles = {int(axis) % ndim: _positive_int(block_size, "block_size")}
    else:
        if not isinstance(block_shape, tuple | list) or len(block_shape) != 2:
            raise ValueError(f"block_shape must be a pair (rows, cols) or None, got {block_shape!r}")
        if ndim < 2:
            raise ValueError(f"block_shape={tuple(block_shape)} tiles the last two axes; x has shape {shape}")
        if axis not in (-1, ndim - 1):
            raise ValueError(f"block_shape tiles the last two axes, so axis must be -1; got axis={axis!r}")
        r, c = (_positive_int(b, "block_shape entries") for b in block_shape)
        tiles = {ndim - 2: r, ndim - 1: c}
    for ax, b in tiles.items():
        if shape[ax] % b:
            raise ValueError(
                f"x.shape[{ax}]={shape[ax]} (shape {shape}) is not a multiple of the block length {b}; "
                "pad the tensor or choose a block that divides it"
            )
    return tiles


def grouped_shape(shape: tuple[int, ...], tiles: dict[int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape with every tiled axis split into (blocks, block length), and the positions of the block-length axes."""
    grouped: list[int] = []
    inner: list[int] = []
    for ax, n in enumerate(shape):
        if ax in tiles:
            grouped += [n // tiles[ax], tiles[ax]]
            inner.append(len(grouped) - 1)
        else:
            grouped.append(n)
    return tuple(grouped), tuple(inner)


def _scale_shape(shape: tuple[int, ...], tiles: dict[int, int]) -> tuple[int, ...]:
    return tuple(n // tiles[ax] if ax in tiles else n for ax, n in enumerate(shape))


def check_scales(s: jax.Array, shape, tiles, what: str) -> None:
    """Raises ValueError unless ``s`` has the scales' shape for codes of ``shape`` (each tiled axis divided by its
    block length); ``jnp.expand_dims(s, inner)`` (``grouped_shape``'s inner axes) then broadcasts against the
    grouped codes."""
    want = _scale_shape(tuple(shape), tiles)
    if tuple(s.shape) != want:
        raise ValueError(f"{what} has shape {tuple(s.shape)}; codes of shape {tuple(shape)} need {want}")
