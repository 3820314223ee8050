"""Building blocks: parameters with logical axes, the weight view, Linear, Embed, RMSNorm, LayerNorm, RoPE.

Precision in every layer (see :mod:`lpt.models.config`):

* a stored weight ``w`` (float32 master, or ``param_dtype`` itself) is viewed as
  ``w_view = RNE_{param_dtype}(w)`` with a straight-through gradient (identity when already stored in
  ``param_dtype``), then cast exactly or by RNE to ``compute_dtype``;
* matmuls take compute-dtype operands and accumulate in float32 (``preferred_element_type=float32``); the result is
  cast to the compute dtype (float32 for the LM head);
* norm statistics (mean, variance) are always float32.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import jax
import jax.numpy as jnp
from flax import nnx

from lpt import numerics
from lpt.fp8.blockwise import gemm_weight
from lpt.models import matmul_formats, pqt_wiring, probes
from lpt.models.config import ModelSpec, Precision


def _make_param(key: jax.Array | None, shape, std: float, axes: tuple, store_dtype, *, const: float | None = None):
    """An ``nnx.Param`` of ``shape`` with logical ``axes``: N(0, std²) drawn in float32 (or a constant), stored by RNE.

    ``store_dtype`` float32 keeps the draw as is; a narrower dtype rounds it to nearest even (fp8 saturates). The
    init recipe is kept as metadata (``init_std`` or ``init_const``) so that :func:`init_state` can redraw every
    parameter from one flat normal draw (see there).

    Args:
      key: PRNG key of the normal draw; None with ``const``.
      shape: the parameter's shape.
      std: standard deviation of the draw.
      axes: logical axis names, one per dim of ``shape``.
      store_dtype: the storage dtype.
      const: fill with this constant instead of drawing.
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match parameter shape {shape}")
    if const is None:
        w_f32 = std * jax.random.normal(key, shape, jnp.float32)
        meta = {"init_std": float(std)}
    else:
        w_f32 = jnp.full(shape, const, jnp.float32)
        meta = {"init_const": float(const)}
    w = w_f32 if store_dtype == jnp.float32 else numerics.round_nearest(w_f32, store_dtype)  # f32 -> storage
    return nnx.Param(w, out_sharding=tuple(axes), eager_sharding=False, **meta)


def init_state(abstract_state, key: jax.Array):
    """Concrete parameters for an abstract ``nnx.State`` (from ``nnx.eval_shape``), all from ONE normal draw.

    Parameters with ``init_std`` metadata take consecutive slices (in the state's flattening order) of
    ``z ~ N(0, I)`` of their total size, times their std; ``init_const`` ones are constant; then RNE into their
    storage dtype. One draw instead of one per parameter keeps the init program small (one threefry draw to compile,
    not one per parameter; compile times in docs/results.md). Every variable must carry one of the two
    metadata keys (PQT bitwidths have ``init_const=1``); a variable without them raises ValueError.
    """
    is_var = lambda x: isinstance(x, nnx.Variable)
    leaves, treedef = jax.tree.flatten(abstract_state, is_leaf=is_var)
    sizes = [math.prod(v.shape) if "init_std" in v.get_metadata() else 0 for v in leaves]
    z_f32 = jax.random.normal(key, (max(sum(sizes), 1),), jnp.float32)
    out, offset = [], 0
    for v, n in zip(leaves, sizes, strict=True):
        meta = v.get_metadata()
        if "init_std" in meta:
            w_f32 = meta["init_std"] * z_f32[offset : offset + n].reshape(v.shape)
            offset += n
        elif "init_const" in meta:
            w_f32 = jnp.full(v.shape, meta["init_const"], jnp.float32)
        else:
            raise ValueError(f"variable {v!r} has neither init_std nor init_const metadata")
        dtype = jnp.dtype(v.dtype)
        w = w_f32 if dtype == jnp.float32 else numerics.round_nearest(w_f32, dtype)  # f32 -> storage by RNE
        out.append(v.replace(w))
    return jax.tree.unflatten(treedef, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def round_ste(w: jax.Array, dtype) -> jax.Array:
    """RNE of ``w`` into ``dtype`` (via :func:`lpt.numerics.round_nearest`, jit-safe) with a straight-through
    gradient: d/dw = identity, cast back to ``w.dtype``."""
    return numerics.round_nearest(w.astype(jnp.float32), dtype)  # w -> f32 (exact widening) -> dtype by RNE


def _round_ste_fwd(w, dtype):
    return round_ste(w, dtype), jnp.zeros((), w.dtype)


def _round_ste_bwd(dtype, res, g):
    return (g.astype(res.dtype),)  # cotangent in dtype -> cotangent in w's dtype


round_ste.defvjp(_round_ste_fwd, _round_ste_bwd)


def _exact_cast(src, dst) -> bool:
    src, dst = jnp.dtype(src), jnp.dtype(dst)
    if dst == jnp.float32:
        return True
    return dst == jnp.bfloat16 and src in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def view_weight(w: jax.Array, prec: Precision, dtype=None) -> jax.Array:
    """The weight as a layer uses it: storage -> ``param_dtype`` (RNE, straight-through) -> ``dtype``.

    ``dtype`` defaults to the compute dtype; float32 norms pass ``jnp.float32``. Casts that cannot be exact
    (f32 or f16 -> bf16) go through :func:`round_ste`, never through an ``astype`` that XLA might elide.
    """
    dtype = prec.compute if dtype is None else dtype
    if w.dtype != prec.view_dtype:
        w = round_ste(w, prec.view_dtype)  # f32 master -> param_dtype grid
    if w.dtype == dtype:
        return w
    if _exact_cast(w.dtype, dtype):
        return w.astype(dtype)  # widening (fp8/bf16/f16 -> f32, fp8 -> bf16): exact
    return round_ste(w, dtype)  # f32/f16 -> bf16 by RNE


_BLOCK = threading.local()  # (index, n_layers) of the transformer block being traced, or None


@contextlib.contextmanager
def in_block(index, n_layers: int):
    """Within it, :func:`matmul` traces for block ``index`` (a Python int, or a traced int32 inside a scan over the
    blocks) of an ``n_layers``-block model: the blocks of ``precision.bf16_layers`` run their low-precision matmuls
    as "bf16"."""
    outer = getattr(_BLOCK, "value", None)
    _BLOCK.value = (index, n_layers)
    try:
        yield
    finally:
        _BLOCK.value = outer


def matmul(
    x: jax.Array,
    w: jax.Array,
    format_name: str,
    out_dtype,
    *,
    name: str = "matmul",
    w_axes: tuple | None = None,
    key: jax.Array | None = None,
    path: str = "",
    prec: Precision | None = None,
) -> jax.Array:
    """``x[..., K] @ w[K, N]`` with the matmul format ``format_name`` (:func:`lpt.models.matmul_formats.get`): its
    GEMM's float32 accumulator, rounded once to ``out_dtype``.

    In a block of ``prec.bf16_layers`` (:func:`in_block`) a low-precision ``format_name`` runs as "bf16": decided at
    trace time for a Python index, by ``lax.cond`` on a scanned one (only the chosen branch runs); a diagnostics pass
    computes both and selects, so that the low-precision statistics are recorded outside the cond.

    ``w_axes`` (the weight's logical axes) tells the FP8 kernels how to split ``w`` under a mesh; ``key`` (the step
    key, None in evaluation), ``path`` (the layer path) and ``prec`` go to the format's GEMM
    (:meth:`lpt.models.matmul_formats.MatmulFormat.gemm`). ``name`` (the projection, e.g. "qkv") labels the
    statistics the format records in a diagnostics pass (:mod:`lpt.models.probes`); outside one nothing is recorded
    and no operation is added.

    Args:
      x: ``[..., K]`` in the compute dtype.
      w: ``[K, N]``, the weight's compute-dtype view (or an :class:`lpt.fp8.blockwise.GemmWeight` for "fp8").
      format_name: a registered matmul format (:func:`lpt.models.matmul_formats.names`).
      out_dtype: dtype of the result.
      name: the projection, labelling the diagnostics statistics.
      w_axes: the weight's logical axes; None: replicated.
      key: the step key; None in evaluation.
      path: the layer path.
      prec: the model's :class:`lpt.models.config.Precision` (``bf16_layers``, the format's switches); None: the
        format's defaults, and no ``bf16_layers``.
    """
    kw = dict(name=name, w_axes=w_axes, key=key, path=path, prec=prec)
    block = getattr(_BLOCK, "value", None)
    if not matmul_formats.get(format_name).low_precision or prec is None or not prec.bf16_layers or block is None:
        return _matmul(x, w, format_name, out_dtype, **kw)
    index, n_layers = block
    chosen = prec.bf16_blocks(n_layers)
    plain = lambda x, w: _matmul(x, getattr(w, "w", w), "bf16", out_dtype, **kw)  # a GemmWeight's weight, or w
    low = lambda x, w: _matmul(x, w, format_name, out_dtype, **kw)
    if isinstance(index, int):
        return plain(x, w) if index in chosen else low(x, w)
    keep = jnp.isin(index, jnp.asarray(chosen, jnp.int32))
    if probes.active():
        return jnp.where(keep, plain(x, w), low(x, w))
    return jax.lax.cond(keep, plain, low, x, w)


def _matmul(x, w, format_name: str, out_dtype, *, name, w_axes, key, path, prec) -> jax.Array:
    fmt = matmul_formats.get(format_name)
    y_f32 = fmt.gemm(x, w, w_axes=w_axes, key=key, path=path, prec=prec)
    if y_f32.dtype != jnp.float32:
        raise TypeError(
            f"matmul format {format_name!r} returned {y_f32.dtype}; a format's gemm returns the f32 accumulator"
        )
    if probes.active():  # diagnostics pass only (trace-time switch)
        fmt.probe(name, x, w, y_f32)
    return y_f32.astype(out_dtype)  # f32 accumulator -> out dtype (RNE)


class Linear(nnx.Module):
    """``y = x @ W (+ b)`` for one projection ("qkv", "out", "up", "down", "lm_head").

    ``path`` (e.g. "blocks/3/mlp/down") names the layer; PQT layers fold it into the step key, so their noise
    depends on (seed, step, layer path) only.

    Args:
      d_in, d_out: the kernel's shape ``[d_in, d_out]``.
      axes: logical axes of the kernel (the bias takes ``axes[1:]``).
      projection: "qkv", "out", "up", "down" or "lm_head": picks the matmul format and the PQT method from ``prec``
        ("lm_head" has no PQT).
      std: init standard deviation of the kernel.
      prec: the model's :class:`lpt.models.config.Precision` (storage dtype, compute dtype, formats).
      path: the layer path.
      use_bias: add a bias (zeros at init).
      rngs: ``nnx.Rngs`` for the init draw.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        axes: tuple,
        projection: str,
        std: float,
        prec: Precision,
        path: str,
        use_bias: bool = False,
        rngs: nnx.Rngs,
    ):
        self.projection, self.prec, self.path, self.axes = projection, prec, path, tuple(axes)
        self.pqt_method = prec.pqt_for(projection) if projection != "lm_head" else "none"
        self.kernel = _make_param(rngs.params(), (d_in, d_out), std, axes, prec.store_dtype)
        self.bias = _make_param(None, (d_out,), 0.0, axes[1:], prec.store_dtype, const=0.0) if use_bias else None
        self.bitwidth = None if self.pqt_method == "none" else pqt_wiring.make_bitwidth((d_in, d_out), prec)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None, out_dtype=None) -> jax.Array:
        out_dtype = self.prec.compute if out_dtype is None else out_dtype
        kernel = self.kernel.get_value()
        # a tuple: an lpt.fp8.blockwise.GemmWeight whose FP8 codes the train step made once for all microbatches
        prepared = kernel if isinstance(kernel, tuple) else None
        stored = kernel if prepared is None else prepared.w
        if self.bitwidth is not None and key is not None:
            # storage -> param_dtype view, then ŵ = w + PQN in the compute dtype (Ahn & Yoo Eq. 3)
            w_view = view_weight(stored, self.prec, self.prec.view_dtype)
            w = pqt_wiring.sample(w_view, self.bitwidth, key, method=self.pqt_method, path=self.path, prec=self.prec)
        else:
            w = view_weight(stored, self.prec)
        if prepared is not None:
            w = prepared._replace(w=w)  # the codes as made, the gradient to the weight's view
        format_name = self.prec.matmul_for(self.projection)
        y = matmul(
            x,
            w,
            format_name,
            out_dtype,
            name=self.projection,
            w_axes=self.axes,
            key=key,
            path=self.path,
            prec=self.prec,
        )
        if self.bias is not None:
            y = y + view_weight(self.bias[...], self.prec, out_dtype)
        return y


def fp8_linears(model: nnx.Module) -> list[tuple[tuple, Linear]]:
    """``(path, layer)`` of each :class:`Linear` of ``model`` whose matmul is "fp8" (blockwise FP8), the path as
    ``nnx.iter_graph`` gives it (its kernel is ``path + ("kernel",)`` in the params)."""
    return [
        (tuple(path), m)
        for path, m in nnx.iter_graph(model)
        if isinstance(m, Linear) and m.prec.matmul_for(m.projection) == "fp8"
    ]


def fp8_gemm_weights(model: nnx.Module, params: dict) -> dict:
    """``{path: GemmWeight}`` for each layer of :func:`fp8_linears`: its kernel in ``params`` (a pure dict of the
    model's params, stacked layers included) viewed as the layer views it, quantized and moved to the GEMM's layout
    once (:func:`lpt.fp8.blockwise.gemm_weight`); :func:`with_gemm_weights` puts them in place of the kernels. A
    layer that samples weight noise (PQT) is a ValueError: its weight changes with every key."""

    out = {}
    for path, layer in fp8_linears(model):
        if layer.bitwidth is not None:
            raise ValueError(f"optim.fp8_gather='step': layer {layer.path} samples weight noise (PQT) every key")
        kernel = functools.reduce(lambda d, k: d[k], path, params)["kernel"]
        out[path] = gemm_weight(view_weight(kernel, layer.prec), w_axes=layer.axes)
    return out


def with_gemm_weights(params: dict, prepared: dict) -> dict:
    """``params`` (a pure dict) with each prepared layer's kernel replaced by its :class:`~lpt.fp8.blockwise.GemmWeight`
    (the kernel itself as its ``w``, so that the gradient reaches it)."""
    out = jax.tree.map(lambda a: a, params)  # a fresh dict tree
    for path, gw in prepared.items():
        layer = functools.reduce(lambda d, k: d[k], path, out)
        layer["kernel"] = gw._replace(w=layer["kernel"])
    return out


def block_linears(spec: ModelSpec, prec: Precision, *, path: str, rngs: nnx.Rngs):
    """The maker of one block's projections: ``make(d_in, d_out, axes, projection, name, residual=False,
    bias=False)`` is the :class:`Linear` at layer path ``f"{path}/{name}"``, with a bias for GPT-2 or when ``bias``
    (Qwen2's q, k, v), init std ``spec.init_std``, or ``init_std / sqrt(2 n_layers)`` for a ``residual`` projection
    (one that writes the residual stream: "out" and "down", as GPT-2)."""
    std, residual_std = spec.init_std, spec.init_std / math.sqrt(2 * spec.n_layers)

    def make(
        d_in: int, d_out: int, axes: tuple, projection: str, name: str, *, residual: bool = False, bias: bool = False
    ) -> Linear:
        return Linear(
            d_in,
            d_out,
            axes=axes,
            projection=projection,
            std=residual_std if residual else std,
            prec=prec,
            path=f"{path}/{name}",
            use_bias=bias or spec.kind == "gpt2",
            rngs=rngs,
        )

    return make


class Embed(nnx.Module):
    """Token (or position) embedding table ``E[V, D]``; lookup returns compute-dtype rows.

    Args:
      num, dim: the table's shape ``[num, dim]``.
      axes: logical axes of the table.
      std: init standard deviation.
      prec: the model's :class:`lpt.models.config.Precision` (storage and compute dtypes).
      rngs: ``nnx.Rngs`` for the init draw.
    """

    def __init__(self, num: int, dim: int, *, axes: tuple, std: float, prec: Precision, rngs: nnx.Rngs):
        self.prec = prec
        self.embedding = _make_param(rngs.params(), (num, dim), std, axes, prec.store_dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return view_weight(self.embedding[...], self.prec)[ids]


class RMSNorm(nnx.Module):
    """``y = x / sqrt(mean(x²) + eps) * g`` over the last axis, with the statistics in float32. ``axes``: the
    logical axis of ``g`` ("embed" for the residual stream, "head_dim" for Qwen3's per-head q / k norms)."""

    def __init__(self, dim: int, *, eps: float, prec: Precision, axes: tuple = ("embed",)):
        self.prec = prec
        self.eps = eps
        self.scale = _make_param(None, (dim,), 0.0, axes, prec.store_dtype, const=1.0)

    def __call__(self, x: jax.Array) -> jax.Array:
        x_f32 = x.astype(jnp.float32)  # compute -> f32 statistics
        ms = jnp.mean(jnp.square(x_f32), axis=-1, keepdims=True)
        y_f32 = x_f32 * jax.lax.rsqrt(ms + self.eps) * view_weight(self.scale[...], self.prec, jnp.float32)
        return y_f32.astype(self.prec.compute)  # f32 -> compute


class LayerNorm(nnx.Module):
    """``y = (x - mean) / sqrt(var + eps) * g + b`` with the statistics in float32."""

    def __init__(self, dim: int, *, eps: float, prec: Precision):
        self.prec = prec
        self.eps = eps
        self.scale = _make_param(None, (dim,), 0.0, ("embed",), prec.store_dtype, const=1.0)
        self.bias = _make_param(None, (dim,), 0.0, ("embed",), prec.store_dtype, const=0.0)

    def __call__(self, x: jax.Array) -> jax.Array:
        x_f32 = x.astype(jnp.float32)  # compute -> f32 statistics
        mean = jnp.mean(x_f32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x_f32 - mean), axis=-1, keepdims=True)
        y_f32 = (x_f32 - mean) * jax.lax.rsqrt(var + self.eps)
        y_f32 = y_f32 * view_weight(self.scale[...], self.prec, jnp.float32) + view_weight(
            self.bias[...], self.prec, jnp.float32
        )
        return y_f32.astype(self.prec.compute)  # f32 -> compute


def rope_inv_freq(head_dim: int, theta: float, scaling) -> jax.Array:
    """RoPE inverse frequencies ``f_i = theta^(-2i/D)``, i < D/2, float32, rescaled by ``scaling``
    (a :class:`lpt.models.config.RopeScaling`):

    * "none": ``f_i``;
    * "linear" (position interpolation): ``f_i / factor``;
    * "llama3" (Llama 3.1): with wavelength ``λ_i = 2π / f_i``, ``L = original_max_len``,
      ``f_i`` if ``λ_i < L / high_freq_factor``; ``f_i / factor`` if ``λ_i > L / low_freq_factor``; in between
      ``(1 − s) f_i / factor + s f_i`` with ``s = (L / λ_i − low_freq_factor) / (high_freq_factor − low_freq_factor)``.
    """
    inv_freq = theta ** (-jnp.arange(0, head_dim // 2, dtype=jnp.float32) * 2.0 / head_dim)
    if scaling.type == "none":
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    if scaling.type == "llama3":
        wavelen = 2.0 * math.pi / inv_freq
        low_wavelen = scaling.original_max_len / scaling.low_freq_factor
        high_wavelen = scaling.original_max_len / scaling.high_freq_factor
        smooth = (scaling.original_max_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        mid = (1.0 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        return jnp.where(
            wavelen < high_wavelen, inv_freq, jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, mid)
        )
    raise ValueError(f"rope scaling type {scaling.type!r} is not supported; allowed: ['none', 'linear', 'llama3']")


def rope(x_BTHD: jax.Array, inv_freq: jax.Array, positions_BT: jax.Array | None = None) -> jax.Array:
    """Rotary embedding (Llama's rotate-half form), angles and rotation in float32.

    For position t and pair i < D/2: ``(x_i, x_{i+D/2}) -> (x_i cos a - x_{i+D/2} sin a, x_{i+D/2} cos a + x_i sin a)``
    with ``a = t · inv_freq_i`` (:func:`rope_inv_freq`). ``positions_BT`` (int) defaults to ``0 … T−1`` in every row;
    decoding with a KV cache passes each row's absolute positions.
    """
    B, T, _, D = x_BTHD.shape
    if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    ang_BTD = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # int -> f32 (exact below 2^24)
    cos, sin = jnp.cos(ang_BTD)[:, :, None, :], jnp.sin(ang_BTD)[:, :, None, :]
    x_f32 = x_BTHD.astype(jnp.float32)  # compute -> f32
    x1, x2 = x_f32[..., : D // 2], x_f32[..., D // 2 :]
    y_f32 = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return y_f32.astype(x_BTHD.dtype)  # f32 -> compute
