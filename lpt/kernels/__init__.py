"""lpt.kernels: every Pallas kernel, one file per kernel, each beside (or naming) its XLA twin. No Flax here.

* ``fp8_blockwise_matmul``: portable ``pallas_call`` FP8 GEMM with f32 promotion every K-chunk (Triton on CUDA,
  Mosaic on TPU, interpreted on CPU); twin ``fp8_blockwise_matmul_reference``.
* ``fp8_blockwise_matmul_mgpu``: the Hopper (Mosaic GPU, wgmma + TMA) variant.
* ``flash_attention``: FA2 forward and backward with lpt's attention numerics policy, in two structures:
  ``flash_attention_tpu`` (grid axis + VMEM scratch, Mosaic) and ``flash_attention_gpu`` (in-kernel block loop,
  Triton), tiles per platform in ``flash_attention_tiles``; twin in ``flash_attention_reference`` (shared block
  rules in ``flash_attention_math``).

* ``adamw_kahan``: the fused AdamW + Kahan update, one pass per leaf; its math and XLA twin in
  ``adamw_kahan_math`` (pure jnp, what ``lpt.optim`` imports), per-shard wrappers in ``adamw_kahan_sharded``.
* ``dispatch``: the one platform switch (interpret / Triton / Mosaic) and the shard_map helper for all of them.

Each is tested in interpret mode against its twin and compiled for TPU v5e and H100 in the tests. Import the
modules you need; the package itself imports nothing, so the pure-math modules do not pull in Pallas.
"""
