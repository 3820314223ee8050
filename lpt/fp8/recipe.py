"""What the two recipes of :mod:`lpt.fp8` share: the names of the GEMM implementations, the block-scale rule of
DeepSeek-V3's blockwise FP8, and the checks of a dense layer's arguments.

* :data:`IMPLS`: every ``impl`` a GEMM of :mod:`lpt.fp8` takes. Each recipe accepts a subset (:func:`impls`) and
  refuses the rest with :func:`check_impl`: blockwise FP8 (:data:`lpt.fp8.blockwise.IMPLS`) runs XLA, Pallas or
  Mosaic GPU GEMMs; the microscaling formats (:data:`lpt.fp8.microscaling.IMPLS`) run XLA or
  :func:`jax.nn.scaled_matmul`.
* :func:`block_scale` (with :data:`SCALE_FORMATS` and :func:`check_scale_format`): an f32 or power-of-two scale per
  block from its amax, ``max(amax / F, 2^-126)`` (:mod:`lpt.numerics.scaling`, shared with Adam's 8-bit moments).
  The microscaling formats store their scales in narrow formats instead, by their own specifications (OCP MX:
  ``2^(floor(log2 amax) - emax_elem)`` in e8m0; NVFP4: an e4m3 block scale under an f32 tensor scale), in
  :mod:`lpt.fp8.microscaling.formats`.
* :func:`check_dense_operands`, :func:`check_dtype_in`: one-line ValueErrors for a dense layer's operands and for a
  dtype outside a recipe's formats.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lpt.numerics.scaling import SCALE_FORMATS, block_scale, check_scale_format

__all__ = [
    "IMPLS",
    "SCALE_FORMATS",
    "block_scale",
    "check_dense_operands",
    "check_dtype_in",
    "check_impl",
    "check_scale_format",
    "impls",
]

# "auto": chosen by the device; "xla": XLA ops (the reference, every platform); "pallas": the portable Pallas kernel;
# "mosaic_gpu": the Hopper wgmma kernel; "scaled_matmul": jax.nn.scaled_matmul (cuDNN's block-scaled GEMM)
IMPLS = ("auto", "xla", "pallas", "mosaic_gpu", "scaled_matmul")


def impls(*names: str) -> tuple[str, ...]:
    """A recipe's ``impl`` names, each one of :data:`IMPLS` (a ValueError names any other)."""
    unknown = [n for n in names if n not in IMPLS]
    if unknown:
        raise ValueError(f"{unknown} are not GEMM implementations of lpt.fp8; those are {IMPLS}")
    return names


def check_impl(impl, allowed: tuple[str, ...], recipe: str) -> str:
    """``impl`` if it is one of ``allowed`` (the recipe's :func:`impls`); a one-line ValueError naming the value,
    the recipe and what it allows otherwise."""
    if impl not in allowed:
        raise ValueError(f"impl must be one of {allowed} for {recipe}, got {impl!r}")
    return impl


def check_dtype_in(dtype, allowed, what: str = "dtype") -> jnp.dtype:
    """``dtype`` as a jnp dtype if it is one of ``allowed``; a one-line ValueError naming both otherwise."""
    names = " or ".join(jnp.dtype(a).name for a in allowed)
    try:
        d = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"{what} must be {names}, got {dtype!r}") from e
    if d not in allowed:
        raise ValueError(f"{what} must be {names}, got {d}")
    return d


def check_dense_operands(x, w) -> tuple[jax.Array, jax.Array]:
    """``(x, w)`` as arrays for a dense layer's ``x[..., K] @ w[K, N]``: a one-line ValueError for a non-float
    operand, a ``w`` that is not 2-D, or mismatched K."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [K, N], got shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"x[..., K] and w[K, N] disagree on K: x {x.shape}, w {w.shape}")
    return x, w
