"""The norm-preserving update (the norm-preserving update note, docs/references.md) as an optax transform that goes
last in a chain.

The norm-preserving update note observes that a tensor's collective properties (the norm of its change) are more
precise than its
elements: when most elements of ``lr·u`` are below half an ulp, nearest rounding zeroes them and the applied change
is far smaller than intended. It searches a per-tensor scale ``alpha`` so that the *applied* change has the intended
norm. The note's code compares the squared norm of the applied change with ``target_lr · ||u||²`` (a squared norm
against an unsquared learning rate); we implement the intent instead: in an optax chain the incoming ``u`` already
contains the learning rate, so the target is ``||Q(p + alpha·u) - p||₂ = ||u||₂``.

The applied norm is monotone non-decreasing in alpha (each element's rounded change is monotone in alpha), so
bisection is sound. We bisect on log2(alpha) in ``[log2(min_scale), log2(max_scale)]`` for a fixed number of
iterations (jit-friendly, ``lax.fori_loop``), keep the best alpha seen (closest applied norm, alpha = 1 included), and
apply it. This fixes the size of the step, not its direction: elements below the rounding threshold still do not
move, larger ones move more than intended (cosine to ``u`` can be ~0.7).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import optax
from jax import lax

from lpt.numerics import round_nearest
from lpt.optim.leaves import UpdateDiagnostics, empty_diagnostics, map_leaves, rounded_leaves


class _NormPreservingState(NamedTuple):
    diagnostics: UpdateDiagnostics | None


def norm_preserving_step(p, u32, *, iterations: int = 24, min_scale: float = 2.0**-4, max_scale: float = 2.0**16):
    """Return ``(new_p_f32, alpha)`` with ``||new_p - p|| ≈ ||u||``, ``new_p = round_nearest(p + alpha·u)``.

    Args:
      p: the low-precision param.
      u32: the f32 update, p's shape.
      iterations: bisection steps on log2(alpha).
      min_scale, max_scale: the range of alpha.
    """
    p32 = p.astype(jnp.float32)  # param dtype -> f32 (exact)
    target = jnp.sqrt(jnp.sum(u32 * u32))

    def applied(log_alpha):
        alpha = jnp.exp2(log_alpha)
        s32 = round_nearest(p32 + alpha * u32, p.dtype, out_dtype=jnp.float32)
        d = s32 - p32
        return jnp.sqrt(jnp.sum(d * d))

    def body(_, carry):
        lo, hi, best, best_err = carry
        mid = 0.5 * (lo + hi)
        norm = applied(mid)
        err = jnp.abs(norm - target)
        better = err < best_err
        best, best_err = jnp.where(better, mid, best), jnp.where(better, err, best_err)
        short = norm < target
        return jnp.where(short, mid, lo), jnp.where(short, hi, mid), best, best_err

    zero = jnp.zeros((), jnp.float32)
    carry = (
        jnp.float32(math.log2(min_scale)),
        jnp.float32(math.log2(max_scale)),
        zero,
        jnp.abs(applied(zero) - target),
    )
    _, _, best, _ = lax.fori_loop(0, iterations, body, carry)
    alpha = jnp.exp2(best)
    return round_nearest(p32 + alpha * u32, p.dtype, out_dtype=jnp.float32), alpha


def norm_preserving_update(
    *,
    iterations: int = 24,
    min_scale: float = 2.0**-4,
    max_scale: float = 2.0**16,
    diagnostics: bool = False,
) -> optax.GradientTransformation:
    """The norm-preserving update of the norm-preserving update note. Put it **last** in an optax chain.

    For each low-precision leaf, finds ``alpha ∈ [min_scale, max_scale]`` by ``iterations`` bisection steps on
    log2(alpha) so that ``||round_nearest(p + alpha·u) - p||₂ ≈ ||u||₂`` and emits that change in the param's
    dtype (:mod:`lpt.optim.leaves`). Each iteration is one pass over the leaf, so the cost is ``iterations + 2``
    rounding passes. f32/f64 leaves pass through unchanged.
    """
    if not (isinstance(iterations, int) and iterations >= 1):
        raise ValueError(f"iterations must be a positive int, got {iterations!r}")
    if not (0 < min_scale <= 1 <= max_scale):
        raise ValueError(f"need 0 < min_scale <= 1 <= max_scale, got min_scale={min_scale}, max_scale={max_scale}")

    def init_fn(params):
        del params
        return _NormPreservingState(empty_diagnostics() if diagnostics else None)

    def update_fn(updates, state, params=None):
        def leaf(_, p, u32):
            new_p, _ = norm_preserving_step(p, u32, iterations=iterations, min_scale=min_scale, max_scale=max_scale)
            return (new_p,)

        deltas, _, diag = map_leaves(
            "norm_preserving_update", rounded_leaves(leaf), updates, params, diagnostics=diagnostics
        )
        del state
        return deltas, _NormPreservingState(diag)

    return optax.GradientTransformation(init_fn, update_fn)
