"""Per-layer FP8 diagnostics a trainer can log: saturation / underflow counts and GEMM error against bf16.

* ``snr_db(ref, approx) = 10 log10( sum ref^2 / sum (approx - ref)^2 )`` (computed in f32).
* ``relative_error(ref, approx) = ||approx - ref||_F / ||ref||_F``.
* :func:`fp8_gemm_diagnostics` quantizes ``x`` and ``w`` exactly as :func:`lpt.fp8.blockwise_dot` does and compares
  its output with a bf16 GEMM (bf16 inputs, f32 accumulation: what the layer would compute without FP8).

All values are jnp scalars, so they can be computed under ``jit`` and logged as metrics. Costs one extra bf16 GEMM
plus the FP8 one: call it on logging steps only. Each function runs as one jitted program (inlined under ``jit``);
the options are checked first, in Python (:func:`lpt.fp8.blockwise_config`), and the shapes as it is traced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lpt.fp8.blockwise.dot import blockwise_config, blockwise_dot
from lpt.fp8.blockwise.quantize import quantization_stats, quantize_blocks, quantize_tiles

__all__ = ["fp8_gemm_diagnostics", "quantize_operands", "relative_error", "snr_db"]


def _f32(v) -> jax.Array:
    return jnp.asarray(v).astype(jnp.float32)  # any float -> f32


def snr_db(ref, approx) -> jax.Array:
    """Signal-to-noise ratio of ``approx`` against ``ref`` in dB (inf if equal)."""
    return _snr_db(jnp.asarray(ref), jnp.asarray(approx))


@jax.jit
def _snr_db(ref, approx) -> jax.Array:
    r, a = _f32(ref), _f32(approx)
    return 10.0 * jnp.log10(jnp.sum(r * r) / jnp.sum((a - r) ** 2))


def relative_error(ref, approx) -> jax.Array:
    """Frobenius-norm relative error ``||approx - ref|| / ||ref||``."""
    return _relative_error(jnp.asarray(ref), jnp.asarray(approx))


@jax.jit
def _relative_error(ref, approx) -> jax.Array:
    r, a = _f32(ref), _f32(approx)
    return jnp.linalg.norm(a - r) / jnp.linalg.norm(r)


def quantize_operands(x, w, *, block: int = 128, fwd_dtype=jnp.float8_e4m3fn, scale_format: str = "f32"):
    """``(x2_f32, w_f32, x_tiles, w_blocks)``: the operands of ``x[..., K] @ w[K, N]`` as f32 (``x`` flattened to
    ``[M, K]``) and quantized exactly as :func:`lpt.fp8.blockwise_dot`'s forward does (``x`` in 1×block tiles along
    K, ``w`` in block×block blocks), each as ``(codes, scales, QuantStats)``. Shared by
    :func:`fp8_gemm_diagnostics` and the "fp8" matmul format's probe (:mod:`lpt.models.matmul_formats`).

    Args:
      x: floating-point activations ``[..., K]``.
      w: floating-point weight ``[K, N]``.
      block, fwd_dtype, scale_format: as :func:`lpt.fp8.blockwise_dot`.
    """
    cfg = blockwise_config(block=block, fwd_dtype=fwd_dtype, scale_format=scale_format)
    return _quantize_operands(jnp.asarray(x), jnp.asarray(w), cfg.block, cfg.fwd_dtype, cfg.scale_format)


@functools.partial(jax.jit, static_argnames=("block", "fwd_dtype", "scale_format"))
def _quantize_operands(x, w, block: int, fwd_dtype, scale_format: str):
    w_f32 = jnp.asarray(w).astype(jnp.float32)  # w dtype -> f32 (exact for bf16 / f32)
    x2_f32 = jnp.asarray(x).reshape(-1, w_f32.shape[0]).astype(jnp.float32)  # x dtype -> f32 (exact for bf16 / f32)
    qx, sx = quantize_tiles(x2_f32, fwd_dtype, axis=-1, block=block, scale_format=scale_format)
    qw, sw = quantize_blocks(w_f32, fwd_dtype, block=block, scale_format=scale_format)
    x_tiles = (qx, sx, quantization_stats(x2_f32, qx, sx, axis=-1, block=block))
    w_blocks = (qw, sw, quantization_stats(w_f32, qw, sw, axis=None, block=block))
    return x2_f32, w_f32, x_tiles, w_blocks


def fp8_gemm_diagnostics(
    x,
    w,
    *,
    block: int = 128,
    fwd_dtype=jnp.float8_e4m3fn,
    scale_format: str = "f32",
    impl: str = "xla",
) -> dict[str, jax.Array]:
    """Diagnostics of the forward FP8 GEMM ``x[..., K] @ w[K, N]``.

    Returns a dict of scalars: ``x_saturated``, ``x_underflowed``, ``w_saturated``, ``w_underflowed`` (element
    counts; with amax scaling saturation only happens for non-finite or f32 round-off cases, underflow is the real
    loss in a tile with a large dynamic range), ``rel_err_vs_bf16`` and ``snr_db_vs_bf16`` of the FP8 output.

    Args:
      x: floating-point activations ``[..., K]``.
      w: floating-point weight ``[K, N]``.
      block, fwd_dtype, scale_format: as :func:`lpt.fp8.blockwise_dot`.
      impl: the FP8 GEMM's ``impl`` in :func:`lpt.fp8.blockwise_dot`.
    """
    cfg = blockwise_config(block=block, fwd_dtype=fwd_dtype, scale_format=scale_format, impl=impl)
    return _fp8_gemm_diagnostics(jnp.asarray(x), jnp.asarray(w), cfg.block, cfg.fwd_dtype, cfg.scale_format, impl)


@functools.partial(jax.jit, static_argnames=("block", "fwd_dtype", "scale_format", "impl"))
def _fp8_gemm_diagnostics(x, w, block: int, fwd_dtype, scale_format: str, impl: str) -> dict[str, jax.Array]:
    x2 = x.reshape(-1, w.shape[0])
    _, _, (_, _, xs), (_, _, ws) = quantize_operands(x2, w, block=block, fwd_dtype=fwd_dtype, scale_format=scale_format)
    y8 = blockwise_dot(x2, w, impl=impl, block=block, fwd_dtype=fwd_dtype, scale_format=scale_format)
    x_bf = x2.astype(jnp.bfloat16)  # x dtype -> bf16
    w_bf = w.astype(jnp.bfloat16)  # w dtype -> bf16
    y_bf = jnp.dot(x_bf, w_bf, preferred_element_type=jnp.float32)
    return {
        "x_saturated": xs.saturated,
        "x_underflowed": xs.underflowed,
        "w_saturated": ws.saturated,
        "w_underflowed": ws.underflowed,
        "rel_err_vs_bf16": relative_error(y_bf, y8),
        "snr_db_vs_bf16": snr_db(y_bf, y8),
    }
