"""Stateless update rules: round ``p + u`` to nearest or stochastically. Each goes last in an optax chain."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpt.numerics import round_nearest, round_stochastic
from lpt.numerics.random import path_id
from lpt.optim.leaves import UpdateDiagnostics, empty_diagnostics, map_leaves, rounded_leaves


class _NearestRoundingState(NamedTuple):
    diagnostics: UpdateDiagnostics | None


class _StochasticRoundingState(NamedTuple):
    """``count`` is the step number that keys the randomness; no per-parameter state is needed."""

    count: jax.Array
    diagnostics: UpdateDiagnostics | None


def nearest_rounding(*, diagnostics: bool = False) -> optax.GradientTransformation:
    """``new_p = round_nearest(p + u)`` in p's dtype: what ``optax.apply_updates`` does to bf16 params anyway.

    It exists as the baseline of the other rules: it emits the change in the param's dtype (``apply_updates`` lands
    on ``new_p``) and, with ``diagnostics=True``, reports how many elements' updates were cancelled (Zamirai et al.,
    Theorem 1: every |u| below half an ulp of p is lost). f32/f64 leaves pass through unchanged.
    """

    def init_fn(params):
        del params
        return _NearestRoundingState(empty_diagnostics() if diagnostics else None)

    def update_fn(updates, state, params=None):
        def leaf(_, p, u32):
            p32 = p.astype(jnp.float32)  # param dtype -> f32 (exact)
            return (round_nearest(p32 + u32, p.dtype, out_dtype=jnp.float32),)

        deltas, _, diag = map_leaves("nearest_rounding", rounded_leaves(leaf), updates, params, diagnostics=diagnostics)
        del state
        return deltas, _NearestRoundingState(diag)

    return optax.GradientTransformation(init_fn, update_fn)


def stochastic_rounding(seed: int = 0, *, diagnostics: bool = False) -> optax.GradientTransformation:
    """``new_p = round_stochastic(p + u)`` in p's dtype, so that E[new_p] = p + u. Put it **last** in a chain.

    The random bits of a leaf come from ``fold_in(fold_in(key(seed), step), crc32(leaf path))``: the same in every
    process and for every sharding (the default ``lpt.numerics.hash_bits`` hashes each element's global index with the
    key, so the bits do not depend on how the leaf is sharded), and
    different for every step and leaf. f32/f64 leaves pass through unchanged.

    Args:
      seed: integer seed of the rounding noise.
      diagnostics: keep an :class:`UpdateDiagnostics` of the last step in the state.
    """
    if not (isinstance(seed, int) or jnp.issubdtype(getattr(seed, "dtype", float), jnp.integer)):
        raise ValueError(
            f"seed must be an int (or an integer array, as optax.inject_hyperparams passes it), got {seed!r}"
        )

    def init_fn(params):
        del params
        return _StochasticRoundingState(jnp.zeros((), jnp.int32), empty_diagnostics() if diagnostics else None)

    def update_fn(updates, state, params=None):
        step_key = jax.random.fold_in(jax.random.key(seed), state.count)

        def leaf(path, p, u32):
            key = jax.random.fold_in(step_key, path_id(path, bits=31))
            p32 = p.astype(jnp.float32)  # param dtype -> f32 (exact)
            return (round_stochastic(p32 + u32, p.dtype, key, out_dtype=jnp.float32),)

        deltas, _, diag = map_leaves(
            "stochastic_rounding", rounded_leaves(leaf), updates, params, diagnostics=diagnostics
        )
        return deltas, _StochasticRoundingState(optax.safe_increment(state.count), diag)

    return optax.GradientTransformation(init_fn, update_fn)
