"""Per-leaf plumbing shared by the update rules that go last in an optax chain.

An update rule turns the incoming update ``u`` of every parameter leaf ``p`` into the change its rounding makes,
``new_p − p``, emitted in the dtype of the param (float32 for 8-bit params, :func:`lpt.numerics.update_dtype`), so
that optax's wrappers, which build updates from the gradients' dtype, see one type. ``optax.apply_updates`` then
lands on ``new_p`` bit for bit whenever the change fits that dtype (always unless a weight more than halves or
doubles in one step; then the change is rounded to nearest in that dtype, an error of at most 2^-8 of the change
for bf16, :func:`lpt.numerics.change_to`). This module validates the trees, walks them
with their paths, and sums the diagnostics; the rules themselves only say how one leaf is rounded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lpt.numerics import FORMATS, change_to

# Leaf dtypes an update rule rounds into; wider floats (f32, f64) pass through unchanged.
_ROUNDED_DTYPES = tuple(sorted(n for n, f in FORMATS.items() if n != "float32" and f.xla_storable))
_PASS_THROUGH_DTYPES = ("float32", "float64")


class UpdateDiagnostics(NamedTuple):
    """Scalars a user can log, summed over every parameter leaf of one step.

    cancelled_fraction: among elements whose intended update is nonzero, the fraction whose parameter did not change
      (for Kahan: deferred into the compensation; for nearest rounding: lost).
    intended_norm: global L2 norm of the incoming updates ``u``.
    applied_norm: global L2 norm of the changes actually made to the parameters.
    """

    cancelled_fraction: jax.Array
    intended_norm: jax.Array
    applied_norm: jax.Array


def empty_diagnostics() -> UpdateDiagnostics:
    z = jnp.zeros((), jnp.float32)
    return UpdateDiagnostics(z, z, z)


def _summarize(pairs) -> UpdateDiagnostics:
    """:class:`UpdateDiagnostics` of a step from ``[(intended_f32, applied_delta_f32), ...]``, one pair per leaf."""
    if not pairs:
        return empty_diagnostics()
    n_cancel = sum(jnp.sum((u != 0) & (d == 0), dtype=jnp.float32) for u, d in pairs)
    n_nonzero = sum(jnp.sum(u != 0, dtype=jnp.float32) for u, _ in pairs)
    return UpdateDiagnostics(
        cancelled_fraction=n_cancel / jnp.maximum(n_nonzero, 1.0),
        intended_norm=jnp.sqrt(sum(jnp.sum(u * u) for u, _ in pairs)),
        applied_norm=jnp.sqrt(sum(jnp.sum(d * d) for _, d in pairs)),
    )


def leaf_name(path) -> str:
    """The name of a leaf for error messages and random keys: ``jax.tree_util.keystr(path)`` without the trailing
    ``.value`` that a Flax NNX ``Variable`` adds, so ``{"kernel": nnx.Param(x)}`` (an ``nnx.State``) and
    ``{"kernel": x}`` (what ``nnx.Optimizer`` and ``nnx.as_pure`` pass) name -- and randomly round -- a leaf alike."""
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
    return jax.tree_util.keystr(tuple(path))


def decay_mask(mask, weight_decay_mask):
    """The weight-decay mask given as ``mask`` (optax's name) or ``weight_decay_mask`` (its alias), not both."""
    if mask is not None and weight_decay_mask is not None:
        raise ValueError("give the weight-decay mask once: mask=... (weight_decay_mask is an alias of it)")
    return mask if mask is not None else weight_decay_mask


def needs_rounding(dtype) -> bool:
    """True if ``dtype`` is a low-precision float an update rule rounds into; raises for unsupported dtypes."""
    name = np.dtype(dtype).name
    if name in _ROUNDED_DTYPES:
        return True
    if name in _PASS_THROUGH_DTYPES:
        return False
    raise ValueError(
        f"unsupported parameter dtype {name!r}; lpt.optim update rules support {list(_ROUNDED_DTYPES)} "
        f"(rounded) and {list(_PASS_THROUGH_DTYPES)} (passed through unchanged)"
    )


def check_trees(rule: str, updates, params) -> None:
    """ValueError unless ``params`` is given and has the tree structure of ``updates``."""
    if params is None:
        raise ValueError(f"{rule} needs the parameters: call update(updates, state, params)")
    su, sp = jax.tree.structure(updates), jax.tree.structure(params)
    if su != sp:
        raise ValueError(f"{rule}: updates and params trees differ:\n  updates: {su}\n  params:  {sp}")


def map_leaves(
    rule: str,
    fn: Callable[..., tuple],
    updates: Any,
    params: Any,
    *states: Any,
    inputs: tuple = (),
    diagnostics: bool = False,
) -> tuple[Any, tuple[Any, ...], UpdateDiagnostics | None]:
    """The one walk over the leaves of every lpt update rule and of the fused AdamW.

    For every leaf, in tree order: ``fn(name, p, u, *state_leaves, *input_leaves) -> (delta_f32, new_state_leaves,
    intended)`` with ``name`` the leaf's :func:`leaf_name`, ``p`` and ``u`` as arrays (checked: floating point, equal
    shapes), one leaf of each tree of ``states`` and of ``inputs`` (trees with the params' structure down to their
    leaves; an input's leaf may be any object), and ``new_state_leaves`` one new leaf per state tree. ``intended``
    is the f32 update the rule meant to apply, or a zero-argument function computing it (called only with
    ``diagnostics``). Returns ``(deltas, new_states, diagnostics_or_None)``, ``new_states`` a tree per state.

    Args:
      rule: the rule's name in errors.
      fn: the per-leaf function (above).
      updates: the updates tree.
      params: the params tree; its structure is the reference.
      *states: state trees, one new leaf each per call of ``fn``.
      inputs: further trees passed to ``fn`` leaf by leaf.
      diagnostics: summarize ``(intended, delta)`` over the leaves (:func:`_summarize`).
    """
    check_trees(rule, updates, params)
    flat_p, treedef = jax.tree_util.tree_flatten_with_path(params)
    flat_u = treedef.flatten_up_to(updates)
    flat_t = [treedef.flatten_up_to(t) for t in (*states, *inputs)]
    deltas, new_states, pairs = [], [], []
    for i, ((path, p), u) in enumerate(zip(flat_p, flat_u, strict=True)):
        name = leaf_name(path)
        p, u = jnp.asarray(p), jnp.asarray(u)
        if not jnp.issubdtype(u.dtype, jnp.floating):
            raise ValueError(f"{rule}: update at {name} has dtype {u.dtype}; updates must be floating point")
        if p.shape != u.shape:
            raise ValueError(f"{rule}: update at {name} has shape {u.shape} but the param has shape {p.shape}")
        if not jnp.issubdtype(p.dtype, jnp.floating):
            raise ValueError(f"{rule}: param at {name} has dtype {p.dtype}; only floating-point params are supported")
        delta, leaf_states, intended = fn(name, p, u, *(ft[i] for ft in flat_t))
        deltas.append(delta)
        if len(leaf_states) != len(states):
            raise ValueError(f"{rule}: {len(leaf_states)} new state leaves at {name}, expected {len(states)}")
        new_states.append(tuple(leaf_states))
        if diagnostics:  # any float -> f32 for the statistics
            u32 = intended() if callable(intended) else intended
            pairs.append((u32.astype(jnp.float32), delta.astype(jnp.float32)))
    outs = tuple(treedef.unflatten([leaf[j] for leaf in new_states]) for j in range(len(states)))
    return treedef.unflatten(deltas), outs, _summarize(pairs) if diagnostics else None


def rounded_leaves(fn: Callable[..., tuple]) -> Callable[..., tuple]:
    """An update rule's leaf function for :func:`map_leaves`, from ``fn(name, p, u_f32, *state_leaves) ->
    (new_p_f32, *new_state_leaves)`` that says how one low-precision leaf is rounded.

    ``fn`` is only called for leaves whose dtype needs rounding; the emitted update is
    :func:`lpt.numerics.change_to` ``(p, new_p)`` in the param's update dtype. f32/f64 leaves get ``delta = u`` (in
    the update's dtype) and keep their state leaves."""

    def leaf(name, p, u, *state_leaves):
        if not needs_rounding(p.dtype):
            return u, state_leaves, u
        u32 = u.astype(jnp.float32)  # update dtype -> f32
        p32 = p.astype(jnp.float32)  # low precision -> f32 (exact)
        new_p32, *new_state_leaves = fn(name, p, u32, *state_leaves)
        return change_to(p32, new_p32, p.dtype), new_state_leaves, u32

    return leaf


def zeros_like_rounded(params: Any, dtype_fn: Callable[[jnp.dtype], Any]) -> Any:
    """A tree like ``params``: zeros of ``dtype_fn(p.dtype)`` for rounded leaves, an f32 scalar 0 placeholder for
    pass-through leaves (they need no state; the scalar keeps the tree structure equal to the params')."""

    def one(p):
        p = jnp.asarray(p)
        if needs_rounding(p.dtype):
            return jnp.zeros(p.shape, dtype_fn(p.dtype))
        return jnp.zeros((), jnp.float32)

    return jax.tree.map(one, params)
