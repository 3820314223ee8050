"""XLA twin of the Pallas flash-attention kernel: the same online-softmax recurrence in the same block order.

Layout (canonical, as the kernel sees it): q [B, H, Tq, D]; k, v [B, Hkv, Tk, D] with H % Hkv == 0 (grouped-query
attention: query head h reads kv head h // (H / Hkv)); q_seg [B, Tq], kv_seg [B, Tk] int32. Query i may attend key
j iff ``q_seg[i] == kv_seg[j]`` and, if causal, ``j <= i``, and with a sliding window ``window`` > 0 also
``i − window < j`` (:func:`lpt.kernels.flash_attention.math.position_mask`). :func:`reference_forward` and
:func:`reference_backward` take the kernels' :class:`~lpt.kernels.flash_attention.options.FlashOptions` (policy,
position rule, scale, ``block_k``). Tk must be a multiple of ``block_k`` (the wrapper pads). The twin masks the
keys outside a window but still visits every key block (all query rows share one scan): its work stays O(Tq·Tk);
the kernels skip the blocks outside the window.

Forward: a ``lax.scan`` over key blocks of size ``block_k`` applying :mod:`lpt.kernels.flash_attention.math`'s rules;
all query rows at once (rows are independent, so the query blocking of the kernel does not change a row's arithmetic).
Backward (FA2, given lse and δ = rowsum(dO ∘ O_residual)): a ``lax.scan`` over the same key blocks, all query
rows at once; per block (:func:`lpt.kernels.flash_attention.math.backward_weights`)::

    P = exp(S − lse);  dV_j = round(P)ᵀ dO;  dP = dO V_jᵀ;  dS = P ∘ (dP − δ)
    dQ += round(dS) K_j;  dK_j = round(dS)ᵀ Q·scale      (dQ·scale after the last block)

with ``round`` into the input dtype (the matmul operand dtype of an FA2 kernel) and f32 accumulation; dK_j, dV_j
are the scan's outputs (each sums over the G query heads of its kv head). Peak memory is O(B·H·Tq·block_k): no
[Tq, Tk] score matrix exists in either direction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention.options import FlashOptions


def valid_mask(q_seg, kv_seg, q_pos, k_pos, causal: bool, window: int = 0):
    """Attend mask [B, 1, 1, Tq, bk] from segments [B, Tq], [B, bk] and positions [Tq], [bk].

    Args:
      q_seg, kv_seg: int32 segment ids [B, Tq], [B, bk].
      q_pos, k_pos: int32 positions [Tq], [bk].
      causal, window: the position rule (:func:`lpt.kernels.flash_attention.math.position_mask`).
    """
    ok = q_seg[:, :, None] == kv_seg[:, None, :]
    ok = ok & fm.position_mask(q_pos[None, :, None], k_pos[None, None, :], causal, window)
    return ok[:, None, None]


def _key_blocks(k, v, kv_seg, block_k: int):
    """Scan inputs over key blocks: (block index j, k and v blocks [nk, B, Hkv, bk, D], segments [nk, B, bk])."""
    b, hkv, tk, d = k.shape
    if tk % block_k:
        raise ValueError(f"Tk={tk} must be a multiple of block_k={block_k}")
    nk = tk // block_k
    k_blocks = k.reshape(b, hkv, nk, block_k, d).transpose(2, 0, 1, 3, 4)
    v_blocks = v.reshape(b, hkv, nk, block_k, d).transpose(2, 0, 1, 3, 4)
    seg_blocks = kv_seg.reshape(b, nk, block_k).transpose(1, 0, 2)
    return jnp.arange(nk, dtype=jnp.int32), k_blocks, v_blocks, seg_blocks


def _block_logits(qg, k_blk, q_seg, seg_blk, j, options: FlashOptions):
    """(s, valid) of key block j: f32 logits scale·q kᵀ [B, Hkv, G, Tq, bk] and the attend mask."""
    block_k = options.block_k
    q_pos = jnp.arange(qg.shape[3], dtype=jnp.int32)
    k_pos = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
    valid = valid_mask(q_seg, seg_blk, q_pos, k_pos, options.causal, options.window)
    s = jnp.einsum("bhgqd,bhkd->bhgqk", qg, k_blk, preferred_element_type=jnp.float32) * jnp.float32(options.scale)
    return s, valid


def reference_forward(q, k, v, q_seg, kv_seg, *, options: FlashOptions):
    """Blockwise forward. Returns (O f32 [B, H, Tq, D], lse f32 [B, H, Tq]).

    Args:
      q: [B, H, Tq, D].
      k, v: [B, Hkv, Tk, D] (H % Hkv == 0); Tk a multiple of ``options.block_k``.
      q_seg, kv_seg: int32 segment ids [B, Tq], [B, Tk].
      options: the :class:`~lpt.kernels.flash_attention.options.FlashOptions`: the policy, the position rule
        (``causal``, ``window``), the logit scale and ``block_k``, the keys per scan step (the rest is not read).
    """
    b, h, tq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    xs = _key_blocks(k, v, kv_seg, options.block_k)
    policy = options.policy
    pv_dtype = policy.pv(v.dtype)
    qg = q.reshape(b, hkv, g, tq, d)

    def step(carry, xs):
        j, k_blk, v_blk, seg_blk = xs
        s, valid = _block_logits(qg, k_blk, q_seg, seg_blk, j, options)
        v_pv = fm.round_to(v_blk.astype(jnp.float32), pv_dtype)  # v dtype -> f32 (exact) -> pv dtype

        def matmul(p_part):
            return jnp.einsum("bhgqk,bhkd->bhgqd", p_part, v_pv, preferred_element_type=jnp.float32)

        return fm.forward_step(carry, s, valid, matmul, policy, pv_dtype), None

    # zeros_like: the carries take q's sharding, as the step's outputs do under an Explicit mesh
    col = jnp.zeros_like(qg[..., :1], jnp.float32)
    init = (col - jnp.inf, col, col, col, jnp.zeros_like(qg, jnp.float32))
    (_, _, c, l, acc), _ = lax.scan(step, init, xs)
    o, lse = fm.finalize(acc, l, c)
    return o.reshape(b, h, tq, d), lse[..., 0].reshape(b, h, tq)  # [B, Hkv, G, Tq, 1] -> [B, H, Tq]


def reference_backward(q, k, v, q_seg, kv_seg, lse, do, delta, *, options: FlashOptions):
    """Blockwise FA2 backward. lse, delta: [B, H, Tq] f32. Returns f32 (dq [B,H,Tq,D], dk, dv [B,Hkv,Tk,D]).

    Args:
      q, k, v, q_seg, kv_seg: as :func:`reference_forward`.
      lse: f32 [B, H, Tq], the forward's logsumexp.
      do: [B, H, Tq, D], the output's cotangent.
      delta: f32 [B, H, Tq], δ = rowsum(dO ∘ O_residual).
      options: as :func:`reference_forward` (its policy is not read: it enters through lse and δ).
    """
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    g = h // hkv
    scale = options.scale
    xs = _key_blocks(k, v, kv_seg, options.block_k)
    in_dtype = q.dtype
    qg = q.reshape(b, hkv, g, tq, d)
    dog = do.reshape(b, hkv, g, tq, d)
    lse_g = lse.reshape(b, hkv, g, tq)[..., None]  # split heads, then a unit dim: reshapes an Explicit mesh takes
    delta_g = delta.reshape(b, hkv, g, tq)[..., None]

    def step(dq, xs):
        j, k_blk, v_blk, seg_blk = xs
        s, valid = _block_logits(qg, k_blk, q_seg, seg_blk, j, options)
        dp = jnp.einsum("bhgqd,bhkd->bhgqk", dog, v_blk, preferred_element_type=jnp.float32)
        p_in, ds_in = fm.backward_weights(s, valid, lse_g, dp, delta_g, in_dtype)
        dv_blk = jnp.einsum("bhgqk,bhgqd->bhkd", p_in, dog, preferred_element_type=jnp.float32)
        dk_blk = jnp.einsum("bhgqk,bhgqd->bhkd", ds_in, qg, preferred_element_type=jnp.float32) * jnp.float32(scale)
        dq = dq + jnp.einsum("bhgqk,bhkd->bhgqd", ds_in, k_blk, preferred_element_type=jnp.float32)
        return dq, (dk_blk, dv_blk)

    dq, (dk_blocks, dv_blocks) = lax.scan(step, jnp.zeros_like(qg, jnp.float32), xs)  # q's sharding (forward)
    dq = dq * jnp.float32(scale)

    def unblock(x):  # [nk, B, Hkv, bk, D] -> [B, Hkv, Tk, D]
        return x.transpose(1, 2, 0, 3, 4).reshape(b, hkv, tk, d)

    return dq.reshape(b, h, tq, d), unblock(dk_blocks), unblock(dv_blocks)


def softmax_attention(q, k, v, q_seg, kv_seg, *, causal: bool, scale: float, window: int = 0):
    """Plain (non-blocked) softmax attention in f32, differentiable by autodiff: the f32 truth.

    Same layout as :func:`reference_forward`; returns O f32 [B, H, Tq, D] (0 for rows without any valid key).

    Args:
      q, k, v, q_seg, kv_seg: as :func:`reference_forward` (any float dtype, computed in f32).
      causal, scale, window: the position rule and the logit scale, as the fields of
        :class:`~lpt.kernels.flash_attention.options.FlashOptions`.
    """
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    g = h // hkv
    qg = q.astype(jnp.float32).reshape(b, hkv, g, tq, d)  # input dtype -> f32 (exact)
    valid = valid_mask(q_seg, kv_seg, jnp.arange(tq, dtype=jnp.int32), jnp.arange(tk, dtype=jnp.int32), causal, window)
    s = jnp.einsum("bhgqd,bhkd->bhgqk", qg, k.astype(jnp.float32)) * jnp.float32(scale)  # -> f32 (exact)
    s = jnp.where(valid, s, -jnp.inf)
    any_valid = jnp.any(valid, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(any_valid, jnp.max(s, axis=-1, keepdims=True), 0.0))
    e = jnp.where(valid, jnp.exp(jnp.where(valid, s - m, 0.0)), 0.0)
    p = e / jnp.where(any_valid, jnp.sum(e, axis=-1, keepdims=True), 1.0)
    o = jnp.einsum("bhgqk,bhkd->bhgqd", p, v.astype(jnp.float32))  # v dtype -> f32 (exact)
    return o.reshape(b, h, tq, d)
