"""The compile-time options of one flash attention call (:class:`FlashOptions`): what it computes (the numerics policy,
the position rule, the logit scale) and how its kernel is tiled and run. Every entry point of
:mod:`lpt.kernels.flash_attention` takes one: the Pallas kernels (:mod:`~lpt.kernels.flash_attention.kernel`), their
XLA twin (:mod:`~lpt.kernels.flash_attention.reference`) and the Hopper kernels
(:mod:`~lpt.kernels.flash_attention.mosaic_gpu`, :mod:`~lpt.kernels.flash_attention.mosaic_gpu_ws`,
:mod:`~lpt.kernels.flash_attention.mosaic_gpu_backward`). Loads no Pallas."""

from __future__ import annotations

import dataclasses

from lpt.kernels.flash_attention import math as fm

__all__ = ["STRUCTURES", "FlashOptions"]

STRUCTURES = ("grid", "loop")  # the two structures of the Pallas kernels (lpt.kernels.flash_attention.kernel)


@dataclasses.dataclass(frozen=True)
class FlashOptions:
    """The compile-time options of one flash attention call: what it computes and how its kernel is tiled and run.
    Every field is a Python value compiled into the kernels, and the object is hashable (a static argument under
    ``jit``). The forward and the backward of one call take the same object; the backward reads no policy (it enters
    through lse and δ), the twin no ``block_q``, ``interpret`` or ``structure``.

    Args:
      causal: key j visible to query i only if j <= i (needs Tq == Tk).
      scale: the logit scale, a Python number.
      policy: the :class:`lpt.kernels.flash_attention.math.AttentionPolicy` (default: the stable one,
        :func:`~lpt.kernels.flash_attention.math.default_policy`).
      window: a causal sliding window of that many keys (:func:`lpt.kernels.flash_attention.math.position_mask`;
        needs ``causal``); 0: none.
      block_q, block_k: the caller's query and key blocks, which divide Tq and Tk (the Pallas kernels derive their
        tiles per compile mode from them: :func:`lpt.kernels.flash_attention.tiles.tiles`; the twin scans keys in
        steps of ``block_k``). The defaults are the Mosaic GPU kernels' (64 and 64).
      interpret: the Pallas kernels: None picks per platform (:func:`lpt.kernels.dispatch.platform_call`), True
        interprets on every platform; the Mosaic GPU kernels: False compiles for CUDA, True runs the Mosaic GPU
        interpreter (None: ValueError there).
      structure: "grid" or "loop", the structure the Pallas interpreter runs (None: "grid"); ignored elsewhere.

    A field of the wrong kind or value is a one-line ValueError naming it and what is allowed.
    """

    causal: bool
    scale: float
    policy: fm.AttentionPolicy = fm.AttentionPolicy()
    window: int = 0
    block_q: int = 64
    block_k: int = 64
    interpret: bool | None = None
    structure: str | None = None

    def __post_init__(self):
        if not isinstance(self.causal, bool):
            raise ValueError(f"FlashOptions: causal must be True or False, got {self.causal!r}")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)):
            raise ValueError(f"FlashOptions: scale must be a Python number (it is compiled in), got {self.scale!r}")
        if not isinstance(self.policy, fm.AttentionPolicy):
            raise ValueError(f"FlashOptions: policy must be an AttentionPolicy, got {type(self.policy).__name__}")
        fm.position_mask(0, 0, self.causal, self.window)  # validates the window
        for name in ("block_q", "block_k"):
            block = getattr(self, name)
            if isinstance(block, bool) or not isinstance(block, int) or block < 1:
                raise ValueError(f"FlashOptions: {name} must be an int >= 1, got {block!r}")
        if self.interpret not in (None, True, False):
            raise ValueError(f"FlashOptions: interpret must be None, True or False, got {self.interpret!r}")
        if self.structure is not None and self.structure not in STRUCTURES:
            raise ValueError(f"structure={self.structure!r} is not one of {STRUCTURES}")
