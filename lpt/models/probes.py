"""Activation statistics recorded during a forward pass: the diagnostics pass (off unless inside ``collecting()``).

Mechanism: a trace-time collector. Inside ``with collecting() as c: model(tokens)`` the layers add statistics to
``c`` (jnp scalars); outside it :func:`active` is False and the layers add no operation at all, so the training
step's jaxpr is exactly what it was without diagnostics (tested). Every statistic is an entry ``(how, a, b)`` that
combines over the layers (and over several matmuls of one kind, e.g. q, k, v) as

* ``RATIO``: ``a`` and ``b`` are summed; reported ``a / b`` (a count over a count, or a per-layer fraction over 1);
* ``DB``: ``a`` (signal energy) and ``b`` (noise energy) are summed; reported ``10 log10(a / b)``;
* ``MAX``: ``a`` is maxed; reported ``a``.

Inside ``nnx.scan`` (``config.model.scan_layers``) each layer collects into its own collector whose raw entries are
scan outputs; :meth:`Collector.add_stacked` reduces them over the layer axis (no tracer leaves the scan).

What the layers record (names without the trainer's ``model/`` prefix):

* every "fp8" matmul of layer kind ``<kind>`` (:func:`record_fp8`), quantized exactly as ``lpt.fp8.blockwise_dot``
  does (e4m3, 1×128 tiles of x along K, 128×128 blocks of w, f32 amax scales):
  ``fp8/<kind>/x_underflow_frac`` (nonzero entries flushed to 0 / all entries), ``fp8/<kind>/x_subnormal_frac``
  (nonzero entries whose scaled value ``|x / s|`` lands below e4m3's smallest normal 2⁻⁶, flushed ones included,
  / all entries: they keep fewer than 3 mantissa bits), ``fp8/<kind>/w_underflow_frac``,
  ``fp8/<kind>/w_subnormal_frac`` (same for the weight), ``fp8/<kind>/x_scale_range_log2`` (max over the layers
  of ``log2(max tile scale / min nonzero tile scale)``: the dynamic range that per-tile scaling absorbs and one
  per-tensor scale would not) and
  ``fp8/<kind>/snr_db`` (``10 log10(Σ y_ref² / Σ (y_fp8 − y_ref)²)`` with ``y_ref`` the same GEMM on the
  compute-dtype operands with f32 accumulation, i.e. what the "bf16" matmul computes).
  Saturation is not reported: with amax scaling the largest entry of every tile maps to ±448 exactly, so clipping
  cannot happen (only f32 round-off of ``amax / (amax / 448)``, which rounds back to 448).
* every "mxfp8" or "nvfp4" matmul of layer kind ``<kind>`` (:func:`record_block_scaled`), its operands blocked as
  ``lpt.fp8.block_scaled_dot``'s forward GEMM blocks them (:func:`lpt.fp8.block_diagnostics.gemm_block_health`),
  with ``<recipe>`` the matmul's format: ``<recipe>/<kind>/x_scale_saturated_frac`` (blocks whose scale lies above
  the scale format's largest: e8m0 for MXFP8, e4m3 after the f32 tensor scale for NVFP4; inf / NaN blocks
  included), ``<recipe>/<kind>/x_scale_underflow_frac`` (non-zero blocks whose scale falls below the scale
  format's smallest normal: clamped at 2^-127, or an e4m3 subnormal or zero), ``<recipe>/<kind>/x_clipped_frac``
  (blocks whose maximum saturates at the element format's max: MXFP8's floor rule clips about one block in seven),
  the same three for ``w``, each over all blocks of the kind; and ``fp8/<kind>/snr_db`` against the compute-dtype
  GEMM as for "fp8".
* every attention layer (:func:`record_attention`): ``attn/repeated_max_frac`` (mean over layers) and
  ``attn/repeated_max_frac_max`` (max over layers) of :func:`lpt.attention.repeated_max_fraction` — the fraction of
  causal query rows whose scaled logits hold ≥ 2 entries within 2⁻⁹ of the row max, where a bf16 ``exp(s − m)``
  gives several exact 1s (Qiu & Yao's trigger). The logits matrix is materialised here (the flash path never does),
  for the first ``n`` sequences of the batch with ``n · H · T² ≤ ATTENTION_LOGITS_BUDGET`` (at least one).
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp

import lpt.attention

RATIO, DB, MAX = "ratio", "db", "max"
ATTENTION_LOGITS_BUDGET = 2**26  # f32 logits materialised per attention layer by the repeated-max probe (256 MiB)

_local = threading.local()


class Collector:
    """Named statistics ``name -> (how, a, b)``; entries with the same name combine by ``how`` (module docstring)."""

    def __init__(self):
        self.entries: dict[str, tuple[str, jax.Array, jax.Array]] = {}

    def add(self, name: str, how: str, a, b=1.0) -> None:
        if how not in (RATIO, DB, MAX):
            raise ValueError(f"statistic {name!r}: how={how!r} is not one of {(RATIO, DB, MAX)}")
        a = jnp.asarray(a).astype(jnp.float32)  # count / fraction / energy -> f32
        b = jnp.asarray(b).astype(jnp.float32)  # -> f32
        if name in self.entries:
            how0, a0, b0 = self.entries[name]
            if how0 != how:
                raise ValueError(f"statistic {name!r} recorded as {how0!r} and as {how!r}")
            a, b = (jnp.maximum(a0, a), b0) if how == MAX else (a0 + a, b0 + b)
        self.entries[name] = (how, a, b)

    def raw(self) -> tuple[dict[str, str], dict[str, tuple[jax.Array, jax.Array]]]:
        """(static ``name -> how``, array pytree ``name -> (a, b)``): what a scan body returns."""
        return {k: v[0] for k, v in self.entries.items()}, {k: (v[1], v[2]) for k, v in self.entries.items()}

    def add_stacked(self, hows: dict[str, str], stacked: dict[str, tuple[jax.Array, jax.Array]]) -> None:
        """Add raw entries that carry a leading layer axis (scan outputs), reduced over that axis."""
        for name, (a, b) in stacked.items():
            if hows[name] == MAX:
                self.add(name, MAX, jnp.max(a, axis=0))
            else:
                self.add(name, hows[name], jnp.sum(a, axis=0), jnp.sum(b, axis=0))

    def summary(self) -> dict[str, jax.Array]:
        """``name -> f32 scalar`` per the combination rules, sorted by name."""
        out = {}
        for name, (how, a, b) in sorted(self.entries.items()):
            out[name] = a if how == MAX else (a / b if how == RATIO else 10.0 * jnp.log10(a / b))
        return out


def _stack() -> list[Collector]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def collecting():
    """Collect the statistics the layers record while tracing the body; yields the :class:`Collector`."""
    c = Collector()
    _stack().append(c)
    try:
        yield c
    finally:
        _stack().pop()


def active() -> bool:
    """True inside :func:`collecting` (checked at trace time by the layers)."""
    return bool(_stack())


def current() -> Collector:
    if not active():
        raise RuntimeError("no statistics collector is active; use `with lpt.models.probes.collecting():`")
    return _stack()[-1]


def record_fp8(name: str, x: jax.Array, w: jax.Array, y_f32: jax.Array) -> None:
    """Record the statistics of one FP8 GEMM ``y_f32 = blockwise_dot(x, w)`` of layer kind ``name``: the operands
    quantized as the GEMM does (:func:`lpt.fp8.diagnostics.quantize_operands`), their underflow and subnormal
    fractions, the range of the x tile scales, and the SNR against the compute-dtype GEMM."""
    # in-function: lpt.fp8 loads the Mosaic GPU Pallas kernels, which only models with "fp8" matmuls use
    from lpt.fp8 import BlockwiseConfig
    from lpt.fp8.diagnostics import quantize_operands

    c, cfg = current(), BlockwiseConfig()
    x_f32, _, (_, sx, xs), (_, _, ws) = quantize_operands(
        x, w, block=cfg.block, fwd_dtype=cfg.fwd_dtype, scale_format=cfg.scale_format
    )
    for operand, st in (("x", xs), ("w", ws)):  # int32 counts (Collector.add takes them to f32)
        c.add(f"fp8/{name}/{operand}_underflow_frac", RATIO, st.underflowed, st.total)
        c.add(f"fp8/{name}/{operand}_subnormal_frac", RATIO, st.subnormal, st.total)
    amax_pos = jnp.max(jnp.abs(x_f32).reshape(sx.shape + (cfg.block,)), axis=-1) > 0
    lo = jnp.min(jnp.where(amax_pos, sx, jnp.inf))
    hi = jnp.max(jnp.where(amax_pos, sx, 0.0))
    c.add(f"fp8/{name}/x_scale_range_log2", MAX, jnp.where(hi > 0, jnp.log2(hi / lo), 0.0))
    y_ref = jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)
    c.add(f"fp8/{name}/snr_db", DB, jnp.sum(y_ref * y_ref), jnp.sum(jnp.square(y_f32 - y_ref)))


def record_block_scaled(name: str, recipe: str, x: jax.Array, w: jax.Array, y_f32: jax.Array) -> None:
    """Record the statistics of one block-scaled GEMM ``y_f32 = block_scaled_dot(x, w, recipe)`` of layer kind
    ``name``: the block-scale health of x and w as its forward GEMM blocks them, and the SNR against the
    compute-dtype GEMM."""
    from lpt.fp8.block_diagnostics import gemm_block_health  # in-function: as record_fp8

    c = current()
    for operand, h in zip(("x", "w"), gemm_block_health(x, w, recipe), strict=True):  # int32 counts of h.blocks
        c.add(f"{recipe}/{name}/{operand}_scale_saturated_frac", RATIO, h.saturated, h.blocks)
        c.add(f"{recipe}/{name}/{operand}_scale_underflow_frac", RATIO, h.underflow, h.blocks)
        c.add(f"{recipe}/{name}/{operand}_clipped_frac", RATIO, h.clipped, h.blocks)
    y_ref = jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)
    c.add(f"fp8/{name}/snr_db", DB, jnp.sum(y_ref * y_ref), jnp.sum(jnp.square(y_f32 - y_ref)))


def record_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, sliding_window: int = 0) -> None:
    """Record the causal repeated-max fraction of one attention layer (GQA: k has K ≤ H heads; the logits the
    layer's ``sliding_window`` leaves visible)."""
    B, T, H, _ = q_BTHD.shape
    n = max(1, min(B, ATTENTION_LOGITS_BUDGET // (H * T * T)))
    frac = lpt.attention.repeated_max_fraction(  # GQA-aware, over n·H·T rows
        q_BTHD[:n], k_BTKD[:n], causal=True, sliding_window=sliding_window
    )
    c = current()
    c.add("attn/repeated_max_frac", RATIO, frac, 1.0)
    c.add("attn/repeated_max_frac_max", MAX, frac)
