"""lpt.fp8: blockwise FP8 matmuls with promoted f32 accumulation (the DeepSeek-V3 Technical Report's recipe).

* Quantization: 1x128 tiles (activations, gradients), 128x128 blocks (weights), f32 or power-of-two scales.
* :func:`blockwise_dot`: differentiable ``x[..., K] @ w[K, N]``; forward, dX and dW are all blockwise FP8 GEMMs.
* :func:`emulated_dot`: matmul through an emulated limited-precision accumulator (reproduces the FP8 accumulation
tutorial's table).
* :class:`Fp8Linear` and :func:`make_fp8_dot_general`: NNX layer and ``dot_general`` hook (stateless).
* :func:`fp8_gemm_diagnostics`: saturation / underflow counts and error vs bf16, for logging.
"""

from lpt.fp8.blockwise import BlockwiseConfig, blockwise_dot, scaled_matmul
from lpt.fp8.diagnostics import fp8_gemm_diagnostics, relative_error, snr_db
from lpt.fp8.emulate import emulated_dot
from lpt.fp8.linear import Fp8Linear, fp8_dot_general, make_fp8_dot_general
from lpt.fp8.quantize import (
    QuantStats,
    compute_scale,
    dequantize_blocks,
    dequantize_tiles,
    quantization_stats,
    quantize_blocks,
    quantize_tensor,
    quantize_tiles,
)

__all__ = [
    "BlockwiseConfig",
    "Fp8Linear",
    "QuantStats",
    "blockwise_dot",
    "compute_scale",
    "dequantize_blocks",
    "dequantize_tiles",
    "emulated_dot",
    "fp8_dot_general",
    "fp8_gemm_diagnostics",
    "make_fp8_dot_general",
    "quantization_stats",
    "quantize_blocks",
    "quantize_tensor",
    "quantize_tiles",
    "relative_error",
    "scaled_matmul",
    "snr_db",
]
