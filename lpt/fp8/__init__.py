"""lpt.fp8: low-precision matmuls in two recipes, one package each, that share :mod:`lpt.fp8.recipe`.

:mod:`lpt.fp8.blockwise`: DeepSeek-V3's blockwise FP8 with promoted f32 accumulation (the DeepSeek-V3 Technical
Report's recipe).

* Quantization: 1x128 tiles (activations, gradients), 128x128 blocks (weights), f32 or power-of-two scales:
  :func:`quantize_tiles`, :func:`quantize_blocks`, :func:`quantize_tensor` and their inverses
  :func:`dequantize_tiles`, :func:`dequantize_blocks`.
* :func:`blockwise_dot`: differentiable ``x[..., K] @ w[K, N]``; forward, dX and dW are all blockwise FP8 GEMMs.
  :class:`BlockwiseConfig` holds its static options and their defaults.
* :func:`emulated_dot`: matmul through an emulated limited-precision accumulator (reproduces the FP8 accumulation
  tutorial's table).
* :class:`Fp8Linear` and :func:`make_fp8_dot_general`: NNX layer and ``dot_general`` hook (stateless).
* :func:`fp8_gemm_diagnostics`: saturation / underflow counts and error vs bf16, for logging.

:mod:`lpt.fp8.microscaling`: the block-scaled formats of OCP MX v1.0 and NVFP4.

* :func:`mx_quantize` / :func:`mx_dequantize` (e4m3, e5m2 or e2m1 codes, e8m0 power-of-two scales per 32
  elements) and :func:`nvfp4_quantize` / :func:`nvfp4_dequantize` (e2m1 codes, e4m3 scales per 16 elements, one f32
  tensor scale); 1-D blocks or 2-D weight tiles, nearest or stochastic.
* :func:`block_scaled_dot`: differentiable ``x[..., K] @ w[K, N]`` whose forward, dX and dW GEMMs take MXFP8 or
  NVFP4 operands (TransformerEngine's MXFP8BlockScaling / NVFP4BlockScaling recipes, NVFP4 with the random
  Hadamard transform of dW's inputs and stochastic rounding of gradients), emulated on every platform;
  :func:`random_hadamard`, :func:`block_hadamard`, :func:`hadamard_matrix`: the transform.

:mod:`lpt.fp8.recipe`: the ``impl`` names both recipes draw from, the block-scale rule of the blockwise recipe and the
argument checks of a dense layer. Everything else is in its subpackage's namespace (``lpt.fp8.blockwise``:
``scaled_matmul``, ``gemm_weight``, ``quantization_stats``, ``snr_db``, ...; ``lpt.fp8.microscaling``:
``block_scale_health``, ``BLOCKS``, ...). See docs/fp8.md.
"""

from lpt.fp8.blockwise import (
    BlockwiseConfig,
    Fp8Linear,
    blockwise_dot,
    dequantize_blocks,
    dequantize_tiles,
    emulated_dot,
    fp8_gemm_diagnostics,
    make_fp8_dot_general,
    quantize_blocks,
    quantize_tensor,
    quantize_tiles,
)
from lpt.fp8.microscaling import (
    block_hadamard,
    block_scaled_dot,
    hadamard_matrix,
    mx_dequantize,
    mx_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
    random_hadamard,
)

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
