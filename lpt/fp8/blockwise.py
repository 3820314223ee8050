"""``blockwise_dot``: a differentiable FP8 matmul ``x[..., K] @ w[K, N]`` whose three GEMMs are all blockwise FP8.

Forward (DeepSeek-V3 recipe, seed 002)::

    qx, sx = quantize_tiles(x, fwd_dtype, axis=-1)     # 1 x B tiles along K, one scale per (token, K-chunk)
    qw, sw = quantize_blocks(w, fwd_dtype)             # B x B blocks
    y[m, n] = sum_c (qx[m, c] @ qw[c, n]) * sx[m, c] * sw[c, n // B]     # f32, promoted every B products

Backward (``jax.custom_vjp``), with ``g = dL/dy``:

* ``dx = g @ w.T``: ``g`` quantized in 1 x B tiles along N in ``grad_dtype``; ``w.T`` reuses the forward's B x B
  blocks transposed (square blocks are transpose-safe, so the weight is quantized once per step).
* ``dw = x.T @ g``: the contraction runs over tokens, so ``x`` and ``g`` are re-quantized in B x 1 tiles along the
  token axis (from the original ``x``, not from ``qx``, so no double rounding). The token count is zero-padded to a
  multiple of B, which is exact.

Every GEMM goes through the same primitive (``lpt.kernels.fp8_blockwise_matmul``): ``impl="xla"`` uses its XLA twin
(a scan over K-chunks; no (K/B, M, N) tensor), ``impl="pallas"`` the portable Pallas kernel (interpreted on CPU,
Triton on CUDA, Mosaic on TPU), ``impl="mosaic_gpu"`` the Hopper wgmma kernel (CUDA only; on CPU pass
``interpret=True``; needs ``grad_dtype == fwd_dtype`` because wgmma cannot mix FP8 formats). Scales are
recomputed from the current tensors on every call, so there is no state to carry through scan, remat or gradient
accumulation. The output and ``dx`` take ``x``'s dtype, ``dw`` takes ``w``'s dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lpt.fp8.quantize import _check_scale_format, check_fp8_dtype, quantize_blocks, quantize_tiles
from lpt.kernels.fp8_blockwise_matmul import fp8_blockwise_matmul, fp8_blockwise_matmul_reference
from lpt.kernels.fp8_blockwise_matmul_mgpu import fp8_blockwise_matmul_mgpu

__all__ = ["IMPLS", "BlockwiseConfig", "blockwise_dot", "scaled_matmul"]

IMPLS = ("xla", "pallas", "mosaic_gpu")


class BlockwiseConfig(NamedTuple):
    """Static options of :func:`blockwise_dot` (hashable)."""

    block: int = 128
    fwd_dtype: jnp.dtype = jnp.dtype(jnp.float8_e4m3fn)
    grad_dtype: jnp.dtype = jnp.dtype(jnp.float8_e5m2)
    scale_format: str = "f32"
    impl: str = "xla"
    interpret: bool | None = None


def scaled_matmul(a, sa, b, sb, cfg: BlockwiseConfig) -> jax.Array:
    """``sum_c (a_c @ b_c) * sa[:, c] * sb[c, :]`` in f32 with the implementation chosen by ``cfg.impl``."""
    if cfg.impl == "xla":
        return fp8_blockwise_matmul_reference(a, sa, b, sb, chunk=cfg.block)
    if cfg.impl == "pallas":
        return fp8_blockwise_matmul(a, sa, b, sb, chunk=cfg.block, interpret=cfg.interpret)
    # No platform_dependent here: the Mosaic GPU interpreter carries IO effects that a cond over platforms
    # cannot lower for CUDA, so the interpreter is selected only by the explicit ``interpret=True``.
    return fp8_blockwise_matmul_mgpu(a, sa, b, sb, chunk=cfg.block, interpret=bool(cfg.interpret))


def _weight_col_scales(sw_blocks: jax.Array, block: int) -> jax.Array:
    return jnp.repeat(sw_blocks, block, axis=1)  # [K/B, N/B] -> [K/B, N]: one scale per (K-chunk, column)


def _forward(x2, w, cfg: BlockwiseConfig):
    qx, sx = quantize_tiles(x2, cfg.fwd_dtype, axis=-1, block=cfg.block, scale_format=cfg.scale_format)
    qw, sw = quantize_blocks(w, cfg.fwd_dtype, block=cfg.block, scale_format=cfg.scale_format)
    y = scaled_matmul(qx, sx, qw, _weight_col_scales(sw, cfg.block), cfg)
    return y, (qw, sw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bdot(x2, w, cfg: BlockwiseConfig):
    y, _ = _forward(x2, w, cfg)
    return y.astype(x2.dtype)  # f32 accumulator -> x dtype


def _bdot_fwd(x2, w, cfg: BlockwiseConfig):
    y, (qw, sw) = _forward(x2, w, cfg)
    return y.astype(x2.dtype), (x2, qw, sw, jnp.zeros((0,), w.dtype))  # f32 -> x dtype; last: w's dtype tag


def _bdot_bwd(cfg: BlockwiseConfig, res, g):
    x2, qw, sw, w_tag = res
    b = cfg.block
    g32 = g.astype(jnp.float32)  # y dtype -> f32
    # dx = g @ w.T: g in 1 x B tiles along N; w.T from the forward's blocks, transposed.
    qg, sg = quantize_tiles(g32, cfg.grad_dtype, axis=-1, block=b, scale_format=cfg.scale_format)
    dx = scaled_matmul(qg, sg, qw.T, _weight_col_scales(sw.T, b), cfg)
    # dw = x.T @ g: both in B x 1 tiles along the (zero-padded) token axis.
    m = x2.shape[0]
    pad = (-m) % b
    x_p = jnp.pad(x2.astype(jnp.float32), ((0, pad), (0, 0)))  # x dtype -> f32; zero rows are exact
    g_p = jnp.pad(g32, ((0, pad), (0, 0)))
    qxt, sxt = quantize_tiles(x_p, cfg.fwd_dtype, axis=0, block=b, scale_format=cfg.scale_format)
    qgt, sgt = quantize_tiles(g_p, cfg.grad_dtype, axis=0, block=b, scale_format=cfg.scale_format)
    dw = scaled_matmul(qxt.T, sxt.T, qgt, sgt, cfg)
    return dx.astype(x2.dtype), dw.astype(w_tag.dtype)  # f32 -> x dtype, f32 -> w dtype


_bdot.defvjp(_bdot_fwd, _bdot_bwd)


def blockwise_dot(
    x,
    w,
    *,
    impl: str = "xla",
    block: int = 128,
    fwd_dtype=jnp.float8_e4m3fn,
    grad_dtype=jnp.float8_e5m2,
    scale_format: str = "f32",
    interpret: bool | None = None,
) -> jax.Array:
    """FP8 blockwise matmul ``x[..., K] @ w[K, N]`` with promoted f32 accumulation; differentiable in x and w.

    Args:
      x: activations ``[..., K]`` (any float dtype; the output has this dtype).
      w: weight ``[K, N]`` (any float dtype; ``dw`` has this dtype).
      impl: ``"xla"`` (scan over K-chunks), ``"pallas"`` (portable Pallas kernel; interpreted on CPU) or
        ``"mosaic_gpu"`` (Hopper wgmma kernel; CUDA only, or ``interpret=True``; needs grad_dtype == fwd_dtype).
      block: tile / block edge B and promotion interval (128 as in DeepSeek-V3). K and N must be multiples of it.
      fwd_dtype: FP8 format of x and w (float8_e4m3fn by default).
      grad_dtype: FP8 format of the output gradient in both backward GEMMs (float8_e5m2 by default; pass
        float8_e4m3fn for e4m3 everywhere, as DeepSeek-V3 does).
      scale_format: ``"f32"`` (scale = amax / max) or ``"pow2"`` (scale rounded up to a power of two).
      interpret: for the kernels: ``True`` forces the interpreter; ``None``: ``"pallas"`` picks per platform
        (``lax.platform_dependent``), ``"mosaic_gpu"`` compiles for CUDA.

    Raises:
      ValueError: for non-float inputs, mismatched K, K or N not a multiple of ``block``, unknown options.
    """
    x = jnp.asarray(x)
    w = jnp.asarray(w)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    _check_scale_format(scale_format)
    cfg = BlockwiseConfig(
        block=int(block),
        fwd_dtype=check_fp8_dtype(fwd_dtype, "fwd_dtype"),
        grad_dtype=check_fp8_dtype(grad_dtype, "grad_dtype"),
        scale_format=scale_format,
        impl=impl,
        interpret=interpret,
    )
    if impl == "mosaic_gpu" and cfg.grad_dtype != cfg.fwd_dtype:
        raise ValueError(
            f"impl='mosaic_gpu' needs grad_dtype == fwd_dtype (wgmma cannot mix FP8 formats), got "
            f"fwd_dtype={cfg.fwd_dtype}, grad_dtype={cfg.grad_dtype}"
        )
    if interpret not in (None, True):
        raise ValueError(f"interpret must be None (choose per platform) or True, got {interpret!r}")
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [K, N], got shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"x[..., K] and w[K, N] disagree on K: x {x.shape}, w {w.shape}")
    k, n = w.shape
    if cfg.block <= 0 or k % cfg.block or n % cfg.block:
        raise ValueError(
            f"K={k} and N={n} must be multiples of block={cfg.block} (1x{cfg.block} tiles, "
            f"{cfg.block}x{cfg.block} weight blocks); choose a smaller block or pad the layer"
        )
    lead = x.shape[:-1]
    y2 = _bdot(x.reshape(-1, k), w, cfg)
    return y2.reshape(*lead, n)
