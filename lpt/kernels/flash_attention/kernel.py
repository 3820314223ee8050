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
:func:`forward` and :func:`backward` take their static arguments as one
:class:`~lpt.kernels.flash_attention.options.FlashOptions` (policy, position rule, scale, blocks, ``interpret``,
``structure``); the interpreter runs the "grid" structure unless it says ``structure="loop"``.
"""

from __future__ import annotations

import jax.numpy as jnp

from lpt.kernels import dispatch
from lpt.kernels.flash_attention import tpu
from lpt.kernels.flash_attention import triton as gpu
from lpt.kernels.flash_attention.options import FlashOptions
from lpt.kernels.flash_attention.tiles import check, structure_of, tiles


def _module(mode: str, structure: str | None):
    return tpu if structure_of(mode, structure) == "grid" else gpu


def _layout(q, k, options: FlashOptions):
    """(G, ``tiles_of(mode)``): checks the layout against ``options`` (:func:`~lpt.kernels.flash_attention.tiles.check`)
    and returns the GQA group size and the tiles per compile mode."""
    g = check(q, k, options.block_q, options.block_k, options.causal, options.window)
    tq, d = q.shape[2], q.shape[3]

    def tiles_of(mode):
        return tiles(mode, tq, k.shape[2], d, options.block_q, options.block_k, q.dtype.itemsize)

    return g, tiles_of


def forward(q, k, v, q_seg, kv_seg, *, options: FlashOptions):
    """Forward kernel. Returns (O [B, H, Tq, D], lse f32 [B, H, Tq]); O is f32, or already rounded to nearest in
    q's dtype when ``options.policy.residual == "input"`` (the wrapper's rounding is then exact). ``options.window``
    > 0: a causal sliding window of that many keys (key blocks outside it are skipped). ``options.structure``
    ("grid" or "loop"; None: "grid") is the structure the interpreter runs.

    Args:
      q: [B, H, Tq, D]; Tq a multiple of ``options.block_q``.
      k, v: [B, Hkv, Tk, D] (H % Hkv == 0); Tk a multiple of ``options.block_k``.
      q_seg, kv_seg: int32 segment ids [B, Tq], [B, Tk].
      options: the :class:`~lpt.kernels.flash_attention.options.FlashOptions`: the policy, the position rule
        (``causal``: needs Tq == Tk; ``window``), the logit scale, the caller's blocks (the tiles per compile mode
        derive from them: :func:`lpt.kernels.flash_attention.tiles.tiles`), ``interpret`` (True interprets on every
        platform; None per platform: :func:`lpt.kernels.dispatch.platform_call`) and the interpreter's structure.
    """
    g, tiles_of = _layout(q, k, options)
    o_dtype = q.dtype if options.policy.residual == "input" else jnp.float32  # bf16 O halves the write when it suffices

    def build(mode):
        bq, bk = tiles_of(mode)
        return _module(mode, options.structure).forward_call(
            mode, shape=q.shape, g=g, tk=k.shape[2], o_dtype=o_dtype, options=options, bq=bq, bk=bk
        )

    segs = (q_seg[:, :, None], kv_seg[:, None, :])
    o, lse = dispatch.platform_call(build, q, k, v, *segs, interpret=options.interpret)
    return o, lse[..., 0]


def backward(q, k, v, q_seg, kv_seg, lse, do, delta, *, options: FlashOptions):
    """Backward kernels given lse, δ [B, H, Tq] f32. Returns f32 (dq [B, H, Tq, D], dk, dv [B, Hkv, Tk, D]).

    Args:
      q, k, v, q_seg, kv_seg, lse, do, delta, options: as the twin's
        :func:`lpt.kernels.flash_attention.reference.reference_backward`, which computes the same.
    """
    g, tiles_of = _layout(q, k, options)
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    lse_r, delta_r = lse[..., None], delta[..., None]
    segs = (q_seg[:, :, None], kv_seg[:, None, :])

    def build_dq(mode):
        bq, bk = tiles_of(mode)
        return _module(mode, options.structure).dq_call(mode, shape=q.shape, g=g, tk=tk, options=options, bq=bq, bk=bk)

    def build_dkdv(mode):
        bq, bk = tiles_of(mode)
        shape = (b, hkv, g * tq, d)
        return _module(mode, options.structure).dkdv_call(mode, shape=shape, g=g, tk=tk, options=options, bq=bq, bk=bk)

    def grouped(x):  # [B, H, Tq, n] -> [B, Hkv, G·Tq, n] (free: query heads of one kv head are adjacent)
        return x.reshape(b, hkv, g * tq, x.shape[-1])

    dkdv_args = (grouped(q), k, v, grouped(do), grouped(lse_r), grouped(delta_r), *segs)
    dk, dv = dispatch.platform_call(build_dkdv, *dkdv_args, interpret=options.interpret)
    dq = dispatch.platform_call(build_dq, q, k, v, do, lse_r, delta_r, *segs, interpret=options.interpret)
    return dq, dk, dv


__all__ = ["backward", "forward"]
