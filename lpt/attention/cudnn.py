"""The standard policy through cuDNN's fused attention: ``jax.nn.dot_product_attention(implementation="cudnn")``.

What ``lpt.attention.dot_product_attention(impl="cudnn")`` runs, and ``impl="auto"`` on a GPU for the standard
policy where cuDNN takes the call (:data:`HEAD_DIMS`, 16-bit inputs, no segment ids or kv mask). cuDNN computes
the standard softmax only; the stable policy is lpt's kernels' alone. q, k, v go in as given ([B, T, H, D], GQA
natively); lpt's window of w keys is cuDNN's ``local_window_size=(w − 1, 0)``; under a mesh cuDNN's own partitioning
splits batch and heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["HEAD_DIMS", "arguments", "attention", "check"]

HEAD_DIMS = (64, 128)  # the head widths impl="auto" gives cuDNN (its fused attention trains D <= 128 on Ampere on)
_SIXTEEN = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check(*, standard: bool, masked: bool, dtype, interpret, block_q, block_k) -> None:
    """ValueError, in one line, for a call cuDNN does not compute here: another policy than the standard one, segment
    ids or a kv mask (``masked``), inputs other than bf16 / f16, or an ``interpret``, ``block_q`` or ``block_k``.

    Args:
      standard: the call asks for the standard policy.
      masked: the call has segment ids or a kv mask.
      dtype: the dtype of q, k and v.
      interpret, block_q, block_k: the call's options of those names (each must be None).
    """
    if not standard:
        raise ValueError(
            "impl='cudnn' computes the standard softmax only (stable=False); the stable policy runs on lpt's kernels "
            "(impl='mosaic_gpu', 'pallas' or 'auto')"
        )
    if masked:
        raise ValueError("impl='cudnn' takes no segment_ids or kv_mask in lpt; use impl='mosaic_gpu' or 'pallas'")
    if jnp.dtype(dtype) not in _SIXTEEN:
        raise ValueError(f"impl='cudnn' takes bfloat16 or float16 q, k, v; got {dtype}")
    for name, value in (("interpret", interpret), ("block_q", block_q), ("block_k", block_k)):
        if value is not None:
            raise ValueError(f"{name}={value!r}: impl='cudnn' has no {name}; leave it None")


def arguments(*, causal: bool, sliding_window: int, scale: float | None) -> dict:
    """``jax.nn.dot_product_attention``'s scale and masks for lpt's: a window of w keys (query i sees keys
    i − w < j <= i) is ``local_window_size=(w − 1, 0)``."""
    return {
        "scale": scale,
        "is_causal": bool(causal),
        "local_window_size": (sliding_window - 1, 0) if sliding_window else None,
    }


def attention(q, k, v, *, causal: bool, sliding_window: int, scale: float | None):
    """cuDNN's fused attention of q [B, Tq, H, D], k and v [B, Tk, Hkv, D]; returns [B, Tq, H, D] in q.dtype.

    Args:
      q, k, v: the shapes above, bf16 or f16, H a multiple of Hkv.
      causal: key j is visible to query i only if j <= i.
      sliding_window: w > 0: query i sees only the keys i − w < j <= i; 0: no window.
      scale: the logit scale (None: 1/sqrt(D)).
    """
    args = arguments(causal=causal, sliding_window=sliding_window, scale=scale)
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **args)
