"""Diagnostics to log next to the loss: how often rows have repeated maxima, and the δ error of a policy.

``repeated_max_fraction`` counts rows whose (masked, scaled, f32) logits hold at least two entries within
``tie_tol`` of the row max: the rows where a standard flash kernel's P̄ holds several exact 1s (Qiu & Yao's trigger).
``delta_error`` measures δ_policy − δ_f32 per row, δ = rowsum(dO ∘ O), the coefficient that Qiu & Yao show
multiplies a low-rank gradient error; its mean over rows is the bias that accumulates across steps.
"""

from __future__ import annotations

import jax.numpy as jnp

from lpt.attention import core
from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention import reference as fr


def repeated_max_fraction(
    q,
    k,
    *,
    causal: bool = True,
    sliding_window: int = 0,
    kv_mask=None,
    segment_ids=None,
    scale=None,
    tie_tol: float = 2.0**-9,
):
    """Fraction (f32 scalar) of query rows (batch × query heads × positions) with >= 2 visible logits within
    ``tie_tol`` of the row max.

    Shapes as :func:`lpt.attention.dot_product_attention`; rows without any visible key are not counted.

    Args:
      q, k: [B, Tq, H, D] and [B, Tk, Hkv, D] (H % Hkv == 0), as :func:`lpt.attention.dot_product_attention`.
      causal, sliding_window, kv_mask, segment_ids, scale: the masks and the logit scale, as
        :func:`lpt.attention.dot_product_attention`.
      tie_tol: a logit within this of its row max (f32, after scaling) counts as a tie.
    """
    opts = core._Options(causal=causal, sliding_window=sliding_window, scale=scale)  # only the masks and the scale
    q_t, k_t, _, q_seg, kv_seg, cfg = core._canonical(q, k, k, opts, kv_mask=kv_mask, segment_ids=segment_ids)
    b, h, tq, d = q_t.shape
    hkv, tk = k_t.shape[1], k_t.shape[2]
    qg = q_t.reshape(b, hkv, h // hkv, tq, d)
    valid = fr.valid_mask(q_seg, kv_seg, jnp.arange(tq), jnp.arange(tk), cfg.options.causal, cfg.options.window)
    s = jnp.einsum("bhgqd,bhkd->bhgqk", qg, k_t, preferred_element_type=jnp.float32) * jnp.float32(cfg.options.scale)
    s = jnp.where(valid, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    count = jnp.sum(valid & (s >= m - jnp.float32(tie_tol)), axis=-1)
    has_key = jnp.any(valid, axis=-1) & (q_seg[:, None, None, :] >= 0)  # [B, 1, 1, Tq]
    has_key = jnp.broadcast_to(has_key, count.shape)  # every query head is a row: [B, Hkv, G, Tq]
    repeated = jnp.sum(jnp.where(has_key & (count >= 2), 1.0, 0.0))
    return repeated / jnp.maximum(jnp.sum(jnp.where(has_key, 1.0, 0.0)), 1.0)


def residual_output(
    q,
    k,
    v,
    *,
    causal=True,
    stable=True,
    beta=7.0,
    policy=None,
    kv_mask=None,
    segment_ids=None,
    scale=None,
    key=None,
    block_k=None,
):
    """The O that the backward of :func:`dot_product_attention` (impl="xla") uses for δ, as f32 [B, Tq, H, D].

    Args:
      q, k, v: [B, Tq, H, D], [B, Tk, Hkv, D] each, as :func:`lpt.attention.dot_product_attention`.
      causal, stable, beta, policy, kv_mask, segment_ids, scale, key, block_k: as
        :func:`lpt.attention.dot_product_attention` (``key`` only for ``policy.residual == "stochastic"``).
    """
    opts = core._Options(causal=causal, stable=stable, beta=beta, policy=policy, scale=scale, block_k=block_k)
    q_t, k_t, v_t, q_seg, kv_seg, cfg = core._canonical(q, k, v, opts, kv_mask=kv_mask, segment_ids=segment_ids)
    o32, _ = core._forward(q_t, k_t, v_t, q_seg, kv_seg, cfg)
    _, o_res = fm.residual_and_output(o32, q.dtype, cfg.options.policy, key)
    return o_res.astype(jnp.float32).transpose(0, 2, 1, 3)[:, : q.shape[1]]  # residual dtype -> f32 (exact)


def delta_error(q, k, v, do, **options):
    """δ_policy − δ_f32 per row, f32 [B, T, H]: δ from the O the policy keeps for the backward, minus δ from the
    f32 softmax attention of the same (rounded) inputs.

    Args:
      q, k, v: [B, T, H, D], [B, T, Hkv, D] each, as :func:`lpt.attention.dot_product_attention`.
      do: [B, T, H, D] like the output: its cotangent.
      **options: :func:`residual_output`'s (causal, stable, beta, policy, kv_mask, segment_ids, scale, key,
        block_k); causal, kv_mask, segment_ids and scale also reach the f32 reference.
    """
    o_res = residual_output(q, k, v, **options)
    kw = {n: options[n] for n in ("causal", "kv_mask", "segment_ids", "scale") if n in options}
    o_true = core.dot_product_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), impl="softmax", **kw
    )  # inputs -> f32 (exact): f32 truth
    do32 = do.astype(jnp.float32)  # dO dtype -> f32 (exact)
    return jnp.sum(do32 * o_res, axis=-1) - jnp.sum(do32 * o_true, axis=-1)
