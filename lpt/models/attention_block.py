"""Causal self-attention with grouped-query heads (GQA), RoPE for Llama, and the attention switch of the recipe.

``precision.attention.impl`` "xla" | "pallas", ``stable``, ``beta`` go to ``lpt.attention.dot_product_attention``
when that module is importable; otherwise only impl="xla" works, through :func:`reference_attention` (float32
scores and softmax, float32 P·V), and the stable switch has nothing to fix (no bf16 P̄ exists there).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from lpt.models.config import ModelSpec, PrecisionSpec
from lpt.models.layers import Linear, rope
from lpt.models.partitioning import constrain


def reference_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array) -> jax.Array:
    """``softmax(q kᵀ / sqrt(D) + causal mask) v`` for H query heads sharing K = H/G kv heads, all in float32.

    Query head h uses kv head ``h // (H // K)``. Returns the compute dtype of ``q``.
    """
    B, T, H, D = q_BTHD.shape
    K = k_BSKD.shape[2]
    G = H // K
    q_f32 = q_BTHD.astype(jnp.float32).reshape(B, T, K, G, D)  # compute -> f32
    k_f32 = k_BSKD.astype(jnp.float32)  # compute -> f32
    v_f32 = v_BSKD.astype(jnp.float32)  # compute -> f32
    s_BKGTS = jnp.einsum("btkgd,bskd->bkgts", q_f32, k_f32) * (1.0 / math.sqrt(D))
    mask_TS = jnp.tril(jnp.ones((T, T), dtype=bool))
    s_BKGTS = jnp.where(mask_TS, s_BKGTS, -jnp.inf)
    p_BKGTS = jax.nn.softmax(s_BKGTS, axis=-1)
    o_BTKGD = jnp.einsum("bkgts,bskd->btkgd", p_BKGTS, v_f32)
    return o_BTKGD.reshape(B, T, H, D).astype(q_BTHD.dtype)  # f32 -> compute


def _lpt_attention():
    try:
        from lpt.attention import dot_product_attention
    except ImportError:
        return None
    return dot_product_attention


def attend(q_BTHD, k_BSKD, v_BSKD, prec: PrecisionSpec) -> jax.Array:
    """Dispatch by the recipe; see the module docstring."""
    dpa = _lpt_attention()
    if dpa is None:
        if prec.attention_impl != "xla":
            raise NotImplementedError(
                f"precision.attention.impl={prec.attention_impl!r} needs lpt.attention.dot_product_attention, "
                "which is not available yet; use impl='xla'"
            )
        return reference_attention(q_BTHD, k_BSKD, v_BSKD)
    return dpa(
        q_BTHD,
        k_BSKD,
        v_BSKD,
        causal=True,
        stable=prec.attention_stable,
        beta=prec.attention_beta,
        impl=prec.attention_impl,
    )


class Attention(nnx.Module):
    """x -> (q, k, v) projections (layer kind "qkv") -> [RoPE] -> causal GQA attention -> out projection ("out")."""

    def __init__(self, spec: ModelSpec, prec: PrecisionSpec, *, block: int, rngs: nnx.Rngs):
        D, H, K, Dh = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim
        bias = spec.kind == "gpt2"
        std, out_std = spec.init_std, spec.init_std / math.sqrt(2 * spec.n_layers)
        self.spec, self.prec = spec, prec
        mk = lambda n_in, n_out, axes, kind, s, j: Linear(
            n_in,
            n_out,
            axes=axes,
            layer_kind=kind,
            std=s,
            prec=prec,
            path=f"blocks/{block}/attn/{j}",
            use_bias=bias,
            rngs=rngs,
        )
        self.q = mk(D, H * Dh, ("embed", "heads"), "qkv", std, "q")
        self.k = mk(D, K * Dh, ("embed", "kv_heads"), "qkv", std, "k")
        self.v = mk(D, K * Dh, ("embed", "kv_heads"), "qkv", std, "v")
        self.o = mk(H * Dh, D, ("heads", "embed"), "out", out_std, "o")

    def __call__(self, x_BTD: jax.Array, *, key: jax.Array | None) -> jax.Array:
        B, T, _ = x_BTD.shape
        H, K, Dh = self.spec.n_heads, self.spec.n_kv_heads, self.spec.head_dim
        q = self.q(x_BTD, key=key).reshape(B, T, H, Dh)
        k = self.k(x_BTD, key=key).reshape(B, T, K, Dh)
        v = self.v(x_BTD, key=key).reshape(B, T, K, Dh)
        if self.spec.kind == "llama":
            q, k = rope(q, self.spec.rope_theta), rope(k, self.spec.rope_theta)
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        o_BTHD = attend(q, k, v, self.prec)
        o_BTHD = constrain(o_BTHD, ("batch", "length", "heads", "head_dim"))
        return self.o(o_BTHD.reshape(B, T, H * Dh), key=key)
