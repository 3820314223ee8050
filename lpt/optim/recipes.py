"""Ready-made chains: a low-precision AdamW in one call, and the update rules by name (for configs)."""

from __future__ import annotations

import optax

from lpt.optim.kahan import kahan_summation
from lpt.optim.norm_preserving import norm_preserving_update
from lpt.optim.rounding_rules import nearest_rounding, stochastic_rounding

UPDATE_RULES = ("nearest", "kahan", "stochastic", "norm_preserving")


def update_rule(
    name: str, *, seed: int = 0, diagnostics: bool = False, compensation_dtype=None
) -> optax.GradientTransformation:
    """The last transform of a chain, by name: "nearest" | "kahan" | "stochastic" | "norm_preserving"."""
    if name == "nearest":
        return nearest_rounding(diagnostics=diagnostics)
    if name == "kahan":
        return kahan_summation(compensation_dtype, diagnostics=diagnostics)
    if name == "stochastic":
        return stochastic_rounding(seed, diagnostics=diagnostics)
    if name == "norm_preserving":
        return norm_preserving_update(diagnostics=diagnostics)
    raise ValueError(f"unknown update rule {name!r}; choose one of {UPDATE_RULES}")


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    update: str = "kahan",
    mu_dtype=None,
    grad_clip: float | None = None,
    seed: int = 0,
    diagnostics: bool = False,
    compensation_dtype=None,
) -> optax.GradientTransformation:
    """AdamW for low-precision params: ``[clip_by_global_norm] -> optax.adamw -> update rule``.

    With bf16 params the moments live in bf16 too (``mu_dtype`` can widen the first one) and, with
    ``update="kahan"``, the compensation in bf16: 8 bytes per parameter (param, mu, nu, compensation) instead of
    the 16 of bf16 weights + f32 master + f32 moments. Decoupled weight decay is part of the compensated update,
    so it takes effect even when ``lr·wd`` is far below an ulp.
    """
    parts = [] if grad_clip is None else [optax.clip_by_global_norm(grad_clip)]
    parts.append(optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mu_dtype=mu_dtype))
    parts.append(update_rule(update, seed=seed, diagnostics=diagnostics, compensation_dtype=compensation_dtype))
    return optax.chain(*parts)


def kahan_adamw(learning_rate: optax.ScalarOrSchedule, **kwargs) -> optax.GradientTransformation:
    """:func:`adamw` with ``update="kahan"`` (bf16 params, moments and compensation: 8 bytes/param)."""
    return adamw(learning_rate, update="kahan", **kwargs)
