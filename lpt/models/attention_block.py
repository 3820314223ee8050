"""Causal self-attention with grouped-query heads (GQA), RoPE for Llama, and the attention switch of the recipe.

Llama's options: ``qkv_bias`` (biases on q, k, v; Qwen2), ``qk_norm`` (RMSNorm over each head of q and k, before
RoPE; Qwen3), ``head_dim`` (heads of any even width, ``H · head_dim`` need not equal ``d_model``) and
``sliding_window`` (query i attends keys i − w < j ≤ i; Mistral), in the forward and in the KV-cache path alike.

``precision.attention.impl`` ("xla": blockwise XLA twin of the flash kernel, "pallas": the flash kernel,
"mosaic_gpu": the Hopper flash kernels, CUDA only, "softmax": plain f32 softmax attention), ``stable`` and ``beta``
(Qiu & Yao's fix) go to ``lpt.attention.dot_product_attention``. ``Attention.decode`` is the KV-cache path
(:mod:`lpt.models.decode`): plain masked float32 softmax over the cached keys, whatever the recipe's attention impl.
"""

from __future__ import annotations

import jax
from flax import nnx

import lpt.attention
from lpt.models import probes
from lpt.models.config import ModelSpec, Precision
from lpt.models.decode import cached_attention
from lpt.models.layers import RMSNorm, block_linears, rope, rope_inv_freq
from lpt.sharding import constrain


def attend(
    q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, prec: Precision, sliding_window: int = 0
) -> jax.Array:
    """Causal GQA attention by the recipe: ``lpt.attention.dot_product_attention`` with its impl / stable / beta.

    ``q[B, T, H, Dh]``, ``k, v[B, T, K, Dh]`` (query head h uses kv head ``h // (H / K)``); returns q's dtype.
    ``sliding_window`` > 0: each query sees only its own and the ``sliding_window − 1`` previous keys.

    Args:
      q_BTHD: queries [B, T, H, Dh] in the compute dtype.
      k_BSKD, v_BSKD: keys and values [B, T, K, Dh] (H % K == 0).
      prec: the model's :class:`lpt.models.config.Precision`; ``prec.attention`` gives impl, stable and beta.
      sliding_window: keys each query sees (its own included); 0: all earlier keys.
    """
    return lpt.attention.dot_product_attention(
        q_BTHD,
        k_BSKD,
        v_BSKD,
        causal=True,
        sliding_window=sliding_window,
        stable=prec.attention.stable,
        beta=prec.attention.beta,
        impl=prec.attention.impl,
    )


def attention_impl(spec: ModelSpec, prec: Precision, mesh=None) -> str:
    """The implementation :func:`attend` runs on ``mesh``'s devices: ``prec.attention.impl``, or what ``"auto"``
    picks there for the compute dtype and head width (:func:`lpt.attention.auto_impl`; no segment ids or kv mask).

    Args:
      spec: the model's :class:`lpt.models.config.ModelSpec` (its head width).
      prec: the model's :class:`lpt.models.config.Precision` (compute dtype, ``attention.impl`` and ``stable``).
      mesh: the mesh the step is lowered for (None: the default device).
    """
    if prec.attention.impl != "auto":
        return prec.attention.impl
    return lpt.attention.auto_impl(prec.compute, spec.head_width, mesh, standard=not prec.attention.stable)


class Attention(nnx.Module):
    """x -> (q, k, v) projections (projection "qkv") -> [RoPE] -> causal GQA attention -> out projection ("out")."""

    def __init__(self, spec: ModelSpec, prec: Precision, *, block: int | str, rngs: nnx.Rngs):
        D, H, K, Dh = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_width
        self.spec, self.prec = spec, prec
        mk = block_linears(spec, prec, path=f"blocks/{block}/attn", rngs=rngs)
        self.q = mk(D, H * Dh, ("embed", "heads"), "qkv", "q", bias=spec.qkv_bias)
        self.k = mk(D, K * Dh, ("embed", "kv_heads"), "qkv", "k", bias=spec.qkv_bias)
        self.v = mk(D, K * Dh, ("embed", "kv_heads"), "qkv", "v", bias=spec.qkv_bias)
        self.o = mk(H * Dh, D, ("heads", "embed"), "out", "o", residual=True)
        norm = lambda: RMSNorm(Dh, eps=spec.norm_eps, prec=prec, axes=("head_dim",))
        self.q_norm, self.k_norm = (norm(), norm()) if spec.qk_norm else (None, None)

    def _qkv(self, x_BTD: jax.Array, key: jax.Array | None, positions_BT: jax.Array | None = None):
        """q[B, T, H, Dh], k, v[B, T, K, Dh] in the compute dtype; with ``qk_norm`` q and k normalized per head;
        Llama's q and k rotated at ``positions_BT`` (default ``0 … T−1`` in every row)."""
        B, T, _ = x_BTD.shape
        H, K, Dh = self.spec.n_heads, self.spec.n_kv_heads, self.spec.head_width
        q = self.q(x_BTD, key=key).reshape(B, T, H, Dh)
        k = self.k(x_BTD, key=key).reshape(B, T, K, Dh)
        v = self.v(x_BTD, key=key).reshape(B, T, K, Dh)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.spec.kind == "llama":
            inv_freq = rope_inv_freq(Dh, self.spec.rope_theta, self.spec.rope_scaling)
            q, k = rope(q, inv_freq, positions_BT), rope(k, inv_freq, positions_BT)
        return q, k, v

    def __call__(self, x_BTD: jax.Array, *, key: jax.Array | None) -> jax.Array:
        B, T, _ = x_BTD.shape
        H, Dh = self.spec.n_heads, self.spec.head_width
        q, k, v = self._qkv(x_BTD, key)
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        if probes.active():  # diagnostics pass only: repeated-max rate of the logits q kᵀ (trace-time switch)
            probes.record_attention(q, k, self.spec.sliding_window)
        o_BTHD = attend(q, k, v, self.prec, self.spec.sliding_window)
        o_BTHD = constrain(o_BTHD, ("batch", "length", "heads", "head_dim"))
        return self.o(o_BTHD.reshape(B, T, H * Dh), key=key)

    def decode(
        self, x_BTD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, *, index, positions_BT, mask_BTS
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The T new tokens' attention over this layer's cache (:mod:`lpt.models.decode`): their k, v are written
        at slots ``index … index + T − 1`` of ``k_BSKD`` / ``v_BSKD``, then each query attends the keys of
        ``mask_BTS`` (masked float32 softmax). Returns ``(y_BTD, k_BSKD, v_BSKD)``; no weight noise.

        Args:
          x_BTD: the T new tokens' inputs [B, T, D].
          k_BSKD, v_BSKD: this layer's cache [B, S, K, Dh], in the compute dtype.
          index: int32 scalar, the first slot written.
          positions_BT: int32 [B, T] absolute positions of the new tokens (RoPE).
          mask_BTS: bool [B, T, S], the slots each new token attends (:meth:`lpt.models.decode.KVCache.mask`).
        """
        B, T, _ = x_BTD.shape
        H, Dh = self.spec.n_heads, self.spec.head_width
        q, k, v = self._qkv(x_BTD, None, positions_BT)
        if k.dtype != k_BSKD.dtype:
            raise ValueError(f"the cache holds {k_BSKD.dtype} keys but the layer computes in {k.dtype}")
        k_BSKD = jax.lax.dynamic_update_slice(k_BSKD, k, (0, index, 0, 0))
        v_BSKD = jax.lax.dynamic_update_slice(v_BSKD, v, (0, index, 0, 0))
        o_BTHD = cached_attention(q, k_BSKD, v_BSKD, mask_BTS)
        return self.o(o_BTHD.reshape(B, T, H * Dh), key=None), k_BSKD, v_BSKD
