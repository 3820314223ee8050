"""The fused AdamW + Kahan update: one pass per leaf, 16-bit or block-scaled 8-bit moments.

* ``math``: the per-element math and its XLA twin (pure jnp; what ``lpt.optim`` imports, without Pallas).
* ``kernel``: the Pallas kernel ``adamw_kahan`` (Mosaic TPU, Triton on CUDA, interpreted on CPU), which on Hopper
  runs
* ``mosaic_gpu``: its Mosaic GPU variant (16-bit and 8-bit moments).
* ``sharded``: the kernel per shard on a mesh (``shard_map``, or a partitioned custom call).

* ``options``: :class:`StepOptions`, a step's compile-time options, which every layer takes as one object, and the
  operand checks.

The package imports only ``options``, so ``import lpt.kernels.adamw_kahan.math`` loads no Pallas.
"""

from lpt.kernels.adamw_kahan.options import StepOptions

__all__ = ["StepOptions"]
