"""lpt.fp8.microscaling: block-scaled narrow formats, OCP MX v1.0 (MXFP8, MXFP4) and NVIDIA's NVFP4, and the GEMMs of
TransformerEngine's MXFP8BlockScaling / NVFP4BlockScaling training recipes.

* :mod:`~lpt.fp8.microscaling.formats`: :func:`mx_quantize` / :func:`mx_dequantize` (e4m3, e5m2 or e2m1 codes, e8m0
  power-of-two scales per 32 elements) and :func:`nvfp4_quantize` / :func:`nvfp4_dequantize` (e2m1 codes, e4m3
  scales per 16 elements, one f32 tensor scale); 1-D blocks or 2-D weight tiles, nearest or stochastic rounding.
  :func:`mx_block_exponents` and :func:`nvfp4_block_scales` expose the steps of their scale rules.
* :mod:`~lpt.fp8.microscaling.dot`: :func:`block_scaled_dot`, the differentiable ``x[..., K] @ w[K, N]`` whose
  forward, dX and dW GEMMs take MXFP8 or NVFP4 operands (:data:`RECIPES`), emulated on every platform or through
  :func:`jax.nn.scaled_matmul` (:data:`IMPLS`); :class:`BlockScaledConfig` and :func:`block_scaled_config`.
* :mod:`~lpt.fp8.microscaling.hadamard`: :func:`random_hadamard`, :func:`block_hadamard`, :func:`hadamard_matrix`,
  the random Hadamard transform of NVFP4's dW inputs.
* :mod:`~lpt.fp8.microscaling.diagnostics`: :func:`block_scale_health` (blocks whose scale saturates or underflows,
  or whose maximum clips), :func:`gemm_block_health`, :func:`operand_layout`, :func:`quantize_dequantize`.

NVFP4's codes are 4-bit; the package sits under :mod:`lpt.fp8` beside the blockwise FP8 recipe, with which it shares
:mod:`lpt.fp8.recipe`. See docs/fp8.md.
"""

from lpt.fp8.microscaling import diagnostics, dot, formats, hadamard
from lpt.fp8.microscaling.diagnostics import *  # noqa: F403  (each module's __all__ is its part of the surface)
from lpt.fp8.microscaling.dot import *  # noqa: F403
from lpt.fp8.microscaling.formats import *  # noqa: F403
from lpt.fp8.microscaling.hadamard import *  # noqa: F403

__all__ = [*formats.__all__, *dot.__all__, *hadamard.__all__, *diagnostics.__all__]
