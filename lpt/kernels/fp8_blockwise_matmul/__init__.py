"""The blockwise FP8 GEMM with f32 promotion every K-chunk (DeepSeek-V3's recipe).

* ``kernel``: the portable ``pallas_call`` (Triton on CUDA, Mosaic on TPU, interpreted on CPU) and its XLA twin
  ``fp8_blockwise_matmul_reference``.
* ``mosaic_gpu``: the Hopper variant (Mosaic GPU: wgmma with TMA copies).

The package imports nothing itself.
"""
