"""lpt.kernels: every Pallas kernel, one file per kernel, each beside (or naming) its XLA twin. No Flax here.

* ``fp8_blockwise_matmul``: portable ``pallas_call`` FP8 GEMM with f32 promotion every K-chunk (Triton on CUDA,
  Mosaic on TPU, interpreted on CPU); twin ``fp8_blockwise_matmul_reference``.
* ``fp8_blockwise_matmul_mgpu``: the Hopper (Mosaic GPU, wgmma + TMA) variant.
* ``flash_attention``: FA2 forward and backward with lpt's attention numerics policy, in two structures:
  ``flash_attention_tpu`` (grid axis + VMEM scratch, Mosaic) and ``flash_attention_gpu`` (in-kernel block loop,
  Triton), tiles per platform in ``flash_attention_tiles``; twin in ``flash_attention_reference`` (shared block
  rules in ``flash_attention_math``).

Each is tested in interpret mode against its twin and lowered for ``cuda`` and ``tpu`` in the tests.
"""

from lpt.kernels.fp8_blockwise_matmul import fp8_blockwise_matmul, fp8_blockwise_matmul_reference  # noqa: F401
from lpt.kernels.fp8_blockwise_matmul_mgpu import fp8_blockwise_matmul_mgpu  # noqa: F401
