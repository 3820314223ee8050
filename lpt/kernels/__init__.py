"""lpt.kernels: every Pallas kernel, one package per kernel, each kernel beside its XLA twin, the math both share
below them. No Flax here.

* ``flash_attention``: FA2 forward and backward with lpt's attention numerics policy: the shared block rules
  (``math``), the XLA twin (``reference``), tiles and block ranges (``tiles``), the Mosaic TPU structure (``tpu``),
  the Triton structure (``triton``) and the entry that picks one (``kernel``).
* ``fp8_blockwise_matmul``: the portable FP8 GEMM with f32 promotion every K-chunk and its twin (``kernel``), and
  the Hopper variant (``mosaic_gpu``: wgmma + TMA).
* ``adamw_kahan``: the fused AdamW + Kahan update (``kernel``), its math and XLA twin (``math``: pure jnp, what
  ``lpt.optim`` imports), the per-shard wrappers (``sharded``).
* ``fp8_codes_math``: 8-bit float codes in the integer and f32 operations Mosaic and Triton lower (shared by the
  8-bit moments of ``adamw_kahan`` and by ``lpt.optim``).
* ``dispatch``: the one platform switch (interpret / Triton / Mosaic) and the shard_map helper for all of them.

Each kernel is tested in interpret mode against its twin and compiled for TPU v5e and H100 in the tests. Import the
modules you need; no package here imports anything itself, so the pure-math modules do not pull in Pallas.
"""
