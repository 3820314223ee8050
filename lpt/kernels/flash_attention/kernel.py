"""Pallas flash attention (FA2 forward with saved logsumexp, FA2 backward) with the lpt numerics policy.

XLA twin: :mod:`lpt.kernels.flash_attention.reference` (same recurrence, same key-block order); the per-block rules
(shift rule, repeat count across blocks, masking, rounding of P̃, where ℓ comes from, the backward's rounded P and
dS) are the functions of :mod:`lpt.kernels.flash_attention.math`, called from both.

Layout: q [B, H, Tq, D]; k, v [B, Hkv, Tk, D] (GQA: query head h reads kv head h // G, G = H / Hkv); q_seg [B, Tq],
kv_seg [B, Tk] int32 (query i attends key j iff segments match and, if causal, j <= i, and with a sliding window
``window`` > 0 also i − window < j: :func:`lpt.kernels.flash_attention.math.position_mask`); Tq, Tk multiples of the
blocks. Row vectors (lse, δ, q_seg) travel as [.., T, 1] and kv_seg as [B, 1, Tk] so that every block's last two dims
are TPU-legal. The ranges of blocks each program visits (causal, sliding window) are
:func:`lpt.kernels.flash_attention.tiles.key_blocks` and :func:`lpt.kernels.flash_attention.tiles.query_blocks`, shared
by both structures.

Two structures of the same kernels, one per compiler (tiles per mode: :func:`lpt.kernels.flash_attention.tiles.tiles`):

* "grid" (:mod:`lpt.kernels.flash_attention.tpu`; Mosaic): the reduction over blocks is a trailing "arbitrary"
  grid axis with VMEM scratch accumulators; every BlockSpec is one block.
* "loop" (:mod:`lpt.kernels.flash_attention.triton`; Triton): each program ``fori_loop``s over blocks of a
  whole-sequence ref.

dK/dV is GQA-native in both: one program per (b, kv head, key block) accumulates over the G query heads of its kv
head and their query blocks and writes dk, dv [B, Hkv, Tk, D]. Platform: :func:`lpt.kernels.dispatch.platform_call`
(``interpret=True`` interprets everywhere; ``interpret=None`` interprets on CPU, Triton on cuda, Mosaic on tpu).
The interpreter runs the "grid" structure unless ``structure="loop"`` is passed to :func:`forward` /
:func:`backward`.
"""

from __future__ import annotations

import jax.numpy as jnp

from lpt.kernels import dispatch
from lpt.kernels.flash_attention import tpu
from lpt.kernels.flash_attention import triton as gpu
from lpt.kernels.flash_attention.tiles import check, structure_of, tiles


def _module(mode: str, structure: str | None):
    return tpu if structure_of(mode, structure) == "grid" else gpu


def forward(
    q, k, v, q_seg, kv_seg, *, policy, causal, scale, block_q, block_k, window=0, interpret=None, structure=None
):
    """Forward kernel. Returns (O [B, H, Tq, D], lse f32 [B, H, Tq]); O is f32, or already rounded to nearest in
    q's dtype when ``policy.residual == "input"`` (the wrapper's rounding is then exact). ``window`` > 0: a causal
    sliding window of that many keys (key blocks outside it are skipped). ``structure`` ("grid" or "loop"; None:
    "grid") is the structure the interpreter runs.

    Args:
      q: [B, H, Tq, D]; Tq a multiple of ``block_q``.
      k, v: [B, Hkv, Tk, D] (H % Hkv == 0); Tk a multiple of ``block_k``.
      q_seg, kv_seg: int32 segment ids [B, Tq], [B, Tk].
      policy: the :class:`lpt.kernels.flash_attention.math.AttentionPolicy`.
      causal: key j visible to query i only if j <= i (needs Tq == Tk).
      scale: logit scale.
      block_q, block_k: the caller's blocks; the tiles per compile mode derive from them
        (:func:`lpt.kernels.flash_attention.tiles.tiles`).
      window: sliding window of keys (needs ``causal``); 0: none.
      interpret: True interprets on every platform; None per platform (:func:`lpt.kernels.dispatch.platform_call`).
      structure: "grid" or "loop" for the interpreter; None: "grid".
    """
    g = check(q, k, block_q, block_k, causal, window)
    structure_of("interpret", structure)  # validate
    b, h, tq, d = q.shape
    tk = k.shape[2]
    o_dtype = q.dtype if policy.residual == "input" else jnp.float32  # bf16 O halves the write when it suffices

    def build(mode):
        bq, bk = tiles(mode, tq, tk, d, block_q, block_k, q.dtype.itemsize)
        return _module(mode, structure).forward_call(
            mode,
            shape=q.shape,
            g=g,
            tk=tk,
            o_dtype=o_dtype,
            policy=policy,
            causal=causal,
            window=window,
            scale=scale,
            bq=bq,
            bk=bk,
        )

    o, lse = dispatch.platform_call(build, q, k, v, q_seg[:, :, None], kv_seg[:, None, :], interpret=interpret)
    return o, lse[..., 0]


def backward(
    q, k, v, q_seg, kv_seg, lse, do, delta, *, causal, scale, block_q, block_k, window=0, interpret=None, structure=None
):
    """Backward kernels given lse, δ [B, H, Tq] f32. Returns f32 (dq [B, H, Tq, D], dk, dv [B, Hkv, Tk, D]).
    ``window``: as in :func:`forward`. ``structure`` ("grid" or "loop"; None: "grid") is the structure the
    interpreter runs.

    Args:
      q, k, v, q_seg, kv_seg: as :func:`forward`.
      lse: f32 [B, H, Tq], the forward's logsumexp.
      do: [B, H, Tq, D], the output's cotangent.
      delta: f32 [B, H, Tq], δ = rowsum(dO ∘ O_residual).
      causal, scale, block_q, block_k, window, interpret, structure: as :func:`forward`.
    """
    g = check(q, k, block_q, block_k, causal, window)
    structure_of("interpret", structure)  # validate
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    lse_r, delta_r = lse[..., None], delta[..., None]
    segs = (q_seg[:, :, None], kv_seg[:, None, :])
    kw = dict(g=g, tk=tk, causal=causal, window=window, scale=scale)

    def build_dq(mode):
        bq, bk = tiles(mode, tq, tk, d, block_q, block_k, q.dtype.itemsize)
        return _module(mode, structure).dq_call(mode, shape=q.shape, bq=bq, bk=bk, **kw)

    def build_dkdv(mode):
        bq, bk = tiles(mode, tq, tk, d, block_q, block_k, q.dtype.itemsize)
        return _module(mode, structure).dkdv_call(mode, shape=(b, hkv, g * tq, d), bq=bq, bk=bk, **kw)

    def grouped(x):  # [B, H, Tq, n] -> [B, Hkv, G·Tq, n] (free: query heads of one kv head are adjacent)
        return x.reshape(b, hkv, g * tq, x.shape[-1])

    dkdv_args = (grouped(q), k, v, grouped(do), grouped(lse_r), grouped(delta_r), *segs)
    dk, dv = dispatch.platform_call(build_dkdv, *dkdv_args, interpret=interpret)
    dq = dispatch.platform_call(build_dq, q, k, v, do, lse_r, delta_r, *segs, interpret=interpret)
    return dq, dk, dv


__all__ = ["backward", "forward"]
