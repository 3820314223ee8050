"""Ready-made chains: a low-precision AdamW in one call, and the update rules by name (for configs)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpt.kernels.adamw_kahan.math import no_fma, runtime_zero
from lpt.optim.adam import scale_by_adam
from lpt.optim.kahan import kahan_summation
from lpt.optim.leaves import decay_mask
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


class _AddDecayedWeightsState(NamedTuple):
    count: jax.Array  # int32 step count: its sign bit is the runtime zero of no_fma


def add_decayed_weights(weight_decay: optax.ScalarOrSchedule = 0.0, mask=None) -> optax.GradientTransformation:
    """Decoupled weight decay ``u + wd·p`` computed in f32, with ``optax.add_decayed_weights``' signature.

    ``weight_decay`` is a number or a schedule of the step count (read before its increment, as optax does);
    ``mask`` (a tree of bools like the params, or a callable returning one) limits the decay to the True leaves
    (``optax.masked``); ``None`` update leaves pass through. optax multiplies ``wd·p`` in the param dtype (bf16
    here), so whether it is rounded depends on XLA's fusion; here the product is f32 and kept out of an FMA with the
    add (:func:`lpt.kernels.adamw_kahan.math.no_fma`, whose runtime zero comes from the step count in the state), so
    the result is the same in every fusion and equal to :func:`kahan_adamw`'s fused step. Updates come out f32; a
    constant ``weight_decay == 0`` passes them through."""

    def init_fn(params):
        del params
        return _AddDecayedWeightsState(jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("add_decayed_weights needs the parameters: call update(updates, state, params)")
        count = optax.safe_int32_increment(state.count)
        if isinstance(weight_decay, (int, float)) and weight_decay == 0:
            return updates, _AddDecayedWeightsState(count)
        wd_value = weight_decay(state.count) if callable(weight_decay) else weight_decay
        wd = jnp.asarray(wd_value).astype(jnp.float32)  # hyperparameter (maybe traced or scheduled) -> f32
        zero = runtime_zero(count)

        def one(u, p):
            if u is None:
                return None
            return u.astype(jnp.float32) + no_fma(wd * p.astype(jnp.float32), zero)  # update, param -> f32 (exact)

        return jax.tree.map(one, updates, params, is_leaf=lambda x: x is None), _AddDecayedWeightsState(count)

    decay = optax.GradientTransformation(init_fn, update_fn)
    return decay if mask is None else optax.masked(decay, mask)


def scale_by_learning_rate(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    """``−lr · u`` in f32 with the product kept out of FMAs (:func:`lpt.kernels.adamw_kahan.math.no_fma`).

    The state is ``optax.ScaleByScheduleState(count)`` for schedules and constants alike (the count supplies
    ``no_fma``'s runtime zero); a schedule is read at the count before its increment, as optax does. The product is
    rounded to f32 on its own, as in :func:`kahan_adamw`'s fused step: ``optax.scale_by_learning_rate``'s product
    may instead be contracted by XLA:CPU into the next transform's add or subtraction (Kahan's ``u − c``) as one
    FMA, depending on the fusion."""

    def init_fn(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        neg_lr = jnp.asarray(-1 * lr).astype(jnp.float32)  # schedule value -> f32 (as the fused step)
        count = optax.safe_int32_increment(state.count)
        zero = runtime_zero(count)
        updates = jax.tree.map(lambda u: no_fma(neg_lr * u.astype(jnp.float32), zero), updates)  # update -> f32
        return updates, optax.ScaleByScheduleState(count=count)

    return optax.GradientTransformation(init_fn, update_fn)


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype=None,
    weight_decay: float = 1e-4,
    mask=None,
    *,
    nesterov: bool = False,
    weight_decay_mask=None,
    update: str = "kahan",
    moment_dtype=None,
    moment_rounding: str = "stochastic",
    grad_clip: float | None = None,
    seed: int = 0,
    diagnostics: bool = False,
    compensation_dtype=None,
) -> optax.GradientTransformation:
    """AdamW for low-precision params: ``[clip] -> lpt scale_by_adam -> decoupled decay (f32) -> -lr -> update rule``
    (the decay and ``-lr`` are lpt's :func:`add_decayed_weights` and :func:`scale_by_learning_rate`).

    With bf16 params the moments live in bf16 (computed in f32, stored with ``moment_rounding``, see
    :func:`lpt.optim.scale_by_adam`) and, with ``update="kahan"``, the compensation in bf16: 8 bytes per parameter
    (param, mu, nu, compensation) instead of the 14 of f32 master weights + f32 moments + a bf16 compute copy. The
    decoupled weight decay is part of the compensated update, so it takes effect even when ``lr·wd`` is far below
    an ulp. ``update`` is one of :data:`UPDATE_RULES`; ``mask`` (tree of bools or callable, as optax's) turns the decay
    off per leaf (``weight_decay_mask`` is an alias).

    The positional arguments and ``nesterov`` are ``optax.adamw``'s (``eps_root``, ``mu_dtype`` and ``nesterov`` go
    to :func:`lpt.optim.scale_by_adam`); the keywords after them are lpt's.

    Args:
      learning_rate: a float or an optax schedule of the step count.
      b1, b2, eps, eps_root: as :func:`lpt.optim.scale_by_adam`.
      mu_dtype: dtype of m (as optax); None: ``moment_dtype``'s rule.
      weight_decay: decoupled weight decay.
      mask, weight_decay_mask: the decay mask (above); give at most one.
      nesterov: Nesterov momentum (NAdam).
      update: one of :data:`UPDATE_RULES`.
      moment_dtype: as :func:`lpt.optim.scale_by_adam`; None: the param dtype.
      moment_rounding: "stochastic" or "nearest".
      grad_clip: global-norm clip applied first; None: no clipping.
      seed: seed of the moments' rounding keys; the update rule gets ``seed + 1``.
      diagnostics: the update rule keeps an :class:`lpt.optim.leaves.UpdateDiagnostics` of the last step.
      compensation_dtype: dtype of the Kahan compensation (``update="kahan"``); None: the param's own.
    """
    parts = [] if grad_clip is None else [optax.clip_by_global_norm(grad_clip)]
    parts += [
        scale_by_adam(
            b1,
            b2,
            eps,
            eps_root,
            mu_dtype,
            nesterov=nesterov,
            moment_dtype=moment_dtype,
            rounding=moment_rounding,
            seed=seed,
        ),
        add_decayed_weights(weight_decay, mask=decay_mask(mask, weight_decay_mask)),
        scale_by_learning_rate(learning_rate),
        update_rule(update, seed=seed + 1, diagnostics=diagnostics, compensation_dtype=compensation_dtype),
    ]
    return optax.chain(*parts)
