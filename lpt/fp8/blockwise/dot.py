"""``blockwise_dot``: a differentiable FP8 matmul ``x[..., K] @ w[K, N]`` whose three GEMMs are all blockwise FP8.

Forward (the DeepSeek-V3 recipe)::

    qx, sx = quantize_tiles(x, fwd_dtype, axis=-1)     # 1 x B tiles along K, one scale per (token, K-chunk)
    qw, sw = quantize_blocks(w, fwd_dtype)             # B x B blocks
    y[m, n] = sum_c (qx[m, c] @ qw[c, n]) * sx[m, c] * sw[c, n // B]     # f32, promoted every B products

Backward (``jax.custom_vjp``), with ``g = dL/dy``:

* ``dx = g @ w.T``: ``g`` quantized in 1 x B tiles along N in ``grad_dtype``; ``w.T`` reuses the forward's B x B
  blocks transposed (square blocks are transpose-safe, so the weight is quantized once per step).
* ``dw = x.T @ g``: the contraction runs over tokens, so ``x`` and ``g`` are re-quantized in B x 1 tiles along the
  token axis (from the original ``x``, not from ``qx``, so no double rounding). The token count is zero-padded to a
  multiple of B, which is exact.

Every GEMM goes through the same primitive (``lpt.kernels.fp8_blockwise_matmul.kernel``): ``impl="xla"`` uses its XLA
twin (a scan over K-chunks; no (K/B, M, N) tensor), ``impl="pallas"`` the portable Pallas kernel (interpreted on CPU,
Triton on CUDA, Mosaic on TPU), ``impl="mosaic_gpu"`` the Hopper wgmma kernel (CUDA only; on CPU pass
``interpret=True``; on jax 0.10 it needs ``grad_dtype == fwd_dtype``, whose Mosaic GPU cannot mix FP8 formats in
wgmma, :func:`wgmma_takes`). Scales are
recomputed from the current tensors on every call, so there is no state to carry through scan, remat or gradient
accumulation. The output and ``dx`` take ``x``'s dtype, ``dw`` takes ``w``'s dtype.

Under a multi-device mesh (``mesh=`` or ``jax.set_mesh``) every impl runs the forward and the backward each inside
one ``shard_map`` (:func:`lpt.kernels.dispatch.shard_map`): ``x``'s rows (tokens) follow the "batch" axes; ``w``'s
K and N follow the layer's logical axes ``w_axes`` (resolved with ``("batch", k_name, n_name)``, first unused rule
wins, by :func:`lpt.sharding.kernel_spec`; ``w_axes=None`` replicates the weight). The weight is quantized where it
is stored (``w_axes`` alone; on Explicit axes its own sharding), each shard its own blocks, before it moves to the
GEMM's layout: an FSDP weight is gathered as e4m3 codes and block scales, not in its storage dtype, and the backward
reuses those stored-layout codes. Each shard multiplies its own blocks, then the partial sums are added with
``lax.psum`` where the contracted dim is split: the output over K's axes, ``dx`` over N's, ``dw`` over the batch
axes, reduce-scattered (``lax.psum_scatter``) onto the weight's stored split where the GEMM holds that dim whole. A
psum adds the shards' f32 partials in a different order than one device adds the K-chunks, so the result can
differ from the unsharded one in the last f32 bits, except with two shards of one chunk each (``a + b``). The XLA
impl needs the shard_map as much as the kernels: left to the partitioner, its scan over the token chunks of ``dw``
(a dimension split over the batch axes) all-gathers the whole operand in every iteration.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from lpt import sharding
from lpt.fp8.blockwise.quantize import check_fp8_dtype, quantize_blocks, quantize_tiles
from lpt.fp8.recipe import check_dense_operands, check_impl, check_scale_format, impls
from lpt.kernels import compat, dispatch
from lpt.kernels.fp8_blockwise_matmul.kernel import fp8_blockwise_matmul, fp8_blockwise_matmul_reference
from lpt.kernels.fp8_blockwise_matmul.mosaic_gpu import fp8_blockwise_matmul_mgpu

__all__ = [
    "IMPLS",
    "BlockwiseConfig",
    "GemmWeight",
    "auto_impl",
    "blockwise_config",
    "blockwise_dot",
    "gemm_weight",
    "scaled_matmul",
    "wgmma_takes",
]

IMPLS = impls("auto", "xla", "pallas", "mosaic_gpu")
_STATIC_OPTIONS = ("impl", "block", "fwd_dtype", "grad_dtype", "scale_format", "interpret")  # of blockwise_dot


class BlockwiseConfig(NamedTuple):
    """Static options of :func:`blockwise_dot` (hashable)."""

    block: int = 128
    fwd_dtype: jnp.dtype = jnp.dtype(jnp.float8_e4m3fn)
    grad_dtype: jnp.dtype = jnp.dtype(jnp.float8_e5m2)
    scale_format: str = "f32"
    impl: str = "xla"
    interpret: bool | None = None
    mesh: object = None  # the kernels' mesh, None: whole arrays
    axes: tuple | None = None  # mesh axes of (x rows, K, N) on ``mesh`` (PartitionSpec entries)
    w_axes: tuple | None = None  # mesh axes of w's (K, N) where it is quantized: its stored split, block-aligned
    dw_scatter: tuple = ()  # (dim, mesh axes) pairs: dw is reduce-scattered back onto w's stored split


def scaled_matmul(a, sa, b, sb, cfg: BlockwiseConfig) -> jax.Array:
    """``sum_c (a_c @ b_c) * sa[:, c] * sb[c, :]`` in f32 with the implementation chosen by ``cfg.impl``.

    Args:
      a, b: FP8 codes ``a[M, K]`` and ``b[K, N]``.
      sa, sb: f32 scales ``sa[M, K/chunk]``, ``sb[K/chunk, N]`` (chunk = ``cfg.block``).
      cfg: a :class:`BlockwiseConfig`; its ``impl`` (``"xla"``, ``"pallas"``, else ``"mosaic_gpu"``), ``block`` and
        ``interpret`` are used.
    """
    if cfg.impl == "xla":
        return fp8_blockwise_matmul_reference(a, sa, b, sb, chunk=cfg.block)
    if cfg.impl == "pallas":
        return fp8_blockwise_matmul(a, sa, b, sb, chunk=cfg.block, interpret=cfg.interpret)
    # No platform_dependent here: the Mosaic GPU interpreter carries IO effects that a cond over platforms
    # cannot lower for CUDA, so the interpreter is selected only by the explicit ``interpret=True``.
    return fp8_blockwise_matmul_mgpu(a, sa, b, sb, chunk=cfg.block, interpret=bool(cfg.interpret))


def _weight_col_scales(sw_blocks: jax.Array, block: int) -> jax.Array:
    return jnp.repeat(sw_blocks, block, axis=1)  # [K/B, N/B] -> [K/B, N]: one scale per (K-chunk, column)


def _quantize_weight(w, cfg: BlockwiseConfig):
    """``(qw, sw)``: ``w`` quantized in B x B blocks, each shard its own blocks where ``w`` is stored
    (``cfg.w_axes``), so the codes, not the wide weight, cross the wire on their way to the GEMM's layout."""
    quantize = functools.partial(quantize_blocks, dtype=cfg.fwd_dtype, block=cfg.block, scale_format=cfg.scale_format)
    if cfg.axes is None:
        return quantize(w)
    spec = PartitionSpec(*cfg.w_axes)  # the same split for codes [K, N] and scales [K/B, N/B]
    return dispatch.shard_map(quantize, cfg.mesh, [spec], (spec, spec))(w)


def _psum(x, axes):
    return x if axes is None else jax.lax.psum(x, axes)


def _forward_shard(x2, qw, sw, cfg: BlockwiseConfig):
    """One shard's forward ``y`` (f32), summed over the shards of K."""
    qx, sx = quantize_tiles(x2, cfg.fwd_dtype, axis=-1, block=cfg.block, scale_format=cfg.scale_format)
    y = scaled_matmul(qx, sx, qw, _weight_col_scales(sw, cfg.block), cfg)
    return _psum(y, None if cfg.axes is None else cfg.axes[1])


def _backward_shard(x2, qw, sw, g, cfg: BlockwiseConfig):
    """One shard's ``(dx f32, dw f32)``: dx summed over the shards of N, dw over the shards of the rows."""
    b = cfg.block
    g32 = g.astype(jnp.float32)  # y dtype -> f32
    # dx = g @ w.T: g in 1 x B tiles along N; w.T from the forward's blocks, transposed.
    qg, sg = quantize_tiles(g32, cfg.grad_dtype, axis=-1, block=b, scale_format=cfg.scale_format)
    dx = scaled_matmul(qg, sg, qw.T, _weight_col_scales(sw.T, b), cfg)
    # dw = x.T @ g: both in B x 1 tiles along the (zero-padded) token axis.
    m = x2.shape[0]
    pad = (-m) % b
    x_p = jnp.pad(x2.astype(jnp.float32), ((0, pad), (0, 0)))  # x dtype -> f32; zero rows are exact
    g_p = jnp.pad(g32, ((0, pad), (0, 0)))
    qxt, sxt = quantize_tiles(x_p, cfg.fwd_dtype, axis=0, block=b, scale_format=cfg.scale_format)
    qgt, sgt = quantize_tiles(g_p, cfg.grad_dtype, axis=0, block=b, scale_format=cfg.scale_format)
    dw = scaled_matmul(qxt.T, sxt.T, qgt, sgt, cfg)
    if cfg.axes is None:
        return dx, dw
    scattered = {a for _, axes in cfg.dw_scatter for a in axes}
    rest = tuple(a for a in dispatch.as_axes(cfg.axes[0]) if a not in scattered)
    dw = _psum(dw, rest or None)
    for dim, axes in cfg.dw_scatter:  # FSDP: each shard keeps the sum of its own rows of dw (a reduce-scatter)
        dw = jax.lax.psum_scatter(dw, axes, scatter_dimension=dim, tiled=True)
    if cfg.dw_scatter:
        # XLA:TPU's while-loop all-reduce code motion fails a RET_CHECK on a reduce-scatter whose result is cast
        # and then accumulated (a microbatch loop summing bf16 dw in f32); the barrier keeps it in the loop body
        dw = jax.lax.optimization_barrier(dw)
    return _psum(dx, cfg.axes[2]), dw


def _sharded(fn, cfg: BlockwiseConfig, in_specs, out_specs):
    """``fn(..., cfg=cfg)`` per shard on ``cfg.mesh``; specs name operands: "x" [M, K], "w" [K, N], "y" [M, N]."""
    run = functools.partial(fn, cfg=cfg)
    if cfg.axes is None:
        return run
    rows, k, n = cfg.axes
    spec = {"x": PartitionSpec(rows, k), "w": PartitionSpec(k, n), "y": PartitionSpec(rows, n)}
    spec["dw"] = PartitionSpec(*cfg.w_axes) if cfg.dw_scatter else spec["w"]
    out = spec[out_specs] if isinstance(out_specs, str) else tuple(spec[s] for s in out_specs)
    return dispatch.shard_map(run, cfg.mesh, [spec[s] for s in in_specs], out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bdot(x2, w, cfg: BlockwiseConfig):
    y, _ = _bdot_fwd(x2, w, cfg)
    return y


def _bdot_fwd(x2, w, cfg: BlockwiseConfig):
    qw, sw = _quantize_weight(w, cfg)
    y = _sharded(_forward_shard, cfg, ("x", "w", "w"), "y")(x2, qw, sw)
    return y.astype(x2.dtype), (x2, qw, sw, jnp.zeros((0,), w.dtype))  # f32 -> x dtype; last: w's dtype tag


def _bdot_bwd(cfg: BlockwiseConfig, res, g):
    x2, qw, sw, w_tag = res
    dx, dw = _sharded(_backward_shard, cfg, ("x", "w", "w", "y"), ("x", "dw"))(x2, qw, sw, g)
    return dx.astype(x2.dtype), dw.astype(w_tag.dtype)  # f32 -> x dtype, f32 -> w dtype


_bdot.defvjp(_bdot_fwd, _bdot_bwd)


class GemmWeight(NamedTuple):
    """A weight quantized ahead of the GEMMs that use it (:func:`gemm_weight`), e.g. once per optimizer step for
    all of its microbatches: ``codes`` and ``scales`` already in the GEMM's layout, ``w`` the weight itself (only
    its gradient and dtype are used)."""

    w: jax.Array  # [..., K, N]: dw flows to it
    codes: jax.Array  # [..., K, N] in fwd_dtype
    scales: jax.Array  # [..., K/B, N/B] f32


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _bdot_codes(x2, w, qw, sw, cfg: BlockwiseConfig):
    y, _ = _bdot_codes_fwd(x2, w, qw, sw, cfg)
    return y


def _bdot_codes_fwd(x2, w, qw, sw, cfg: BlockwiseConfig):
    y = _sharded(_forward_shard, cfg, ("x", "w", "w"), "y")(x2, qw, sw)
    return y.astype(x2.dtype), (x2, qw, sw, jnp.zeros((0,), w.dtype))  # f32 -> x dtype; last: w's dtype tag


def _bdot_codes_bwd(cfg: BlockwiseConfig, res, g):
    dx, dw = _bdot_bwd(cfg, res, g)
    _, qw, sw, _ = res
    return dx, dw, jnp.zeros_like(qw), jnp.zeros_like(sw)  # the codes are constants of the step


_bdot_codes.defvjp(_bdot_codes_fwd, _bdot_codes_bwd)


def gemm_weight(
    w,
    *,
    block: int = 128,
    fwd_dtype=jnp.float8_e4m3fn,
    scale_format: str = "f32",
    w_axes: tuple[str | None, str | None] | None = None,
    mesh=None,
) -> GemmWeight:
    """``w[..., K, N]`` (leading dims: stacked layers) quantized in B x B blocks where it is stored and moved to the
    layout :func:`blockwise_dot` multiplies it in: under an FSDP mesh one all-gather of the e4m3 codes. Pass the
    result as ``blockwise_dot``'s ``w`` (one layer's slice of it) with the same options, as often as needed: the
    GEMMs are those of ``blockwise_dot(x, w)``, bit for bit, without quantizing or gathering ``w`` again.

    On a multi-device mesh the axes come from the sharding rules (Auto mesh axes, :mod:`lpt.sharding`); on Explicit
    axes it is a ValueError (``blockwise_dot`` follows the operands' own shardings there, which depend on x).

    Args:
      w: floating-point weight ``[..., K, N]``, K and N multiples of ``block``.
      block, fwd_dtype, scale_format: as :func:`blockwise_dot` (pass the same there).
      w_axes: logical names of ``w``'s (K, N) dims, as :func:`blockwise_dot`; None: replicated.
      mesh: the mesh; None: the mesh of ``jax.set_mesh`` if one is set, else whole arrays.
    """
    w = jnp.asarray(w)
    cfg = blockwise_config(block=block, fwd_dtype=fwd_dtype, scale_format=scale_format)
    if w.ndim < 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"w must be a floating-point [..., K, N] array, got shape {w.shape} and dtype {w.dtype}")
    k, n = w.shape[-2:]
    if k % cfg.block or n % cfg.block:
        raise ValueError(f"K={k} and N={n} must be multiples of block={cfg.block}")
    mesh = dispatch.kernel_mesh(mesh)
    if mesh is not None and mesh.size > 1 and sharding.explicit(mesh):
        raise ValueError("gemm_weight needs Auto mesh axes (the sharding rules say where w is stored and multiplied)")
    cfg = _with_mesh(cfg, mesh, None, w[(0,) * (w.ndim - 2)], w_axes)
    lead = w.ndim - 2
    quantize = functools.partial(quantize_blocks, dtype=cfg.fwd_dtype, block=cfg.block, scale_format=cfg.scale_format)
    for _ in range(lead):
        quantize = jax.vmap(quantize)
    if cfg.axes is None:
        return GemmWeight(w, *quantize(w))
    kernel = PartitionSpec(*(None,) * lead, *cfg.axes[1:])
    if not cfg.dw_scatter:  # stored as multiplied, or split otherwise: quantized in the GEMM's layout
        return GemmWeight(w, *dispatch.shard_map(quantize, cfg.mesh, [kernel], (kernel, kernel))(w))

    def gathered(w_shard):
        q, s = quantize(w_shard)
        for dim, axes in cfg.dw_scatter:  # the dims the GEMM holds whole: gather the codes, not the weight
            q = jax.lax.all_gather(q, axes, axis=lead + dim, tiled=True)
            s = jax.lax.all_gather(s, axes, axis=lead + dim, tiled=True)
        return q, s

    stored = PartitionSpec(*(None,) * lead, *cfg.w_axes)
    return GemmWeight(w, *dispatch.shard_map(gathered, cfg.mesh, [stored], (kernel, kernel))(w))


def auto_impl(fwd_dtype=jnp.float8_e4m3fn, grad_dtype=jnp.float8_e5m2, mesh=None) -> str:
    """The GEMMs ``impl="auto"`` runs, by the device the program is lowered for
    (:func:`lpt.kernels.dispatch.target_device` of ``mesh``): the Hopper wgmma kernel (``"mosaic_gpu"``) on a Hopper
    GPU where it takes both formats (:func:`wgmma_takes`), the Pallas kernel (Mosaic) on a TPU, the XLA twin elsewhere
    (a CPU, another GPU, a Hopper GPU with e5m2 gradients on jax 0.10)."""
    device = dispatch.target_device(mesh)
    if device.platform == "tpu":
        return "pallas"
    if dispatch.hopper(device) and wgmma_takes(fwd_dtype, grad_dtype):
        return "mosaic_gpu"
    return "xla"


def wgmma_takes(fwd_dtype, grad_dtype) -> bool:
    """Whether the wgmma kernel runs GEMMs of these formats: one format always; an e4m3 x e5m2 mix from jax 0.11
    (its Mosaic GPU lowers mixed FP8 wgmma; jax 0.10 does not)."""
    return jnp.dtype(fwd_dtype) == jnp.dtype(grad_dtype) or compat.WGMMA_MIXES_FP8


def blockwise_config(**options) -> BlockwiseConfig:
    """The static options of :func:`blockwise_dot` (its arguments of the same names), checked: a ValueError naming
    the option and what it allows for an unknown impl, a non-FP8 dtype, an unknown scale format, an interpret other
    than None / True, or ``impl="mosaic_gpu"`` with two FP8 formats (wgmma cannot mix them). Options not given
    take :class:`BlockwiseConfig`'s defaults; ``impl="auto"`` is resolved by :func:`auto_impl` for the
    ``jax.set_mesh`` mesh or the default device."""
    unknown = sorted(set(options) - set(_STATIC_OPTIONS))
    if unknown:
        raise ValueError(f"unknown blockwise_dot option(s) {unknown}; the options are {list(_STATIC_OPTIONS)}")
    cfg = BlockwiseConfig()._replace(**options)
    check_impl(cfg.impl, IMPLS, "blockwise FP8")
    if cfg.impl == "auto":
        dispatch.check_auto_interpret(cfg.interpret)
        cfg = cfg._replace(impl=auto_impl(cfg.fwd_dtype, cfg.grad_dtype))
    check_scale_format(cfg.scale_format)
    cfg = cfg._replace(
        block=int(cfg.block),
        fwd_dtype=check_fp8_dtype(cfg.fwd_dtype, "fwd_dtype"),
        grad_dtype=check_fp8_dtype(cfg.grad_dtype, "grad_dtype"),
    )
    if cfg.impl == "mosaic_gpu" and not wgmma_takes(cfg.fwd_dtype, cfg.grad_dtype):
        raise ValueError(
            f"impl='mosaic_gpu' needs grad_dtype == fwd_dtype on jax {jax.__version__} (its wgmma cannot mix FP8 "
            f"formats; jax >= 0.11 can), got fwd_dtype={cfg.fwd_dtype}, grad_dtype={cfg.grad_dtype}"
        )
    if cfg.interpret not in (None, True):
        raise ValueError(f"interpret must be None (choose per platform) or True, got {cfg.interpret!r}")
    return cfg


def blockwise_dot(
    x,
    w,
    *,
    impl: str = "xla",
    block: int = 128,
    fwd_dtype=jnp.float8_e4m3fn,
    grad_dtype=jnp.float8_e5m2,
    scale_format: str = "f32",
    interpret: bool | None = None,
    w_axes: tuple[str | None, str | None] | None = None,
    mesh=None,
) -> jax.Array:
    """FP8 blockwise matmul ``x[..., K] @ w[K, N]`` with promoted f32 accumulation; differentiable in x and w.

    Args:
      x: activations ``[..., K]`` (any float dtype; the output has this dtype).
      w: weight ``[K, N]`` (any float dtype; ``dw`` has this dtype), or a :class:`GemmWeight` of one (from
        :func:`gemm_weight` with the same options): its codes are multiplied as they are, ``dw`` goes to its ``w``.
      impl: ``"xla"`` (scan over K-chunks), ``"pallas"`` (portable Pallas kernel; interpreted on CPU),
        ``"mosaic_gpu"`` (Hopper wgmma kernel; CUDA only, or ``interpret=True``; grad_dtype == fwd_dtype on jax 0.10) or
        ``"auto"`` (by the device the program is lowered for, :func:`auto_impl`; ``interpret`` must be None).
      block: tile / block edge B and promotion interval (128 as in DeepSeek-V3). K and N must be multiples of it.
      fwd_dtype: FP8 format of x and w (float8_e4m3fn by default).
      grad_dtype: FP8 format of the output gradient in both backward GEMMs (float8_e5m2 by default; pass
        float8_e4m3fn for e4m3 everywhere, as DeepSeek-V3 does).
      scale_format: ``"f32"`` (scale = amax / max) or ``"pow2"`` (scale rounded up to a power of two).
      interpret: for the kernels: ``True`` forces the interpreter; ``None``: ``"pallas"`` picks per platform
        (``lax.platform_dependent``), ``"mosaic_gpu"`` compiles for CUDA.
      w_axes: logical names of ``w``'s (K, N) dims, e.g. ``("embed", "mlp")``; under a mesh ``w`` is split by them
        (see the module doc). None: ``w`` is replicated on every shard.
      mesh: the mesh to run per shard on; None: the mesh of ``jax.set_mesh`` if one is set, else whole arrays.

    Raises:
      ValueError: for non-float inputs, mismatched K, K or N not a multiple of ``block``, unknown options, or
        under a mesh: rows not divisible by the batch axes, or a shard of K or N not a multiple of ``block``.
    """
    prepared = w if isinstance(w, GemmWeight) else None
    if impl == "auto" and interpret is None:  # by the devices of the mesh it runs on
        impl = auto_impl(fwd_dtype, grad_dtype, dispatch.kernel_mesh(mesh))
    options = dict(impl=impl, block=block, fwd_dtype=fwd_dtype, grad_dtype=grad_dtype, scale_format=scale_format)
    cfg = blockwise_config(interpret=interpret, **options)
    x, w = check_dense_operands(x, w if prepared is None else prepared.w)
    k, n = w.shape
    if cfg.block <= 0 or k % cfg.block or n % cfg.block:
        raise ValueError(
            f"K={k} and N={n} must be multiples of block={cfg.block} (1x{cfg.block} tiles, "
            f"{cfg.block}x{cfg.block} weight blocks); choose a smaller block or pad the layer"
        )
    lead = x.shape[:-1]
    cfg = _with_mesh(cfg, dispatch.kernel_mesh(mesh), x, w, w_axes)
    if prepared is not None:
        if prepared.codes.dtype != cfg.fwd_dtype or prepared.codes.shape != w.shape:
            raise ValueError(
                f"a GemmWeight of {prepared.codes.dtype} codes {prepared.codes.shape} does not fit fwd_dtype="
                f"{cfg.fwd_dtype} and w {w.shape}; make it with gemm_weight and the same options"
            )
        return _bdot_codes(x.reshape(-1, k), w, prepared.codes, prepared.scales, cfg).reshape(*lead, n)
    y2 = _bdot(x.reshape(-1, k), w, cfg)
    return y2.reshape(*lead, n)


def _with_mesh(cfg: BlockwiseConfig, mesh, x, w, w_axes) -> BlockwiseConfig:
    """``cfg`` with the mesh and the (rows, K, N) mesh axes (:func:`lpt.sharding.operand_spec`: the operands' own
    shardings on Explicit mesh axes, the rules on Auto ones); unchanged without a multi-device mesh. ``x=None``:
    the rows are not known yet (:func:`gemm_weight`), and the rules decide."""
    if mesh is None or mesh.size == 1:
        return cfg
    if w_axes is not None and len(w_axes) != 2:
        raise ValueError(f"w_axes must name the weight's (K, N) dims, got {w_axes!r}")
    what = f"blockwise_dot(impl={cfg.impl!r})"
    k_name, n_name = (None, None) if w_axes is None else w_axes
    if x is not None and sharding.explicit(mesh):  # the operands' splits: x's rows, K; w's N (w moves to x's K split)
        xs = sharding.operand_spec(x, (None,) * x.ndim, mesh, what)
        ws = sharding.operand_spec(w, (None, None), mesh, what)
        if any(a is not None for a in xs[1:-1]):
            raise ValueError(f"{what}: x is split over {xs}; split only its leading (batch) dim and K")
        axes = (xs[0] if x.ndim > 1 else None, xs[-1], ws[1])
        used = [a for entry in axes for a in dispatch.as_axes(entry)]
        if len(used) != len(set(used)):
            raise ValueError(f"{what}: x's rows, K and w's N are split over {axes}; each mesh axis may split one")
        stored = (ws[0], ws[1])
    else:  # the rules, resolved together (first unused rule wins: the trainer's FSDP weights are gathered)
        axes = tuple(sharding.rule_spec(("batch", k_name, n_name), mesh, what))
        stored = tuple(sharding.rule_spec((k_name, n_name), mesh, what))  # w alone: where the rules store it
    k, n = w.shape
    if x is not None:
        dispatch.check_divisible("rows of x (tokens)", x.size // k, mesh, axes[0])
    for what, size, a in (("K", k, axes[1]), ("N", n, axes[2])):
        shard = dispatch.check_divisible(what, size, mesh, a)
        if shard % cfg.block:
            raise ValueError(
                f"{what}={size} split over mesh axes {dispatch.as_axes(a)} gives shards of {shard}, not a multiple "
                f"of block={cfg.block} (quantization blocks must stay within a shard)"
            )
    w_at = _quantized_where(stored, axes[1:], (k, n), mesh, cfg.block)
    return cfg._replace(mesh=mesh, axes=axes, w_axes=w_at, dw_scatter=_dw_scatter(w_at, axes))


def _quantized_where(stored: tuple, kernel: tuple, shape: tuple, mesh, block: int) -> tuple:
    """The (K, N) mesh axes to quantize ``w`` on: where it is ``stored`` if each shard there holds whole B x B
    blocks, else the GEMM's own split ``kernel`` (the wide weight is then moved before it is quantized)."""
    for size, entry in zip(shape, stored, strict=True):
        parts = dispatch.mesh_axis_size(mesh, entry)
        if size % parts or (size // parts) % block:
            return tuple(kernel)
    return tuple(stored)


def _dw_scatter(w_at: tuple, axes: tuple) -> tuple:
    """``(dim, mesh axes)`` pairs for a reduce-scatter of dw onto ``w_at``: each dim that the GEMM leaves whole but
    ``w`` is split on over rows' axes (FSDP: w's rows over "fsdp", tokens over ("data", "fsdp")); () when another
    layout asks for plain sums (dw then leaves the GEMM in its layout and is sliced to w's)."""
    rows = set(dispatch.as_axes(axes[0]))
    pairs = []
    for dim, (at, kernel) in enumerate(zip(w_at, axes[1:], strict=True)):
        if dispatch.as_axes(at) == dispatch.as_axes(kernel):
            continue
        if kernel is not None or not set(dispatch.as_axes(at)) <= rows:
            return ()
        pairs.append((dim, dispatch.as_axes(at)))
    return tuple(pairs)
