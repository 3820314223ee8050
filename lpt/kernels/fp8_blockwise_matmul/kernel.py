"""Blockwise-scaled FP8 matmul with promoted f32 accumulation: a portable Pallas kernel and its XLA twin.

Both functions compute, for quantized operands ``a[M, K]`` and ``b[K, N]`` (float8 or any float) with one scale per
(row, K-chunk) of ``a`` and per (K-chunk, column) of ``b``::

    out[m, n] = sum_{c=0}^{K/Nc - 1}  ( a[m, cNc:(c+1)Nc] @ b[cNc:(c+1)Nc, n] ) * sa[m, c] * sb[c, n]

with the chunk sum inside the parentheses computed as one f32-accumulating dot (FP8 x FP8 products are exact in
f32) and the chunks added into an f32 accumulator in increasing ``c`` (the DeepSeek-V3 "promotion every Nc = 128").
The scale expression is evaluated as ``(partial * sa) * sb`` in both implementations, so they agree to f32
round-off (only the summation order inside one chunk's dot may differ).

This one primitive covers all three GEMMs of a linear layer: forward (1x128 activation tiles, 128x128 weight blocks
with ``sb`` repeated over each block's 128 columns), dX (gradient tiles along N, the same weight blocks transposed)
and dW (activation and gradient tiles along the token dimension). ``lpt.fp8.blockwise_dot`` builds them.

* :func:`fp8_blockwise_matmul_reference` (XLA): a ``lax.scan`` over K-chunks carrying the (M, N) f32
  accumulator; it never materializes a (K/Nc, M, N) tensor.
* :func:`fp8_blockwise_matmul` (Pallas), in two structures:

  - "grid" (Mosaic on TPU, and the interpreter): grid (M/bm, N/bn, K/Nc) with the K-chunks on the last,
    "arbitrary" axis; every BlockSpec holds one chunk (``a`` [bm, Nc], ``b`` [Nc, bn], one scale column / row), the
    f32 accumulator lives in VMEM scratch (zeroed on the first chunk, written out on the last). VMEM per program is
    O(bm·Nc + Nc·bn + bm·bn) whatever K is.
  - "loop" (Triton on CUDA): grid (M/bm, N/bn); each program loops over the K-chunks with ``fori_loop``, loading one
    chunk of its rows of ``a`` and columns of ``b`` from HBM per iteration (a Triton program cannot carry scratch
    across grid steps).

  The platform is chosen by :func:`lpt.kernels.dispatch.platform_call` (or ``interpret=True`` forces the
  interpreter everywhere; ``structure="loop"`` interprets the Triton structure). Both add the chunks in increasing
  ``c`` with the same expression, so both equal the XLA twin bit for bit in the interpreter.
  Triton cannot multiply mixed FP8 formats (e4m3 x e5m2, which the backward GEMMs use), so when the operand dtypes
  differ both chunks are upcast to bf16 inside the kernel: exact for e4m3 and e5m2, so the result is unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lpt.kernels import dispatch

__all__ = ["fp8_blockwise_matmul", "fp8_blockwise_matmul_reference"]


def _check(a, sa, b, sb, chunk: int) -> tuple[int, int, int]:
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"a and b must be 2-D, got shapes {a.shape} and {b.shape}")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"contracting dims differ: a is {a.shape}, b is {b.shape}")
    if chunk <= 0 or k % chunk:
        raise ValueError(f"K={k} must be a positive multiple of the chunk size {chunk}")
    if sa.shape != (m, k // chunk) or sb.shape != (k // chunk, n):
        raise ValueError(
            f"scales must have shapes sa={(m, k // chunk)}, sb={(k // chunk, n)}; got {sa.shape}, {sb.shape}"
        )
    if sa.dtype != jnp.float32 or sb.dtype != jnp.float32:
        raise ValueError(f"scales must be float32, got {sa.dtype} and {sb.dtype}")
    return m, k, n


def fp8_blockwise_matmul_reference(a, sa, b, sb, *, chunk: int = 128) -> jax.Array:
    """XLA twin of the kernel: scan over K-chunks, ``acc += (a_c @ b_c) * sa[:, c] * sb[c, :]`` in f32.

    Args:
      a, b: ``a[M, K]`` and ``b[K, N]`` FP8 codes; K a multiple of ``chunk``.
      sa, sb: f32 scales ``sa[M, K/chunk]``, ``sb[K/chunk, N]``.
      chunk: K-chunk per scale (the promotion interval).
    """
    m, k, n = _check(a, sa, b, sb, chunk)
    nk = k // chunk
    a_c = jnp.transpose(a.reshape(m, nk, chunk), (1, 0, 2))  # [nk, M, Nc], dtype unchanged
    b_c = b.reshape(nk, chunk, n)  # [nk, Nc, N]

    def step(acc, xs):
        a_i, b_i, sa_i, sb_i = xs
        a32 = a_i.astype(jnp.float32)  # fp8 -> f32, exact
        b32 = b_i.astype(jnp.float32)  # fp8 -> f32, exact
        partial = jnp.dot(a32, b32, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return acc + partial * sa_i[:, None] * sb_i[None, :], None

    acc0 = jnp.zeros((m, n), jnp.float32)
    acc, _ = lax.scan(step, acc0, (a_c, b_c, sa.T, sb))
    return acc


def _kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *, chunk: int, nk: int, upcast: bool):
    bm, bn = o_ref.shape
    sa_all = sa_ref[...]  # [bm, nk_pad] f32
    sb_all = sb_ref[...]  # [nk_pad, bn] f32

    def body(c, acc):
        start = pl.multiple_of(c * chunk, chunk)
        a = a_ref[:, pl.ds(start, chunk)]
        b = b_ref[pl.ds(start, chunk), :]
        if upcast:
            a = a.astype(jnp.bfloat16)  # fp8 -> bf16, exact (mixed fp8 formats cannot feed one MMA)
            b = b.astype(jnp.bfloat16)  # fp8 -> bf16, exact
        partial = jnp.dot(a, b, preferred_element_type=jnp.float32)
        # Pick column c of sa and row c of sb with a masked sum (dynamic lane slicing is not portable).
        sa_c = jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, sa_all.shape, 1) == c, sa_all, 0.0), axis=1)
        sb_c = jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, sb_all.shape, 0) == c, sb_all, 0.0), axis=0)
        return acc + partial * sa_c[:, None] * sb_c[None, :]

    o_ref[...] = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32))


def _grid_kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, acc_ref, *, upcast: bool):
    c = pl.program_id(2)

    @pl.when(c == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    a, b = a_ref[...], b_ref[...]
    if upcast:
        a = a.astype(jnp.bfloat16)  # fp8 -> bf16, exact (mixed fp8 formats cannot feed one MMA)
        b = b.astype(jnp.bfloat16)  # fp8 -> bf16, exact
    partial = jnp.dot(a, b, preferred_element_type=jnp.float32)
    acc_ref[...] = acc_ref[...] + partial * sa_ref[...] * sb_ref[...]  # [bm, 1] and [1, bn] scales of chunk c

    @pl.when(c == pl.num_programs(2) - 1)
    def _store():
        o_ref[...] = acc_ref[...]


def _cost(a, sa, b, sb) -> pl.CostEstimate:
    """``2 · M · N · K`` FLOPs (and the scale products, ``2 · M · N`` per K-chunk, left out), no transcendentals, the
    bytes of the operands, their scales and the f32 result."""
    m, k = a.shape
    n = b.shape[1]
    operands = sum(x.size * x.dtype.itemsize for x in (a, sa, b, sb))
    return pl.CostEstimate(flops=2 * m * n * k, transcendentals=0, bytes_accessed=operands + 4 * m * n)


def _grid_pallas(a, sa, b, sb, *, chunk, block_m, block_n, mode):
    """The "grid" structure on sa [nk, M, 1], sb [nk, 1, N] (one chunk's scales per block, TPU-legal shapes)."""
    m, k = a.shape
    n = b.shape[1]
    kernel = functools.partial(_grid_kernel, upcast=a.dtype != b.dtype)
    return pl.pallas_call(
        kernel,
        grid=(m // block_m, n // block_n, k // chunk),
        in_specs=[
            pl.BlockSpec((block_m, chunk), lambda i, j, c: (i, c)),
            pl.BlockSpec((None, block_m, 1), lambda i, j, c: (c, i, 0)),
            pl.BlockSpec((chunk, block_n), lambda i, j, c: (c, j)),
            pl.BlockSpec((None, 1, block_n), lambda i, j, c: (c, 0, j)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, c: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
        name="lpt_fp8_blockwise_matmul",
        cost_estimate=_cost(a, sa, b, sb),
        **dispatch.mode_kwargs(mode, semantics=("parallel", "parallel", "arbitrary")),
    )(a, sa, b, sb)


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _pallas(a, sa, b, sb, *, chunk, block_m, block_n, mode):
    m, k = a.shape
    n = b.shape[1]
    nk = k // chunk
    kernel = functools.partial(_kernel, chunk=chunk, nk=nk, upcast=a.dtype != b.dtype)
    return pl.pallas_call(
        kernel,
        grid=(m // block_m, n // block_n),
        in_specs=[
            pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
            pl.BlockSpec((block_m, sa.shape[1]), lambda i, j: (i, 0)),
            pl.BlockSpec((k, block_n), lambda i, j: (0, j)),
            pl.BlockSpec((sb.shape[0], block_n), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        cost_estimate=_cost(a, sa, b, sb),
        **dispatch.mode_kwargs(mode, grid_rank=2),
    )(a, sa, b, sb)


STRUCTURES = ("grid", "loop")


def fp8_blockwise_matmul(
    a,
    sa,
    b,
    sb,
    *,
    chunk: int = 128,
    block_m: int = 128,
    block_n: int = 128,
    interpret: bool | None = None,
    structure: str | None = None,
) -> jax.Array:
    """Pallas kernel for the sum in the module docstring; returns f32 ``[M, N]``.

    Args:
      a, sa, b, sb: operands ``a[M, K]``, ``b[K, N]`` and f32 scales ``sa[M, K/chunk]``, ``sb[K/chunk, N]``.
      chunk: promotion interval Nc along K.
      block_m, block_n: output tile. ``N`` must be a multiple of ``block_n`` (a power of two, >= 16); ``M`` is
        zero-padded to a multiple of ``block_m`` (the tile shrinks to the next power of two >= max(M, 16)).
      interpret: ``True`` runs the Pallas interpreter on every platform; ``None`` (default) picks per platform
        (:func:`lpt.kernels.dispatch.platform_call`): interpreter on CPU, Triton on CUDA, Mosaic on TPU.
      structure: the interpreter's structure, "grid" (default, Mosaic's) or "loop" (Triton's); the compiled modes
        always use their own.
    """
    if structure not in (None, *STRUCTURES):
        raise ValueError(f"structure must be one of {STRUCTURES} or None, got {structure!r}")
    m, k, n = _check(a, sa, b, sb, chunk)
    for name, v in (("block_m", block_m), ("block_n", block_n)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    if n % block_n:
        raise ValueError(f"N={n} must be a multiple of block_n={block_n}")
    dispatch.check_interpret(interpret)
    block_m = min(block_m, _next_pow2(max(m, 16)))
    m_pad = -(-m // block_m) * block_m
    nk = k // chunk
    nk_pad = _next_pow2(nk)  # Triton needs power-of-two array shapes; padded scales are never selected
    a_p = jnp.pad(a, ((0, m_pad - m), (0, 0)))  # zero rows contribute zero output rows, sliced off below
    sa_p = jnp.pad(sa, ((0, m_pad - m), (0, nk_pad - nk)))
    sb_p = jnp.pad(sb, ((0, nk_pad - nk), (0, 0)))
    tiles = dict(chunk=chunk, block_m=block_m, block_n=block_n)
    sa_g = jnp.transpose(jnp.pad(sa, ((0, m_pad - m), (0, 0))))[:, :, None]  # [nk, M_pad, 1] f32
    sb_g = sb[:, None, :]  # [nk, 1, N] f32

    def build(mode):
        if mode == "mosaic" or (mode == "interpret" and structure != "loop"):
            return lambda a_p, sa_p, b, sb_p: _grid_pallas(a_p, sa_g, b, sb_g, mode=mode, **tiles)
        return functools.partial(_pallas, mode=mode, **tiles)

    out = dispatch.platform_call(build, a_p, sa_p, b, sb_p, interpret=interpret)
    return out[:m]
