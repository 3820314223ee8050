"""lpt.fp8.blockwise: DeepSeek-V3's blockwise FP8 matmuls (the DeepSeek-V3 Technical Report, Section 3.3).

* :mod:`~lpt.fp8.blockwise.quantize`: 1 x 128 tiles (activations, gradients) and 128 x 128 blocks (weights) of
  float8_e4m3fn or float8_e5m2 codes, one f32 or power-of-two scale each (:func:`lpt.fp8.recipe.block_scale`):
  :func:`quantize_tiles`, :func:`quantize_blocks`, :func:`quantize_tensor`, their inverses and
  :func:`quantization_stats`.
* :mod:`~lpt.fp8.blockwise.dot`: :func:`blockwise_dot`, the differentiable ``x[..., K] @ w[K, N]`` whose forward,
  dX and dW GEMMs are blockwise FP8 with f32 promotion every 128 products (:data:`IMPLS`: XLA, Pallas or the Hopper
  wgmma kernel; :func:`auto_impl`), under a mesh per shard; :class:`BlockwiseConfig` and
  :func:`blockwise_config` (its checked static options), :func:`gemm_weight` (a weight quantized once for several
  GEMMs), :func:`scaled_matmul` (one GEMM on codes and scales).
* :mod:`~lpt.fp8.blockwise.accumulator`: :func:`emulated_dot`, a matmul through an emulated limited-precision
  accumulator with optional promotion to f32 (the FP8 accumulation tutorial's table).
* :mod:`~lpt.fp8.blockwise.linear`: :class:`Fp8Linear` and :func:`make_fp8_dot_general` (NNX layer and
  ``dot_general`` hook).
* :mod:`~lpt.fp8.blockwise.diagnostics`: :func:`fp8_gemm_diagnostics` (saturation / underflow counts and the error
  against bf16), :func:`quantize_operands`, :func:`snr_db`, :func:`relative_error`.

See docs/fp8.md.
"""

from lpt.fp8.blockwise.accumulator import emulated_dot
from lpt.fp8.blockwise.diagnostics import fp8_gemm_diagnostics, quantize_operands, relative_error, snr_db
from lpt.fp8.blockwise.dot import (
    IMPLS,
    BlockwiseConfig,
    GemmWeight,
    auto_impl,
    blockwise_config,
    blockwise_dot,
    gemm_weight,
    scaled_matmul,
    wgmma_takes,
)
from lpt.fp8.blockwise.linear import Fp8Linear, make_fp8_dot_general
from lpt.fp8.blockwise.quantize import (
    FP8_DTYPES,
    QuantStats,
    dequantize_blocks,
    dequantize_tiles,
    quantization_stats,
    quantize_blocks,
    quantize_tensor,
    quantize_tiles,
)

__all__ = [
    "FP8_DTYPES",
    "IMPLS",
    "BlockwiseConfig",
    "Fp8Linear",
    "GemmWeight",
    "QuantStats",
    "auto_impl",
    "blockwise_config",
    "blockwise_dot",
    "dequantize_blocks",
    "dequantize_tiles",
    "emulated_dot",
    "fp8_gemm_diagnostics",
    "gemm_weight",
    "make_fp8_dot_general",
    "quantization_stats",
    "quantize_blocks",
    "quantize_operands",
    "quantize_tensor",
    "quantize_tiles",
    "relative_error",
    "scaled_matmul",
    "snr_db",
    "wgmma_takes",
]
