"""Tile sizes and block-level helpers shared by the two structures of the flash-attention kernel.

:func:`tiles` is the one place that chooses the kernel's (bq, bk) per compile mode. The caller's ``block_q`` /
``block_k`` are the padding granularity (T is a multiple of them) and the tiles of the interpreter; the compiled
modes take the tile the hardware wants that divides T:

* ``"mosaic"`` (TPU): the largest multiple of the caller's block that divides T, is at most 512 (D <= 128; 256 for
  larger D) and is a multiple of 128 or all of T (a lane-dim block of kv segments must be).
* ``"triton"`` (GPU): the largest power of two dividing the caller's block, at most 128 (D <= 64; 64 for larger D,
  which keeps the split accumulation's extra P̃ tiles in registers and shared memory), at least 16.

Without such a tile the mode uses the caller's block, and its compiler reports the problem: every mode's kernel is
built when ``lax.platform_dependent`` traces, so a choice for another platform must not raise.

:func:`key_blocks` and :func:`query_blocks` are the one rule for which blocks a program visits (all, causal up to
the diagonal, a sliding window from its first block): both structures' grids, index maps and loops, and
:func:`cost`, take their ranges from them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention.options import STRUCTURES

NT = (((1,), (1,)), ((), ()))  # a @ b.T
TN = (((0,), (0,)), ((), ()))  # a.T @ b


def dot(a, b, dims=None):
    """Matmul with f32 accumulation (result f32)."""
    if dims is None:
        return jnp.dot(a, b, preferred_element_type=jnp.float32)
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def valid_mask(q_seg, kv_seg, q_start, k_start, shape, causal: bool, window: int = 0):
    """[bq, bk] attend mask from q_seg [bq, 1], kv_seg [1, bk] (int32) and the blocks' first positions (the position
    rule: :func:`lpt.kernels.flash_attention.math.position_mask`).

    Args:
      q_seg, kv_seg: int32 segment ids [bq, 1], [1, bk].
      q_start, k_start: the positions of the blocks' first query and key.
      shape: (bq, bk).
      causal, window: the position rule.
    """
    ok = q_seg == kv_seg
    if causal:
        q_pos = q_start + lax.broadcasted_iota(jnp.int32, shape, 0)
        k_pos = k_start + lax.broadcasted_iota(jnp.int32, shape, 1)
        ok = ok & fm.position_mask(q_pos, k_pos, causal, window)
    return ok


def _div(a, b: int):
    """floor(a / b) for a >= 0: ``//`` on Python ints, ``lax.div`` (truncation, no sign ops) on traced int32."""
    return a // b if isinstance(a, int) else lax.div(a, b)


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def key_blocks(i, *, bq: int, bk: int, nk: int, causal: bool, window: int = 0):
    """``(first, end)``: query block i (queries i·bq … (i+1)·bq − 1) visits key blocks first … end − 1, the blocks
    holding a key one of its queries sees (:func:`lpt.kernels.flash_attention.math.position_mask`). Non-causal: all nk;
    causal: up to the block of its last query; with a sliding window from the block of key i·bq − window + 1, the first
    its first query sees. Never empty for a causal block (Tq = Tk). ``i`` a Python int (cost, grid sizes) or a traced
    int32 (kernels: grid index maps, loop bounds); the result is of the same kind.

    Args:
      i: the query block index.
      bq, bk: query and key block sizes.
      nk: key blocks in Tk.
      causal, window: the position rule.
    """
    if not causal:
        return 0, nk
    end = _min(nk, _div((i + 1) * bq - 1, bk) + 1)
    if not window:
        return 0, end
    return _div(_max(i * bq - (window - 1), 0), bk), end  # the first query's first key (clipped at 0)


def query_blocks(j, *, bq: int, bk: int, nq: int, causal: bool, window: int = 0):
    """``(first, end)``: the query blocks first … end − 1 hold every query that sees a key of key block j (keys
    j·bk … (j+1)·bk − 1), the transpose of :func:`key_blocks`. Non-causal: all nq; causal: from the block of query
    j·bk on; with a sliding window up to the block of query (j+1)·bk + window − 2, the last that sees its last key.
    ``j`` a Python int or a traced int32, as in :func:`key_blocks`.

    Args:
      j, nq: the key block index and the query blocks in Tq.
      bq, bk, causal, window: as :func:`key_blocks`.
    """
    if not causal:
        return 0, nq
    first = _div(j * bk, bq)
    if not window:
        return first, nq
    return first, _min(nq, _div((j + 1) * bk + window - 2, bq) + 1)


def widest(blocks, n: int) -> int:
    """max over the n blocks b of ``end − first`` of ``blocks(b)`` (Python ints): the length of the grid axis or
    loop that walks one block's range."""
    return max(end - first for first, end in map(blocks, range(n)))


def backward_in_specs(q_spec, kv_spec, row_spec, qseg_spec, kvseg_spec) -> list:
    """The in_specs of a backward kernel (dQ or dK/dV) in its operand order (q, k, v, dO, lse, δ, q_seg, kv_seg):
    ``q_spec`` blocks q and dO, ``kv_spec`` k and v, ``row_spec`` lse and δ.

    Args:
      q_spec, kv_spec, row_spec: BlockSpecs of (q, dO), (k, v) and (lse, δ).
      qseg_spec, kvseg_spec: BlockSpecs of q_seg and kv_seg.
    """
    return [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, qseg_spec, kvseg_spec]


_MATMULS = {"fwd": 2, "dq": 3, "dkdv": 4}  # bq x bk x d matmuls per visited (query, key) block: S, PV / S, dP, dQ / ...


def cost(kind: str, *, shape, g: int, tk: int, itemsize: int, bq: int, bk: int, causal: bool, window: int):
    """The ``pl.CostEstimate`` of one flash kernel (``kind``: "fwd", "dq" or "dkdv") over q of ``shape`` (B rows of
    H query heads, ``g`` per kv head): its matmul FLOPs, ``2 · bq · bk · d`` per matmul and visited block (the blocks
    of :func:`key_blocks`: a causal kernel skips the blocks above the diagonal, a sliding window those before it), one
    exp per score, and the bytes of q, k, v, O (or dO) and the f32 rows. XLA's cost model reads it;
    ``lpt.targets.hlo.flops`` counts it.

    Args:
      kind: "fwd", "dq" or "dkdv".
      shape: (B, H, Tq, D): batch, query heads, query length, head dim.
      g: query heads per kv head.
      tk: key length.
      itemsize: bytes per element of q, k, v and O (or dO).
      bq, bk: the kernel's tiles.
      causal, window: the position rule (which blocks are visited).
    """
    b, h, tq, d = shape
    nq, nk = tq // bq, tk // bk
    visited = sum(
        e - f for f, e in (key_blocks(i, bq=bq, bk=bk, nk=nk, causal=causal, window=window) for i in range(nq))
    )
    scores = b * h * visited * bq * bk
    q_bytes, kv_bytes = b * h * tq * d * itemsize, b * (h // g) * tk * d * itemsize
    return pl.CostEstimate(
        flops=2 * d * _MATMULS[kind] * scores,
        transcendentals=scores,
        bytes_accessed=2 * q_bytes + 2 * kv_bytes + 8 * b * h * tq + (2 * kv_bytes if kind == "dkdv" else q_bytes),
    )


_NAMES = {"fwd": "lpt_flash_attention_fwd", "dq": "lpt_flash_attention_dq", "dkdv": "lpt_flash_attention_dkdv"}


def call_outputs(kind: str, *, shape, g: int, tk: int, o_dtype=jnp.float32, **mask) -> dict:
    """The ``out_shape``, ``name`` and ``cost_estimate`` keywords of the ``pallas_call`` of one flash kernel:
    "fwd" -> (O in ``o_dtype``, lse f32 [B, H, Tq, 1]), "dq" -> dq f32 [B, H, Tq, D], "dkdv" -> (dk, dv) f32
    [B, Hkv, Tk, D].

    Args:
      kind: "fwd", "dq" or "dkdv".
      shape: q's shape (B, H, Tq, D); for "dkdv" the grouped q's (B, Hkv, G·Tq, D).
      g, tk: query heads per kv head, key length.
      o_dtype: the dtype of O ("fwd").
      **mask: ``causal``, ``window``, ``bq``, ``bk`` (as :func:`cost`).
    """
    b, h, tq, d = shape
    if kind == "dkdv":
        tq, h = tq // g, h * g
        dk = jax.ShapeDtypeStruct((b, h // g, tk, d), jnp.float32)
        out = [dk, dk]
    elif kind == "dq":
        out = jax.ShapeDtypeStruct((b, h, tq, d), jnp.float32)
    else:
        out = [jax.ShapeDtypeStruct((b, h, tq, d), o_dtype), jax.ShapeDtypeStruct((b, h, tq, 1), jnp.float32)]
    itemsize = jnp.dtype(o_dtype).itemsize
    est = cost(kind, shape=(b, h, tq, d), g=g, tk=tk, itemsize=itemsize, **mask)
    return dict(out_shape=out, name=_NAMES[kind], cost_estimate=est)


def check(q, k, block_q: int, block_k: int, causal: bool = False, window: int = 0) -> int:
    """Validate the kernel layout and the position rule (:func:`lpt.kernels.flash_attention.math.position_mask`; causal
    needs Tq == Tk); return the GQA group size G = H / Hkv.

    Args:
      q: [B, H, Tq, D].
      k: [B, Hkv, Tk, D].
      block_q, block_k: blocks that must divide Tq and Tk.
      causal, window: the position rule.
    """
    tq, tk, h, hkv = q.shape[2], k.shape[2], q.shape[1], k.shape[1]
    if block_q < 1 or block_k < 1 or tq % block_q or tk % block_k or h % hkv:
        raise ValueError(
            f"need Tq % block_q == 0, Tk % block_k == 0, H % Hkv == 0; got Tq={tq}, block_q={block_q}, "
            f"Tk={tk}, block_k={block_k}, H={h}, Hkv={hkv}"
        )
    if causal and tq != tk:
        raise ValueError(f"causal attention needs Tq == Tk, got Tq={tq}, Tk={tk}")
    fm.position_mask(0, 0, causal, window)  # validates window
    return h // hkv


def _mosaic_tile(t: int, block: int, cap: int) -> int:
    legal = [m for m in range(block, max(cap, block) + 1, block) if t % m == 0 and (m % 128 == 0 or m == t)]
    return max(legal) if legal else block  # none: the caller's block (Mosaic rejects it if it is illegal)


def _triton_tile(block: int, cap: int) -> int:
    tile = 1
    while block % (2 * tile) == 0 and 2 * tile <= cap:
        tile *= 2
    return tile if tile >= 16 else block  # < 16: the caller's block (Triton rejects it if it is illegal)


def tiles(mode: str, tq: int, tk: int, d: int, block_q: int, block_k: int, itemsize: int = 2) -> tuple[int, int]:
    """(bq, bk) the kernel uses in ``mode`` for sequence lengths tq, tk (multiples of the blocks), head dim d, inputs
    of ``itemsize`` bytes. Triton stages q, k, v tiles in shared memory (H100/H200: 227 KiB per block): rows of at
    most 128 bytes take 128-row tiles, 256 bytes 64 (bf16 D=128, f32 D=64), longer rows 32.

    Args:
      mode: "interpret", "mosaic" or "triton".
      tq, tk: sequence lengths, multiples of the blocks.
      d: head dim.
      block_q, block_k: the caller's blocks.
      itemsize: bytes per element of q, k, v.
    """
    if mode == "interpret":
        return block_q, block_k
    if mode == "mosaic":
        cap = 512 if d <= 128 else 256
        return _mosaic_tile(tq, block_q, cap), _mosaic_tile(tk, block_k, cap)
    if mode == "triton":
        row = d * itemsize
        cap = 128 if row <= 128 else 64 if row <= 256 else 32
        return _triton_tile(block_q, cap), _triton_tile(block_k, cap)
    raise ValueError(f"mode={mode!r} is not one of ('interpret', 'triton', 'mosaic')")


def structure_of(mode: str, structure: str | None) -> str:
    """The kernel structure of ``mode``: "grid" on Mosaic, "loop" on Triton; the interpreter runs ``structure``
    (default "grid")."""
    if structure is not None and structure not in STRUCTURES:
        raise ValueError(f"structure={structure!r} is not one of {STRUCTURES}")
    if mode == "mosaic":
        return "grid"
    if mode == "triton":
        return "loop"
    return structure or "grid"
