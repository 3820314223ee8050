"""Kahan-compensated weight updates (Zamirai et al., Algorithm 1) as an optax transform that goes last in a chain."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpt.numerics import round_nearest
from lpt.optim.leaves import (
    UpdateDiagnostics,
    empty_diagnostics,
    map_leaves,
    needs_rounding,
    rounded_leaves,
    zeros_like_rounded,
)


class KahanSummationState(NamedTuple):
    """``compensation`` mirrors the params tree (a scalar placeholder for f32 leaves); ``diagnostics`` is None
    unless the transform was built with ``diagnostics=True``."""

    compensation: Any
    diagnostics: UpdateDiagnostics | None


def kahan_step(p, u32, c, compensation_dtype=None):
    """One compensated update of a low-precision leaf; returns ``(new_p_f32, new_c)``.

    With ``c`` the rounding excess carried from earlier steps (``applied - intended``)::

        y     = u - c,  t = p + y           (f32)
        s     = Q_p(t)                      (rounded to nearest in p's dtype, exactly, even under jit)
        c_new = Q_c(s - t)                  (s - t is exact in f32; Q_c rounds into the compensation dtype)

    ``s - t`` equals the paper's ``(s - p) - y`` up to the f32 rounding of ``p + y`` (2^-24 relative to p), far
    below the compensation's own resolution (a bf16 c resolves 2^-9 of |c| <= ulp(p)/2, about 2^-17 of p).
    Writing it through ``t`` lets XLA materialize ``t`` once and compute ``s`` and ``c_new`` from it, instead of
    copying the old ``p`` and ``c`` (both outputs alias donated inputs) and recomputing everything twice.

    The arithmetic is f32 and both roundings go through :func:`lpt.numerics.round_nearest`, so XLA's excess
    precision cannot skip them (the paper's all-bf16 arithmetic is the special case Q = bf16 everywhere; f32
    intermediates only make y and the error measurement more exact).
    """
    cdt = c.dtype if compensation_dtype is None else compensation_dtype
    p32 = p.astype(jnp.float32)  # param dtype -> f32 (exact)
    t = p32 + (u32 - c.astype(jnp.float32))  # p + y; compensation dtype -> f32 (exact)
    s32 = round_nearest(t, p.dtype, out_dtype=jnp.float32)
    c_new = round_nearest(s32 - t, cdt)  # f32 -> compensation dtype (RNE)
    return s32, c_new


def kahan_summation(compensation_dtype=None, *, diagnostics: bool = False) -> optax.GradientTransformation:
    """Kahan-compensated application of updates to low-precision params. Put it **last** in an optax chain.

    For each low-precision leaf ``p`` (bf16, f16, float8_e4m3fn, float8_e5m2, float4_e2m1fn) with incoming update
    ``u`` and compensation ``c`` (init 0), it computes ``new_p, c`` by :func:`kahan_step` and emits the update
    ``new_p - p`` in the param's dtype (float32 for 8-bit params); ``optax.apply_updates`` (or ``nnx.Optimizer``)
    then reproduces ``new_p`` bit for bit. Updates
    smaller than half an ulp of ``p`` are not lost: they accumulate in ``c`` until they move ``p``. Anything placed
    before it in the chain (decoupled weight decay, clipping, schedules) is part of ``u`` and so is compensated too.
    f32/f64 leaves pass through unchanged.

    Args:
      compensation_dtype: dtype of the compensation buffer; default (None) the param's own dtype (2 bytes per bf16
        param). ``jnp.bfloat16`` is a sensible choice for float8 params; ``jnp.float32`` makes ``p + c`` an (almost)
        exact f32 master copy.
      diagnostics: keep an :class:`UpdateDiagnostics` of the last step in the state (see
        :func:`lpt.optim.get_diagnostics`).
    """

    def comp_dtype(pdt):
        return pdt if compensation_dtype is None else compensation_dtype

    def init_fn(params):
        return KahanSummationState(
            compensation=zeros_like_rounded(params, comp_dtype),
            diagnostics=empty_diagnostics() if diagnostics else None,
        )

    def update_fn(updates, state, params=None):
        def leaf(_, p, u32, c):
            return kahan_step(p, u32, c, comp_dtype(p.dtype))

        deltas, (comp,), diag = map_leaves(
            "kahan_summation", rounded_leaves(leaf), updates, params, state.compensation, diagnostics=diagnostics
        )
        return deltas, KahanSummationState(compensation=comp, diagnostics=diag)

    return optax.GradientTransformation(init_fn, update_fn)


def compensation_from_f32(params_f32, dtype, compensation_dtype=None):
    """Split f32 (master) params into ``(params in dtype, compensation)`` such that ``p - c`` ≈ the f32 value.

    Use it to start :func:`kahan_summation` from an f32 checkpoint without losing its low bits: put the result in
    ``KahanSummationState(compensation=..., diagnostics=...)`` (or use :func:`lpt.optim.replace_compensation`).
    Leaves that are not floating point are rejected; f32 stays f32 when ``dtype`` is f32.
    """

    def one(w):
        w32 = jnp.asarray(w).astype(jnp.float32)  # master -> f32
        if not needs_rounding(dtype):
            return w32.astype(dtype), jnp.zeros((), jnp.float32)  # pass-through leaf: scalar placeholder
        p32 = round_nearest(w32, dtype, out_dtype=jnp.float32)
        cdt = dtype if compensation_dtype is None else compensation_dtype
        c = round_nearest(p32 - w32, cdt)  # excess of the stored value over the master, f32 -> compensation dtype
        return p32.astype(dtype), c  # f32 -> dtype (exact: on the grid)

    leaves, treedef = jax.tree.flatten(params_f32)
    pairs = [one(w) for w in leaves]
    return treedef.unflatten([a for a, _ in pairs]), treedef.unflatten([c for _, c in pairs])


def to_f32(params, compensation):
    """Merge low-precision params and their Kahan compensation back into f32 values ``p - c``."""

    def one(p, c):
        p32 = jnp.asarray(p).astype(jnp.float32)  # param dtype -> f32
        if jnp.ndim(c) == 0 and jnp.ndim(p) > 0:  # f32 pass-through leaf: scalar placeholder
            return p32
        return p32 - jnp.asarray(c).astype(jnp.float32)  # compensation dtype -> f32

    return jax.tree.map(one, params, compensation)


__all__ = [
    "KahanSummationState",
    "compensation_from_f32",
    "kahan_step",
    "kahan_summation",
    "to_f32",
]
