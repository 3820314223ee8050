"""lpt.fp8: blockwise FP8 matmuls with promoted f32 accumulation (the DeepSeek-V3 Technical Report's recipe).

* Quantization: 1x128 tiles (activations, gradients), 128x128 blocks (weights), f32 or power-of-two scales:
  :func:`quantize_tiles`, :func:`quantize_blocks`, :func:`quantize_tensor` and their inverses
  :func:`dequantize_tiles`, :func:`dequantize_blocks`.
* Block formats (OCP MX v1.0 and NVFP4): :func:`mx_quantize` / :func:`mx_dequantize` (e4m3, e5m2 or e2m1 codes,
  e8m0 power-of-two scales per 32 elements) and :func:`nvfp4_quantize` / :func:`nvfp4_dequantize` (e2m1 codes,
  e4m3 scales per 16 elements, one f32 tensor scale); 1-D blocks or 2-D weight tiles, nearest or stochastic.
* :func:`block_scaled_dot`: differentiable ``x[..., K] @ w[K, N]`` whose forward, dX and dW GEMMs take MXFP8 or
  NVFP4 operands (TransformerEngine's MXFP8BlockScaling / NVFP4BlockScaling recipes, NVFP4 with the random
  Hadamard transform of dW's inputs and stochastic rounding of gradients), emulated on every platform;
  :func:`random_hadamard`, :func:`block_hadamard`, :func:`hadamard_matrix`: the transform.
* :func:`blockwise_dot`: differentiable ``x[..., K] @ w[K, N]``; forward, dX and dW are all blockwise FP8 GEMMs.
  :class:`BlockwiseConfig` holds its static options and their defaults.
* :func:`emulated_dot`: matmul through an emulated limited-precision accumulator (reproduces the FP8 accumulation
  tutorial's table).
* :class:`Fp8Linear` and :func:`make_fp8_dot_general`: NNX layer and ``dot_general`` hook (stateless).
* :func:`fp8_gemm_diagnostics`: saturation / underflow counts and error vs bf16, for logging.

The rest stays importable from its module (:mod:`lpt.fp8.quantize`: ``compute_scale``, ``quantization_stats``;
:mod:`lpt.fp8.diagnostics`: ``snr_db``, ``relative_error``, ``quantize_operands``; :mod:`lpt.fp8.blockwise`:
``scaled_matmul``). See docs/fp8.md.
"""

from lpt.fp8.block_formats import mx_dequantize, mx_quantize, nvfp4_dequantize, nvfp4_quantize
from lpt.fp8.block_scaled import block_scaled_dot
from lpt.fp8.blockwise import BlockwiseConfig, blockwise_dot
from lpt.fp8.diagnostics import fp8_gemm_diagnostics
from lpt.fp8.emulate import emulated_dot
from lpt.fp8.hadamard import block_hadamard, hadamard_matrix, random_hadamard
from lpt.fp8.linear import Fp8Linear, make_fp8_dot_general
from lpt.fp8.quantize import dequantize_blocks, dequantize_tiles, quantize_blocks, quantize_tensor, quantize_tiles

__all__ = [
    "BlockwiseConfig",
    "Fp8Linear",
    "block_hadamard",
    "block_scaled_dot",
    "blockwise_dot",
    "dequantize_blocks",
    "dequantize_tiles",
    "emulated_dot",
    "fp8_gemm_diagnostics",
    "hadamard_matrix",
    "make_fp8_dot_general",
    "mx_dequantize",
    "mx_quantize",
    "nvfp4_dequantize",
    "nvfp4_quantize",
    "quantize_blocks",
    "quantize_tensor",
    "quantize_tiles",
    "random_hadamard",
]
