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

* every matmul whose format records statistics: its :meth:`~lpt.models.matmul_formats.MatmulFormat.probe`, called
  by :func:`lpt.models.layers.matmul` with the layer kind as the name ("fp8": ``fp8/<kind>/*``, "mxfp8" and
  "nvfp4": ``<format>/<kind>/*`` and ``fp8/<kind>/snr_db``; each format's docstring in
  :mod:`lpt.models.matmul_formats` lists its statistics);
* every attention layer (:func:`record_attention`): ``attn/repeated_max_frac`` (mean over layers) and
  ``attn/repeated_max_frac_max`` (max over layers) of :func:`lpt.attention.repeated_max_fraction` — the fraction of
  causal query rows whose scaled logits hold ≥ 2 entries within 2⁻⁹ of the row max, where a bf16 ``exp(s − m)``
  gives several exact 1s (Qiu & Yao's trigger). The logits matrix is materialised here (the flash path never does),
  for the first ``n`` sequences of the batch with ``n · H · T² ≤ _ATTENTION_LOGITS_BUDGET`` (at least one).
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp

import lpt.attention

RATIO, DB, MAX = "ratio", "db", "max"
_ATTENTION_LOGITS_BUDGET = 2**26  # f32 logits materialised per attention layer by the repeated-max probe (256 MiB)

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


def record_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, sliding_window: int = 0) -> None:
    """Record the causal repeated-max fraction of one attention layer (GQA: k has K ≤ H heads; the logits the
    layer's ``sliding_window`` leaves visible)."""
    B, T, H, _ = q_BTHD.shape
    n = max(1, min(B, _ATTENTION_LOGITS_BUDGET // (H * T * T)))
    frac = lpt.attention.repeated_max_fraction(  # GQA-aware, over n·H·T rows
        q_BTHD[:n], k_BTKD[:n], causal=True, sliding_window=sliding_window
    )
    c = current()
    c.add("attn/repeated_max_frac", RATIO, frac, 1.0)
    c.add("attn/repeated_max_frac_max", MAX, frac)
