"""Hopper variant of the blockwise FP8 matmul: Mosaic GPU, TMA pipeline into SMEM, wgmma per K-chunk.

Computes the same sum as :mod:`lpt.kernels.fp8_blockwise_matmul.kernel` (XLA twin:
``fp8_blockwise_matmul_reference``), in the same order::

    acc = 0 (f32 registers, WGMMA layout)
    for c in 0 .. K/Nc - 1:                         # emit_pipeline: TMA copies of the next chunks overlap the MMA
        partial = wgmma(a[:, c-chunk], b[c-chunk, :])     # FP8 x FP8 tensor cores into a fresh f32 accumulator
        acc = acc + partial * sa[:, c] * sb[c, :]          # promotion + scales on the CUDA cores, in f32

Each CTA (one warpgroup) owns a ``block_m x block_n`` output tile. 8-bit wgmma needs both operands K-major in SMEM,
so the wrapper passes ``b`` transposed (``[N, K]``) and the kernel views it through ``ref.transpose``; both operands
may have different FP8 formats (e4m3 x e5m2) where jax's Mosaic GPU lowers that (jax >= 0.11,
:data:`lpt.kernels.compat.WGMMA_MIXES_FP8`); on jax 0.10 they must share one, otherwise ValueError. The per-chunk scales
travel as ``sa.T[c]`` (a row of M values) and ``sb[c]``, so every TMA copy is contiguous.

``interpret=True`` runs the Mosaic GPU interpreter on CPU. Two differences, neither numeric: the interpreter cannot
apply ``ref.transpose`` inside wgmma, so there ``b`` is staged ``[K, N]`` as-is; and register layout casts are
skipped (they only annotate layouts). Everything else (pipeline, wgmma, scale broadcast, promotion, epilogue) is the
code that runs on the GPU. ``interpret=False`` lowers for CUDA only (custom call ``mosaic_gpu_v2``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lpt.kernels import compat

__all__ = ["fp8_blockwise_matmul_mgpu"]

_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # not re-exported in jax 0.10

    return InterpretGPUParams()


def _kernel(a_g, sa_g, b_g, sb_g, o_g, *, chunk, nk, bm, bn, interpret):
    layout = (lambda x, _: x) if interpret else plgpu.layout_cast
    mi, ni = lax.axis_index("m"), lax.axis_index("n")
    m_sl, n_sl = pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)
    swizzle = plgpu.find_swizzle(chunk * 8)  # one fp8 chunk row = chunk bytes
    tiles = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))

    def body(_, a_s, b_s, sa_s, sb_s, acc):
        def mma(acc_ref):
            rhs = b_s if interpret else b_s.transpose((1, 0))  # [Nb, Nc] K-major -> logical [Nc, Nb]
            plgpu.wgmma(acc_ref, a_s, rhs)
            return acc_ref[...]

        partial = pl.run_scoped(mma, plgpu.ACC((bm, bn), jnp.float32))
        sa_c = layout(sa_s[0], plgpu.Layout.WGMMA.reduce(1))  # [bm] f32
        sb_c = layout(sb_s[0], plgpu.Layout.WGMMA.reduce(0))  # [bn] f32
        sa_b = lax.broadcast_in_dim(sa_c, (bm, bn), [0])
        sb_b = lax.broadcast_in_dim(sb_c, (bm, bn), [1])
        return acc + partial * sa_b * sb_b

    if interpret:
        b_spec = plgpu.BlockSpec((chunk, bn), lambda c: (c, 0), transforms=tiles)
        b_tile = b_g.at[:, n_sl]
    else:
        b_spec = plgpu.BlockSpec((bn, chunk), lambda c: (0, c), transforms=tiles)
        b_tile = b_g.at[n_sl, :]
    acc0 = layout(jnp.zeros((bm, bn), jnp.float32), plgpu.Layout.WGMMA)
    acc = plgpu.emit_pipeline(
        body,
        grid=(nk,),
        in_specs=[
            plgpu.BlockSpec((bm, chunk), lambda c: (0, c), transforms=tiles),
            b_spec,
            plgpu.BlockSpec((1, bm), lambda c: (c, 0)),
            plgpu.BlockSpec((1, bn), lambda c: (c, 0)),
        ],
        max_concurrent_steps=2,
        init_carry=acc0,
    )(a_g.at[m_sl, :], b_tile, sa_g.at[:, m_sl], sb_g.at[:, n_sl])

    def epilogue(o_s):
        o_s[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g.at[m_sl, n_sl])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(epilogue, plgpu.SMEM((bm, bn), jnp.float32))


def fp8_blockwise_matmul_mgpu(
    a, sa, b, sb, *, chunk: int = 128, block_m: int = 64, block_n: int = 128, interpret: bool = False
) -> jax.Array:
    """Mosaic GPU kernel for ``sum_c (a_c @ b_c) * sa[:, c] * sb[c, :]``; returns f32 ``[M, N]``.

    Args:
      a, b: ``a[M, K]`` and ``b[K, N]`` in FP8, one format unless :data:`lpt.kernels.compat.WGMMA_MIXES_FP8`; K a
        multiple of ``chunk`` (= 128: one 128-byte swizzled row per chunk), N a multiple of ``block_n``; M is
        zero-padded to a multiple of ``block_m``.
      sa, sb: f32 scales ``sa[M, K/chunk]``, ``sb[K/chunk, N]``.
      chunk: K per scale and per wgmma step; must be 128.
      block_m, block_n: the output tile of one CTA: block_m 64 or 128, block_n a multiple of 64 in [64, 256].
      interpret: False lowers for CUDA (Hopper); True runs the Mosaic GPU interpreter (CPU tests).
    """
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"need a[M, K] and b[K, N]; got {a.shape} and {b.shape}")
    if a.dtype not in _FP8 or b.dtype not in _FP8:
        raise ValueError(f"a and b must be FP8 (float8_e4m3fn or float8_e5m2), got {a.dtype} and {b.dtype}")
    if a.dtype != b.dtype and not compat.WGMMA_MIXES_FP8:
        raise ValueError(
            f"a and b must share one FP8 format on jax {jax.__version__} (its Mosaic GPU wgmma cannot mix them; "
            f"jax >= 0.11 can), got {a.dtype} and {b.dtype}; use grad_dtype=float8_e4m3fn or the portable kernel "
            "lpt.kernels.fp8_blockwise_matmul.kernel"
        )
    m, k = a.shape
    n = b.shape[1]
    if chunk != 128 or k % chunk:
        raise ValueError(f"chunk must be 128 and divide K; got chunk={chunk}, K={k}")
    if block_m not in (64, 128) or block_n % 64 or not 64 <= block_n <= 256 or n % block_n:
        raise ValueError(
            f"block_m must be 64 or 128 and block_n a multiple of 64 in [64, 256] dividing N={n}; "
            f"got block_m={block_m}, block_n={block_n}"
        )
    nk = k // chunk
    if sa.shape != (m, nk) or sb.shape != (nk, n) or sa.dtype != jnp.float32 or sb.dtype != jnp.float32:
        raise ValueError(f"scales must be f32 sa{(m, nk)}, sb{(nk, n)}; got {sa.shape}, {sb.shape}")
    m_pad = -(-m // block_m) * block_m
    a_p = jnp.pad(a, ((0, m_pad - m), (0, 0)))  # zero rows give zero output rows, sliced off below
    sa_t = jnp.pad(sa, ((0, m_pad - m), (0, 0))).T  # [nk, M]: one contiguous row of scales per chunk
    b_op = b if interpret else b.T  # K-major [N, K] for 8-bit wgmma
    kernel = functools.partial(_kernel, chunk=chunk, nk=nk, bm=block_m, bn=block_n, interpret=interpret)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m_pad, n), jnp.float32),
        grid=(m_pad // block_m, n // block_n),
        grid_names=("m", "n"),
        interpret=_interpret_params() if interpret else None,
    )(a_p, sa_t, b_op, sb)
    return out[:m]
