"""Flash attention with lpt's numerics policy: FA2 forward with saved logsumexp and FA2 backward (dQ, dK, dV).

* ``math``: the per-block rules of the policy (shift rule, repeated maxima, masking, rounding of P̃, where ℓ comes
  from, the backward's rounded P and dS) and :class:`~lpt.kernels.flash_attention.math.AttentionPolicy`. Pure jnp:
  the kernels and the twin call the same functions.
* ``options``: :class:`~lpt.kernels.flash_attention.options.FlashOptions`, the static arguments of one call (policy,
  position rule, scale, blocks, ``interpret``, the interpreter's structure), frozen and hashable; every entry point
  below takes it whole.
* ``reference``: the XLA twin, the same recurrence in the same key-block order.
* ``tiles``: block sizes per platform and the ranges of blocks a program visits (causal, sliding window).
* ``kernel``: the entry points ``forward`` / ``backward``, which pick one of the two structures of the Pallas kernels:
  ``tpu`` (a grid axis over blocks with VMEM scratch; Mosaic TPU) and ``triton`` (an in-kernel loop over blocks;
  Pallas Triton on CUDA).
* ``mosaic_gpu`` (the forward and the entry points), ``mosaic_gpu_backward`` (dQ, dK/dV), ``mosaic_gpu_ws`` (a
  warp-specialized forward) and ``mosaic_gpu_blocks`` (what they share): the Hopper kernels, Pallas Mosaic GPU (wgmma,
  TMA), which ``lpt.attention`` runs as ``impl="mosaic_gpu"`` (and by ``impl="auto"`` on Hopper).

The package imports nothing itself: ``math``, ``options`` and ``reference`` load no Pallas.
"""
