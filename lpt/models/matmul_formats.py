"""The matmul formats of the model's layers: one object per format, registered by name.

``precision.matmul.<projection>`` names a format; :func:`get` returns its :class:`MatmulFormat`, which owns everything
the rest of lpt asks of a format:

* ``gemm(x, w, *, w_axes, key, path, prec)``: the differentiable ``x[..., K] @ w[K, N]`` of a layer, returning the
  float32 accumulator (:func:`lpt.models.layers.matmul` rounds it once to the layer's output dtype);
* ``block(numerics)`` and ``check_shape(projection, k, n, numerics)``: the multiple that K and N of every weight must
  be (:func:`lpt.models.config.check_matmul_blocks` asks each projection's format);
* ``probe(name, x, w, y_f32)``: the statistics the diagnostics pass records (:mod:`lpt.models.probes`);
* ``low_precision``: whether ``precision.bf16_layers`` runs it as "bf16" in the chosen blocks;
* the lab's per-GEMM view (``python -m lpt.lab formats``): ``quantized_operands(x, w, g, *, key, prec)`` (x, w and
  dY quantized and dequantized as the format's GEMMs take them), ``emulated_gemm(x, w, *, key, prec)`` (its GEMMs
  computed by XLA on every platform) and ``block_health(x, w, g)`` (block-scale health, or None).

The registered formats (:func:`names`; :data:`NAMES` is the live view that the config's allowed values read):

* "bf16": compute-dtype operands (bf16, or f32 when compute_dtype is float32), ``preferred_element_type=f32``;
* "fp8": :func:`lpt.fp8.blockwise_dot`, DeepSeek-V3's blockwise FP8 (e4m3 operands with 1×128 / 128×128 scales, f32
  promotion every 128 of K, e5m2 output gradients; the GEMMs and gradient format of ``prec.fp8_options()``); K and N
  multiples of 128;
* "mxfp8", "nvfp4": :func:`lpt.fp8.block_scaled_dot` (forward and both backward GEMMs in the format, emulated); K and
  N multiples of 32 / 16. Their stochastic rounding and Hadamard signs use ``layer_key(key, path)``
  (:func:`lpt.pqt.layer_key`: the step key with the layer path folded in; ``key=None`` in evaluation), and ``prec``
  gives NVFP4's switches (``nvfp4_hadamard``, ``nvfp4_stochastic_grads``; None: the recipe's defaults).

A new format is a :class:`MatmulFormat` subclass in its own module and one :func:`register` call; the config, the
layers, the diagnostics pass and the lab find it by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from lpt.fp8.blockwise import (
    BlockwiseConfig,
    blockwise_config,
    blockwise_dot,
    dequantize_blocks,
    dequantize_tiles,
    quantize_blocks,
    quantize_operands,
    quantize_tiles,
)
from lpt.fp8.microscaling import (
    BLOCKS,
    BlockHealth,
    block_scale_health,
    block_scaled_config,
    block_scaled_dot,
    gemm_block_health,
    operand_layout,
    quantize_dequantize,
)
from lpt.models import probes
from lpt.options import LiveChoices
from lpt.pqt.keys import layer_key

if TYPE_CHECKING:
    from lpt.models.config import Precision

__all__ = ["NAMES", "MatmulFormat", "get", "names", "register", "unregister"]


class MatmulFormat:
    """One matmul format. A subclass sets :attr:`name` and defines :meth:`gemm`; the other methods have the defaults
    of a format without blocks, statistics or a lab view."""

    name: str = ""  # the value of precision.matmul.<projection>
    low_precision: bool = True  # precision.bf16_layers runs it as "bf16" in the blocks it names

    def gemm(self, x: jax.Array, w, *, w_axes: tuple | None, key, path: str, prec: Precision | None) -> jax.Array:
        """``x[..., K] @ w[K, N]`` as the float32 accumulator, differentiable in x and w.

        Args:
          x: ``[..., K]`` in the compute dtype.
          w: the weight's compute-dtype view (or, for "fp8" layers of ``optim.fp8_gather="step"``, an
            :class:`lpt.fp8.blockwise.GemmWeight`).
          w_axes: its logical axes.
          key: the step key (None in evaluation).
          path: the layer path.
          prec: the model's numerics (None: the format's defaults).
        """
        raise NotImplementedError(f"matmul format {self.name!r} defines no gemm")

    def block(self, numerics: Precision) -> int:
        """The multiple that K and N of every weight this format multiplies must be (1: any)."""
        return 1

    def check_shape(self, projection: str, k: int, n: int, numerics: Precision) -> None:
        """Raise ValueError, naming the config key and the weight, when a ``k x n`` weight of ``projection`` does
        not fit the format's blocks."""
        b = self.block(numerics)
        if k % b or n % b:
            raise ValueError(
                f"precision.matmul.{projection}={self.name!r} needs K and N multiples of {b}, but the model's "
                f"{projection} weight is {k}x{n}; change the model's widths or use another matmul for {projection}"
            )

    def probe(self, name: str, x: jax.Array, w, y_f32: jax.Array) -> None:
        """Record the statistics of one GEMM ``y_f32 = gemm(x, w)`` of projection ``name`` into
        :func:`lpt.models.probes.current` (called only while a diagnostics pass is traced). Default: none."""

    def quantized_operands(self, x, w, g, *, key, prec: Precision) -> tuple[jax.Array, jax.Array, jax.Array]:
        """f32 ``x``, ``w`` and ``g`` quantized and dequantized as the format's GEMMs take them (g as the dX GEMM
        does).

        Args:
          x, w, g: f32 ``x [M, K]``, ``w [K, N]`` and ``g [M, N]`` (dY), K and N multiples of :meth:`block`.
          key: the call's key as given to :meth:`emulated_gemm`.
          prec: the model's numerics.
        """
        raise NotImplementedError(f"matmul format {self.name!r} defines no quantized operands")

    def emulated_gemm(self, x, w, *, key, prec: Precision) -> jax.Array:
        """f32 ``x [M, K] @ w [K, N]`` with the format's three GEMMs computed by XLA on every platform (no kernel),
        differentiable; ``key`` is used as given (no layer path is folded in)."""
        raise NotImplementedError(f"matmul format {self.name!r} defines no emulated gemm")

    def block_health(self, x, w, g) -> tuple[BlockHealth, BlockHealth, BlockHealth] | None:
        """The block-scale health (:func:`lpt.fp8.microscaling.block_scale_health`) of x, w and g as the
        format's GEMMs block them; None for a format without block scales."""
        return None


class _Bf16(MatmulFormat):
    """Compute-dtype operands, f32 accumulation: the reference every other format is compared with."""

    name, low_precision = "bf16", False

    def gemm(self, x, w, *, w_axes, key, path, prec):
        return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)

    def quantized_operands(self, x, w, g, *, key, prec):
        return x, w, g

    def emulated_gemm(self, x, w, *, key, prec):
        return self.gemm(x, w, w_axes=None, key=key, path="", prec=prec)  # XLA's dot already


class _BlockwiseFp8(MatmulFormat):
    """DeepSeek-V3's blockwise FP8 (:func:`lpt.fp8.blockwise_dot`).

    Its probe records, per projection ``<projection>``, with the operands quantized exactly as ``blockwise_dot`` does
    (e4m3, 1×128 tiles of x along K, 128×128 blocks of w, f32 amax scales): ``fp8/<projection>/x_underflow_frac``
    (nonzero entries flushed to 0 / all entries), ``fp8/<projection>/x_subnormal_frac`` (nonzero entries whose scaled
    value ``|x / s|`` lands below e4m3's smallest normal 2⁻⁶, flushed ones included, / all entries: they keep fewer
    than 3 mantissa bits), ``fp8/<projection>/w_underflow_frac``, ``fp8/<projection>/w_subnormal_frac`` (same for the
    weight), ``fp8/<projection>/x_scale_range_log2`` (max over the layers of ``log2(max tile scale / min nonzero tile
    scale)``: the dynamic range that per-tile scaling absorbs and one per-tensor scale would not) and
    ``fp8/<projection>/snr_db`` (``10 log10(Σ y_ref² / Σ (y_fp8 − y_ref)²)`` with ``y_ref`` the same GEMM on the
    compute-dtype operands with f32 accumulation, i.e. what "bf16" computes). Saturation is not reported: with amax
    scaling the largest entry of every tile maps to ±448 exactly, so clipping cannot happen (only f32 round-off of
    ``amax / (amax / 448)``, which rounds back to 448).

    Its lab view is ``blockwise_dot``'s own recipe on the XLA twin (e4m3 x and w, e5m2 dY), whatever
    ``precision.fp8_impl`` says.
    """

    name = "fp8"

    def gemm(self, x, w, *, w_axes, key, path, prec):

        # blockwise_dot returns x's dtype: hand it f32 (exact widening; it quantizes to e4m3 anyway) to get the f32
        # accumulator back
        options = {} if prec is None else prec.fp8_options()
        return blockwise_dot(x.astype(jnp.float32), w, w_axes=w_axes, **options)  # compute -> f32 (exact)

    def block(self, numerics):

        return blockwise_config(**numerics.fp8_options()).block

    def probe(self, name, x, w, y_f32):

        w = getattr(w, "w", w)  # a GemmWeight's weight, or w
        c, cfg = probes.current(), BlockwiseConfig()
        x_f32, _, (_, sx, xs), (_, _, ws) = quantize_operands(
            x, w, block=cfg.block, fwd_dtype=cfg.fwd_dtype, scale_format=cfg.scale_format
        )
        for operand, st in (("x", xs), ("w", ws)):  # int32 counts (Collector.add takes them to f32)
            c.add(f"fp8/{name}/{operand}_underflow_frac", probes.RATIO, st.underflowed, st.total)
            c.add(f"fp8/{name}/{operand}_subnormal_frac", probes.RATIO, st.subnormal, st.total)
        amax_pos = jnp.max(jnp.abs(x_f32).reshape(sx.shape + (cfg.block,)), axis=-1) > 0
        lo = jnp.min(jnp.where(amax_pos, sx, jnp.inf))
        hi = jnp.max(jnp.where(amax_pos, sx, 0.0))
        c.add(f"fp8/{name}/x_scale_range_log2", probes.MAX, jnp.where(hi > 0, jnp.log2(hi / lo), 0.0))
        _record_snr(c, name, x, w, y_f32)

    def quantized_operands(self, x, w, g, *, key, prec):

        cfg = BlockwiseConfig()
        tiles = lambda a, dtype: dequantize_tiles(*quantize_tiles(a, dtype, block=cfg.block), block=cfg.block)
        wq = dequantize_blocks(*quantize_blocks(w, cfg.fwd_dtype, block=cfg.block), block=cfg.block)
        return tiles(x, cfg.fwd_dtype), wq, tiles(g, cfg.grad_dtype)  # each fp8 -> f32 (dequantized)

    def emulated_gemm(self, x, w, *, key, prec):

        return blockwise_dot(x, w, impl="xla")  # f32 operands: the f32 result


class _BlockScaled(MatmulFormat):
    """A block format of NVIDIA's Blackwell GPUs (:func:`lpt.fp8.block_scaled_dot`): "mxfp8" (e4m3 in 1×32 blocks,
    e8m0 scales) or "nvfp4" (e2m1 in 1×16 blocks and 16×16 weight tiles, e4m3 scales and an f32 tensor scale, with
    the random Hadamard transform of dW's inputs and stochastic rounding of the gradients, ``prec``'s switches).

    Its probe records, per projection ``<projection>``, with x and w blocked as the forward GEMM blocks them
    (:func:`lpt.fp8.microscaling.gemm_block_health`): ``<name>/<projection>/x_scale_saturated_frac`` (blocks whose
    scale lies above the scale format's largest: e8m0 for MXFP8, e4m3 after the f32 tensor scale for NVFP4; inf /
    NaN blocks included), ``<name>/<projection>/x_scale_underflow_frac`` (non-zero blocks whose scale falls below the
    scale format's smallest normal: clamped at 2^-127, or an e4m3 subnormal or zero),
    ``<name>/<projection>/x_clipped_frac`` (blocks whose maximum saturates at the element format's max: MXFP8's floor
    rule clips about one block in seven), the same three for ``w``, each over all blocks of the projection; and
    ``fp8/<projection>/snr_db`` against the compute-dtype GEMM as for "fp8".
    """

    def __init__(self, name: str):
        self.name = name

    def _switches(self, prec) -> dict:
        """``block_scaled_dot``'s hadamard and stochastic_grads: NVFP4's from ``prec``, else the recipe's
        defaults."""
        if self.name != "nvfp4" or prec is None:
            return {}
        return dict(hadamard=prec.nvfp4_hadamard, stochastic_grads=prec.nvfp4_stochastic_grads)

    def gemm(self, x, w, *, w_axes, key, path, prec):

        key = None if key is None else layer_key(key, path)
        return block_scaled_dot(x.astype(jnp.float32), w, self.name, key=key, **self._switches(prec))  # -> f32 (exact)

    def block(self, numerics):

        return BLOCKS[self.name]

    def probe(self, name, x, w, y_f32):

        c = probes.current()
        for operand, h in zip(("x", "w"), gemm_block_health(x, w, self.name), strict=True):  # int32 counts
            c.add(f"{self.name}/{name}/{operand}_scale_saturated_frac", probes.RATIO, h.saturated, h.blocks)
            c.add(f"{self.name}/{name}/{operand}_scale_underflow_frac", probes.RATIO, h.underflow, h.blocks)
            c.add(f"{self.name}/{name}/{operand}_clipped_frac", probes.RATIO, h.clipped, h.blocks)
        _record_snr(c, name, x, w, y_f32)

    def quantized_operands(self, x, w, g, *, key, prec):

        # the dX GEMM rounds g stochastically with fold_in(key, 1) (lpt.fp8.microscaling.dot's dgrad key)
        sr = block_scaled_config(self.name, **self._switches(prec)).stochastic_grads
        sr_g = dict(rounding="stochastic", key=jax.random.fold_in(key, 1)) if sr else {}
        layout = lambda operand: operand_layout(self.name, operand)
        return (
            quantize_dequantize(x, self.name, **layout("x")),  # -> f32
            quantize_dequantize(w, self.name, **layout("w")),  # -> f32
            quantize_dequantize(g, self.name, **layout("g"), **sr_g),  # -> f32
        )

    def emulated_gemm(self, x, w, *, key, prec):

        return block_scaled_dot(x, w, self.name, key=key, impl="xla", **self._switches(prec))  # x's dtype (f32)

    def block_health(self, x, w, g):

        return (*gemm_block_health(x, w, self.name), block_scale_health(g, self.name, **operand_layout(self.name, "g")))


def _record_snr(c: probes.Collector, name: str, x, w, y_f32) -> None:
    """``fp8/<name>/snr_db``: ``y_f32`` against the compute-dtype GEMM with f32 accumulation ("bf16")."""
    y_ref = jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)
    c.add(f"fp8/{name}/snr_db", probes.DB, jnp.sum(y_ref * y_ref), jnp.sum(jnp.square(y_f32 - y_ref)))


_REGISTRY: dict[str, MatmulFormat] = {}
_BUILTIN = ("bf16", "fp8", "mxfp8", "nvfp4")


def names() -> tuple[str, ...]:
    """The registered formats' names, in registration order."""
    return tuple(_REGISTRY)


NAMES = LiveChoices(names)  # the allowed values of precision.matmul.<projection>: every format registered at the time


def get(name: str) -> MatmulFormat:
    """The format registered as ``name``; ValueError naming it and the registered ones otherwise."""
    fmt = _REGISTRY.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ValueError(f"matmul format {name!r} is not registered; allowed: {', '.join(_REGISTRY)}")
    return fmt


def register(fmt: MatmulFormat) -> MatmulFormat:
    """Register ``fmt`` under ``fmt.name`` (returned, so a module can write ``FORMAT = register(MyFormat())``);
    ValueError for a name that is empty, not an identifier or already registered."""
    if not isinstance(fmt, MatmulFormat):
        raise ValueError(f"register takes a MatmulFormat instance, got {fmt!r}")
    if not isinstance(fmt.name, str) or not fmt.name.isidentifier():
        raise ValueError(f"matmul format name {fmt.name!r} must be an identifier (it is a config value)")
    if fmt.name in _REGISTRY:
        raise ValueError(
            f"matmul format {fmt.name!r} is already registered ({type(_REGISTRY[fmt.name]).__qualname__}); "
            "unregister it first"
        )
    _REGISTRY[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    """Remove the format registered as ``name``; ValueError for an unknown name or a built-in format."""
    get(name)
    if name in _BUILTIN:
        raise ValueError(f"matmul format {name!r} is built in; only formats registered later can be unregistered")
    del _REGISTRY[name]


register(_Bf16())
register(_BlockwiseFp8())
register(_BlockScaled("mxfp8"))
register(_BlockScaled("nvfp4"))
