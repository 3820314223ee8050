"""lpt.attention: stabilized flash attention (the repeated-maximum fix of Qiu & Yao) with an explicit numerics policy.

``dot_product_attention(q, k, v, *, causal=True, stable=True, beta=7.0, impl="auto", ...)`` computes
``softmax(scale · q kᵀ) v`` over [batch, seq, heads, head_dim] inputs with grouped-query attention, causal,
padding (``kv_mask``) and packing (``segment_ids``) masks. ``impl="auto"`` picks by the device the program is
lowered for (:func:`auto_impl`), ``impl="xla"`` runs the blockwise XLA twin of the flash kernel, ``impl="pallas"``
the Pallas kernel, ``impl="mosaic_gpu"`` the Hopper (CUDA) kernels, ``impl="cudnn"`` cuDNN's fused attention (the
standard policy), ``impl="softmax"`` plain f32 softmax attention (the truth).
:class:`AttentionPolicy` says how the block loop rounds (shift rule, where ℓ comes from, P̃V dtype, accumulator,
the O kept for the backward); ``stable=True`` picks the bias-free :func:`default_policy`, ``stable=False`` the
:func:`standard_policy` of FA2. Diagnostics: :func:`repeated_max_fraction`, :func:`delta_error`,
:func:`residual_output`. docs/attention.md explains the defaults; docs/results.md holds their measurements.
"""

from lpt.attention.core import auto_impl, dot_product_attention
from lpt.attention.diagnostics import delta_error, repeated_max_fraction, residual_output
from lpt.kernels.flash_attention.math import AttentionPolicy, default_policy, standard_policy

__all__ = [
    "AttentionPolicy",
    "auto_impl",
    "default_policy",
    "delta_error",
    "dot_product_attention",
    "repeated_max_fraction",
    "residual_output",
    "standard_policy",
]
