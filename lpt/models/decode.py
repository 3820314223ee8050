"""Decoding with a key/value cache: :class:`KVCache`, its masked float32 attention, and prefill / decode steps.

The cache holds every layer's keys and values, ``k, v[L, B, S, K, Dh]`` in the compute dtype (``L`` layers, ``S``
slots, ``K`` kv heads), ``index`` (int32 scalar: the slots filled so far, the same in every row) and ``start``
(int32[B]: each row's first real slot). Prompts of different lengths are left-padded to one length ``P``: row b's
prompt fills slots ``P − len_b … P − 1`` and ``start_b = P − len_b``. A token written to slot s of row b has the
absolute position ``s − start_b`` (0 at the row's first real token; RoPE angles and GPT-2 position embeddings use
it), and a query at slot i of row b attends exactly the keys at slots ``start_b ≤ s ≤ i`` (with a sliding window
of w keys also ``i − w < s``: the forward's positions, as slots and positions differ by ``start_b``): padding and
not yet written slots are masked. The cache keeps all S slots (no ring buffer for a window). Every row therefore
computes what the ordinary forward computes on that row's unpadded tokens (tests/models/test_decode.py: same greedy
tokens, logits within 1e-5 in float32).

``Transformer.decode(tokens_BT, cache) -> (logits_BTV, cache)`` writes the T new tokens at slots
``index … index + T − 1`` of every row and advances ``index`` by T; it is a pure function of the cache (jit it and
donate the cache). :func:`prefill` runs it over the left-padded prompts, :func:`decode_step` over one token per row.

Attention over the cache is plain masked softmax in float32 (q, k, v widened exactly from the compute dtype, logits
scaled by ``1/sqrt(Dh)``, the row max subtracted before ``exp``), whatever ``precision.attention`` says: decoding
reads the whole cache for one query per row, so it is memory-bound and a flash kernel would buy nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lpt.kernels.flash_attention import math as fm
from lpt.sharding import constrain


@struct.dataclass
class KVCache:
    """Per-layer keys and values of the tokens decoded so far (module docstring)."""

    k: jax.Array  # [L, B, S, K, Dh] compute dtype
    v: jax.Array  # [L, B, S, K, Dh] compute dtype
    index: jax.Array  # int32 scalar: slots filled (the next token goes to slot `index` of every row)
    start: jax.Array  # int32[B]: first real (non-padding) slot of each row

    @property
    def length(self) -> int:
        """S, the number of slots."""
        return self.k.shape[2]

    def positions(self, t: int) -> jax.Array:
        """int32[B, t]: absolute positions of the next ``t`` tokens (``index + j − start_b``; 0 for padding slots)."""
        slots_T = self.index + jnp.arange(t, dtype=jnp.int32)
        return jnp.maximum(slots_T[None, :] - self.start[:, None], 0)

    def mask(self, t: int, sliding_window: int = 0) -> jax.Array:
        """bool[B, t, S]: the keys the next ``t`` queries attend, ``start_b ≤ s ≤ index + j`` (causal, no padding)
        and, with ``sliding_window`` w > 0, ``s > index + j − w``
        (:func:`lpt.kernels.flash_attention.math.position_mask`)."""
        slots_T = self.index + jnp.arange(t, dtype=jnp.int32)
        keys_S = jnp.arange(self.length, dtype=jnp.int32)
        seen_TS = fm.position_mask(slots_T[:, None], keys_S[None, :], True, sliding_window)
        real_BS = keys_S[None, :] >= self.start[:, None]
        return seen_TS[None] & real_BS[:, None, :]


def init_cache(model, batch: int, length: int, *, start=None) -> KVCache:
    """An empty cache of ``length`` slots for ``batch`` rows of ``model`` (a :class:`lpt.models.Transformer`), in its
    compute dtype; ``start`` (int[B]) is each row's left padding (default 0). Under the trainer's sharding rules
    (:func:`lpt.sharding.axis_rules`) the rows split over the data and fsdp axes and the kv heads over tensor."""
    spec = model.spec
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} must be a positive int")
    if not isinstance(length, int) or not 1 <= length <= spec.max_seq_len:
        raise ValueError(f"cache length={length!r} must be an int in [1, config.model.max_seq_len={spec.max_seq_len}]")
    shape = (spec.n_layers, batch, length, spec.n_kv_heads, spec.head_width)
    start_B = jnp.zeros((batch,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)  # int -> int32
    if start_B.shape != (batch,):
        raise ValueError(f"start must have shape ({batch},), got {start_B.shape}")
    dtype = model.prec.compute
    axes = ("layers", "batch", "length", "kv_heads", "head_dim")  # under the trainer's rules: rows over data*fsdp
    k, v = (constrain(jnp.zeros(shape, dtype), axes) for _ in range(2))
    return KVCache(k, v, jnp.zeros((), jnp.int32), constrain(start_B, ("batch",)))


def cached_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, mask_BTS: jax.Array) -> jax.Array:
    """Masked softmax attention in float32 over the cache; query head h uses kv head ``h // (H / K)`` (GQA).

    ``q[B, T, H, Dh]`` (compute dtype), ``k, v[B, S, K, Dh]``, ``mask[B, T, S]``; returns ``o[B, T, H, Dh]`` in q's
    dtype. A query without any visible key (a padding slot during prefill) gets the mean of all values: finite, and
    never attended by a real query."""
    B, T, H, Dh = q_BTHD.shape
    K = k_BSKD.shape[2]
    q_f32 = q_BTHD.astype(jnp.float32).reshape(B, T, K, H // K, Dh)  # compute -> f32 (exact)
    k_f32 = k_BSKD.astype(jnp.float32)  # compute -> f32 (exact)
    v_f32 = v_BSKD.astype(jnp.float32)  # compute -> f32 (exact)
    s_BKGTS = jnp.einsum("btkgd,bskd->bkgts", q_f32, k_f32) * (1.0 / math.sqrt(Dh))
    s_BKGTS = jnp.where(mask_BTS[:, None, None], s_BKGTS, jnp.finfo(jnp.float32).min)
    p_BKGTS = jnp.exp(s_BKGTS - jnp.max(s_BKGTS, axis=-1, keepdims=True))
    p_BKGTS = p_BKGTS / jnp.sum(p_BKGTS, axis=-1, keepdims=True)
    o_f32 = jnp.einsum("bkgts,bskd->btkgd", p_BKGTS, v_f32).reshape(B, T, H, Dh)
    return o_f32.astype(q_BTHD.dtype)  # f32 -> compute


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens int32[B, P], start int32[B])``: the prompts left-padded with ``pad_id`` to the longest length P."""
    if not prompts or any(len(p) == 0 for p in prompts):
        lengths = [len(p) for p in prompts]
        raise ValueError(f"prompts must be a non-empty list of non-empty token lists, got lengths {lengths}")
    P = max(len(p) for p in prompts)
    tokens_BP = np.full((len(prompts), P), pad_id, np.int32)
    for b, p in enumerate(prompts):
        tokens_BP[b, P - len(p) :] = np.asarray(p, np.int32)  # int -> int32
    start_B = np.array([P - len(p) for p in prompts], np.int32)
    return tokens_BP, start_B


def prefill(model, prompts: Sequence[Sequence[int]], length: int) -> tuple[jax.Array, KVCache]:
    """Run the left-padded ``prompts`` (token lists) through ``model`` into a fresh cache of ``length`` slots;
    returns ``(logits_BV, cache)``: float32 logits of each row's next token and the cache after the prompts."""
    tokens_BP, start_B = left_pad(prompts)
    if tokens_BP.shape[1] > length:
        raise ValueError(f"the longest prompt has {tokens_BP.shape[1]} tokens; the cache has only {length} slots")
    cache = init_cache(model, len(prompts), length, start=start_B)
    logits_B1V, cache = model.decode(jnp.asarray(tokens_BP), cache, last_only=True)
    return logits_B1V[:, 0], cache


def decode_step(model, tokens_B: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """One token per row: ``(logits_BV, cache)`` after writing ``tokens_B`` at slot ``cache.index``."""
    logits_B1V, cache = model.decode(tokens_B[:, None], cache)
    return logits_B1V[:, 0], cache
