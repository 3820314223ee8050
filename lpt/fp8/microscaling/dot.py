"""``block_scaled_dot``: a differentiable ``x[..., K] @ w[K, N]`` whose three GEMMs take block-scaled operands,
MXFP8 or NVFP4: each operand is quantized in its recipe's blocks along its contraction axis, then multiplied either
by an emulation (dequantized blockwise, f32 accumulation; every platform) or by :func:`jax.nn.scaled_matmul` (CUDA).

The recipes are TransformerEngine's ``MXFP8BlockScaling`` and ``NVFP4BlockScaling``, the latter from NVIDIA's
*Pretraining Large Language Models with NVFP4* (arXiv 2509.25149). With ``g = dL/dy`` and M the token axis:

============  ================================  =====================================================
GEMM          ``"mxfp8"`` (e4m3, e8m0 scales)   ``"nvfp4"`` (e2m1, e4m3 scales, f32 tensor scale)
============  ================================  =====================================================
y  = x w      x: 1x32 along K; w: 32x1 along K  x: 1x16 along K; w: 16x16 tiles
dx = g wᵀ     g: 1x32 along N; w: 1x32 along N  g: 1x16 along N; w: the same 16x16 tiles
dw = xᵀ g     x, g: 32x1 along M                R x, R g in 16x1 along M (R: random Hadamard along M)
============  ================================  =====================================================

``hadamard`` (the random Hadamard transform of dw's inputs, :mod:`lpt.fp8.microscaling.hadamard`, 16x16 blocks
along M) and ``stochastic_grads`` (stochastic rounding of g's codes in dx and dw) are switches; both default to on for
"nvfp4" and off for "mxfp8", as in the two recipes. x and w are always rounded to nearest even.

Emulation (``impl="xla"``): an operand enters its GEMM as its codes times its block scales in bf16, which is exact
(an e4m3 or e2m1 code times a power of two, or an e2m1 code times an e4m3 scale, has at most 6 significant bits;
only values below 2^-126 lose bits); ``preferred_element_type=f32`` makes every product exact and every sum an f32
addition; the NVFP4 tensor scales multiply the f32 result afterwards (x's, then w's), as the block-scaled MMA's
epilogue does. So the result is the f32 product of the dequantized operands on every platform, up to the order of
the f32 additions. ``impl="scaled_matmul"`` hands the codes and block scales (contraction axis last) to
:func:`jax.nn.scaled_matmul` (which lowers for CUDA and ROCm only); XLA turns it into cuDNN's block-scaled GEMM
(``__cudnn$blockScaledDot``) on Blackwell when the target's cuDNN is 9.10 or newer, otherwise into a
dequantize-and-multiply in f32; the tensor scales are applied the same way. ``impl="auto"`` (the default) takes
``"scaled_matmul"`` on CUDA and ``"xla"`` elsewhere through ``lax.platform_dependent``, so one traced program serves
both. (``jax.vmap`` of a call in which only some operands are batched needs ``impl="xla"``: scaled_matmul's batching
rule batches all four together.)

Under a mesh (Auto axes, as the trainer's) the partitioner splits the emulation's XLA ops like any other (the
NVFP4 tensor amax is a global max and the SR bits depend on the element's global index only), so a sharded run
equals the unsharded one up to the order of f32 additions. ``jax.nn.scaled_matmul`` carries its own partitioning
rule, which no test here runs (no GPU).

Choices where the sources leave one:

* MX scales follow the OCP MX v1.0 floor rule of :func:`lpt.fp8.mx_quantize` (a block's amax lands in
  [256, 512) · scale, values above 448 · scale saturate); TransformerEngine rounds the scale up instead.
* MXFP8 uses e4m3 for x, w and g (TransformerEngine's default MXFP8 format).
* Stochastic rounding applies to g in both backward GEMMs (the recipe's gradient quantizer); the scales stay
  deterministic (:mod:`lpt.fp8.microscaling.formats`).
* The Hadamard signs are drawn from the key on every call, so each layer and step has its own transform.
* w is quantized again in the backward pass (for NVFP4 the same 16x16 codes as the forward's, since quantization is
  deterministic), so the residuals are x and w only. dw's token axis is zero-padded to a multiple of the block,
  which is exact (zeros add nothing, raise no amax, and the Hadamard transform of a padded block keeps the product).

Randomness: ``key`` (a JAX PRNG key; the trainer passes the layer's key of the step, ``fold_in(fold_in(seed,
step), crc32(layer path))``) gives ``fold_in(key, 1)`` for the SR of g in dx, ``fold_in(key, 2)`` for its SR in dw
and ``fold_in(key, 3)`` for the Hadamard signs; the bits are :func:`lpt.numerics.hash_bits`, a function of the key
and the element index only, so runs are reproducible and a resumed run draws the same bits. Without a key the
forward pass works, but differentiating it with a switch on raises ValueError.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lpt.fp8.microscaling.formats import (
    NVFP4_BLOCK,
    NVFP4_TILE,
    mx_dequantize,
    mx_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
)
from lpt.fp8.microscaling.hadamard import HADAMARD_BLOCK, block_hadamard, random_hadamard
from lpt.fp8.recipe import check_dense_operands, check_impl, impls

__all__ = [
    "BLOCKS",
    "IMPLS",
    "RECIPES",
    "BlockScaledConfig",
    "block_scaled_config",
    "block_scaled_dot",
    "check_recipe",
]

RECIPES = ("mxfp8", "nvfp4")
IMPLS = impls("auto", "xla", "scaled_matmul")
BLOCKS = {"mxfp8": 32, "nvfp4": NVFP4_BLOCK}  # elements per block along the contraction axis
_DEFAULT_ON = {"mxfp8": False, "nvfp4": True}  # hadamard and stochastic_grads unless given
_E4M3 = jnp.dtype(jnp.float8_e4m3fn)
_KEY_SR_DGRAD, _KEY_SR_WGRAD, _KEY_HADAMARD = 1, 2, 3


class BlockScaledConfig(NamedTuple):
    """Static options of :func:`block_scaled_dot` (hashable)."""

    recipe: str = "nvfp4"
    hadamard: bool = True
    stochastic_grads: bool = True
    impl: str = "auto"
    keyed: bool = False  # whether the call has a key (derived: the backward needs one for either switch)


def check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")


def block_scaled_config(
    recipe: str, hadamard: bool | None = None, stochastic_grads: bool | None = None, impl: str = "auto"
) -> BlockScaledConfig:
    """The checked static options; ``None`` takes the recipe's default (on for "nvfp4", off for "mxfp8")."""
    check_recipe(recipe)
    check_impl(impl, IMPLS, f"recipe {recipe!r}")
    on = _DEFAULT_ON[recipe]
    hadamard = on if hadamard is None else hadamard
    stochastic_grads = on if stochastic_grads is None else stochastic_grads
    for name, v in (("hadamard", hadamard), ("stochastic_grads", stochastic_grads)):
        if not isinstance(v, bool | np.bool_):
            raise ValueError(f"{name} must be True, False or None (the recipe's default), got {v!r}")
    return BlockScaledConfig(recipe, bool(hadamard), bool(stochastic_grads), impl)


# ---------------------------------------------------------------------------------------------------------------
# Operands and the GEMMs
# ---------------------------------------------------------------------------------------------------------------


class _Operand(NamedTuple):
    """A quantized 2-D operand with its contraction axis last: ``[P, C]``."""

    codes: jax.Array  # e4m3 (MXFP8) or e2m1 (NVFP4), [P, C]
    scales: jax.Array  # e8m0 (MXFP8) or e4m3 (NVFP4), one per block of C: [P, C / block]
    tensor_scale: jax.Array | None  # f32 scalar (NVFP4), None (MX)


def _quantize(a32: jax.Array, recipe: str, axis: int, *, tiles: bool = False, key=None) -> _Operand:
    """``a32`` (f32, 2-D) quantized in ``recipe``'s blocks along ``axis`` (or NVFP4's 16x16 tiles when ``tiles``;
    their scales then repeat along the other axis), codes stochastically rounded when a ``key`` is given; returned
    with ``axis`` moved last."""
    rounding = "nearest" if key is None else "stochastic"
    if recipe == "mxfp8":
        codes, scales = mx_quantize(a32, _E4M3, BLOCKS[recipe], axis, rounding=rounding, key=key)
        ts = None
    elif tiles:
        codes, scales, ts = nvfp4_quantize(a32, block_shape=NVFP4_TILE, rounding=rounding, key=key)
        scales = jnp.repeat(scales, NVFP4_TILE[0], axis=1 - axis)  # one scale per 1x16 block along axis: exact
    else:
        codes, scales, ts = nvfp4_quantize(a32, axis, rounding=rounding, key=key)
    last = lambda t: jnp.moveaxis(t, axis, -1)
    return _Operand(last(codes), last(scales), ts)


def _weight(w32: jax.Array, recipe: str, axis: int) -> _Operand:
    """The weight ``[K, N]`` contracted along ``axis``: MX blocks along it, NVFP4's 16x16 tiles for either axis."""
    return _quantize(w32, recipe, axis, tiles=recipe == "nvfp4")


def _values(op: _Operand, recipe: str) -> jax.Array:
    """``codes · block scales`` in bf16 (exact: at most 6 significant bits; values below 2^-126 may lose bits)."""
    if recipe == "mxfp8":
        return mx_dequantize(op.codes, op.scales, BLOCKS[recipe], -1, jnp.bfloat16)  # e4m3 · 2^e -> bf16
    return nvfp4_dequantize(op.codes, op.scales, jnp.float32(1.0), -1, jnp.bfloat16)  # e2m1 · e4m3 -> bf16


def _dot_emulated(a: _Operand, b: _Operand, recipe: str) -> jax.Array:
    """``a [P, C] · b [Q, C]ᵀ`` on the bf16 values, f32 accumulation."""
    va, vb = _values(a, recipe), _values(b, recipe)
    return jnp.einsum("pc,qc->pq", va, vb, preferred_element_type=jnp.float32)  # bf16 x bf16 -> f32 (exact)


def _dot_scaled_matmul(a: _Operand, b: _Operand) -> jax.Array:
    """``a [P, C] · b [Q, C]ᵀ`` through :func:`jax.nn.scaled_matmul` (codes and block scales), f32 out."""
    one = lambda t: t[None]  # the batch axis scaled_matmul wants
    y = jax.nn.scaled_matmul(one(a.codes), one(b.codes), one(a.scales), one(b.scales), jnp.float32)
    return y[0]


def _gemm(a: _Operand, b: _Operand, cfg: BlockScaledConfig) -> jax.Array:
    """``a [P, C] · b [Q, C]ᵀ`` with ``cfg.impl``, times the tensor scales (f32 ``[P, Q]``)."""
    if cfg.impl == "xla":
        acc = _dot_emulated(a, b, cfg.recipe)
    elif cfg.impl == "scaled_matmul":
        acc = _dot_scaled_matmul(a, b)
    else:  # "auto": cuDNN's block-scaled GEMM through scaled_matmul on CUDA, the emulation elsewhere
        acc = lax.platform_dependent(
            a, b, cuda=_dot_scaled_matmul, default=lambda a, b: _dot_emulated(a, b, cfg.recipe)
        )
    for s in (a.tensor_scale, b.tensor_scale):
        if s is not None:
            acc = acc * s  # f32 epilogue: one rounding per tensor scale
    return acc


def _forward(x2, w, cfg: BlockScaledConfig) -> jax.Array:
    x32 = x2.astype(jnp.float32)  # x dtype -> f32 (exact widening)
    w32 = w.astype(jnp.float32)  # w dtype -> f32 (exact widening)
    return _gemm(_quantize(x32, cfg.recipe, 1), _weight(w32, cfg.recipe, 0), cfg)  # [M, K] · [N, K]ᵀ


def _backward(x2, w, keys, g, cfg: BlockScaledConfig) -> tuple[jax.Array, jax.Array]:
    """``(dx, dw)`` in f32."""
    if (cfg.hadamard or cfg.stochastic_grads) and not cfg.keyed:
        raise ValueError(
            f"block_scaled_dot(recipe={cfg.recipe!r}) with hadamard={cfg.hadamard}, stochastic_grads="
            f"{cfg.stochastic_grads} needs a key to differentiate; pass key= or turn both off"
        )
    sr_dgrad = keys[_KEY_SR_DGRAD - 1] if cfg.stochastic_grads else None
    sr_wgrad = keys[_KEY_SR_WGRAD - 1] if cfg.stochastic_grads else None
    g32 = g.astype(jnp.float32)  # y dtype -> f32 (exact widening)
    w32 = w.astype(jnp.float32)  # w dtype -> f32 (exact widening)
    dx = _gemm(_quantize(g32, cfg.recipe, 1, key=sr_dgrad), _weight(w32, cfg.recipe, 1), cfg)  # [M, N] · [K, N]ᵀ

    pad = (-x2.shape[0]) % BLOCKS[cfg.recipe]  # a multiple of the Hadamard block (16) as well
    xt = jnp.pad(x2.astype(jnp.float32), ((0, pad), (0, 0)))  # x dtype -> f32; zero rows are exact
    gt = jnp.pad(g32, ((0, pad), (0, 0)))
    if cfg.hadamard:
        r = random_hadamard(keys[_KEY_HADAMARD - 1], HADAMARD_BLOCK)
        xt, gt = block_hadamard(xt, r, axis=0), block_hadamard(gt, r, axis=0)
    dw = _gemm(_quantize(xt, cfg.recipe, 0), _quantize(gt, cfg.recipe, 0, key=sr_wgrad), cfg)  # [K, M] · [N, M]ᵀ
    return dx, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _bsdot(x2, w, keys, cfg: BlockScaledConfig):
    return _forward(x2, w, cfg).astype(x2.dtype)  # f32 accumulator -> x dtype


def _bsdot_fwd(x2, w, keys, cfg: BlockScaledConfig):
    return _bsdot(x2, w, keys, cfg), (x2, w, keys)


def _bsdot_bwd(cfg: BlockScaledConfig, res, g):
    x2, w, keys = res
    dx, dw = _backward(x2, w, keys, g, cfg)
    return dx.astype(x2.dtype), dw.astype(w.dtype), None  # f32 -> x dtype, f32 -> w dtype; keys: no cotangent


_bsdot.defvjp(_bsdot_fwd, _bsdot_bwd)


def _derived_keys(key) -> jax.Array:
    """uint32 ``[3, words]``: the raw data of ``fold_in(key, 1 | 2 | 3)`` (typed or raw key in)."""
    subkeys = [jax.random.fold_in(key, i) for i in (_KEY_SR_DGRAD, _KEY_SR_WGRAD, _KEY_HADAMARD)]
    as_data = lambda k: jax.random.key_data(k) if jnp.issubdtype(k.dtype, jax.dtypes.prng_key) else k
    return jnp.stack([as_data(k).astype(jnp.uint32).reshape(-1) for k in subkeys])  # key data -> u32 words


def block_scaled_dot(
    x,
    w,
    recipe: str = "nvfp4",
    *,
    key=None,
    hadamard: bool | None = None,
    stochastic_grads: bool | None = None,
    impl: str = "auto",
) -> jax.Array:
    """Block-scaled matmul ``x[..., K] @ w[K, N]`` (MXFP8 or NVFP4, emulated); differentiable in x and w.

    Args:
      x: activations ``[..., K]`` (any float dtype; the output and dx have this dtype).
      w: weight ``[K, N]`` (any float dtype; dw has this dtype).
      recipe: ``"mxfp8"`` (1x32 blocks, K and N multiples of 32) or ``"nvfp4"`` (1x16 blocks and 16x16 weight
        tiles, K and N multiples of 16). The token count is free.
      key: JAX PRNG key of the call (layer and step) for stochastic rounding and the Hadamard signs; needed to
        differentiate with either switch on.
      hadamard: random Hadamard transform of dw's inputs along the tokens; None: the recipe's default (nvfp4: on).
      stochastic_grads: stochastic rounding of g in dx and dw; None: the recipe's default (nvfp4: on).
      impl: how the three GEMMs multiply the quantized operands: ``"xla"`` (the emulation), ``"scaled_matmul"``
        (:func:`jax.nn.scaled_matmul` on codes and block scales; CUDA and ROCm only), ``"auto"``
        (``"scaled_matmul"`` on CUDA, ``"xla"`` elsewhere, by ``lax.platform_dependent``).

    Raises:
      ValueError: for an unknown recipe or impl, a switch that is not a bool, non-float inputs, a w that is not 2-D,
        mismatched K, or K or N not a multiple of the recipe's block.
    """
    cfg = block_scaled_config(recipe, hadamard, stochastic_grads, impl)
    x, w = check_dense_operands(x, w)
    k, n = w.shape
    b = BLOCKS[recipe]
    if k % b or n % b:
        raise ValueError(f"{recipe} needs K and N multiples of {b}, got w of shape {w.shape}; pad the layer")
    if key is None:
        keys = jnp.zeros((3, 2), jnp.uint32)  # unused: the backward refuses to run without a key
    else:
        keys, cfg = _derived_keys(key), cfg._replace(keyed=True)
    y2 = _bsdot(x.reshape(-1, k), w, keys, cfg)
    return y2.reshape(*x.shape[:-1], n)
