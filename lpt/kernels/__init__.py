"""lpt.kernels (under construction)."""

from lpt.kernels.fp8_blockwise_matmul import fp8_blockwise_matmul, fp8_blockwise_matmul_reference  # noqa: F401
from lpt.kernels.fp8_blockwise_matmul_mgpu import fp8_blockwise_matmul_mgpu  # noqa: F401
