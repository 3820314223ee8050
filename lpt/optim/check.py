"""Check that a chain's last transform is one of lpt's update rules: its updates land on the params' grid.

An lpt update rule (:func:`lpt.optim.kahan_summation`, :func:`~lpt.optim.stochastic_rounding`,
:func:`~lpt.optim.nearest_rounding`, :func:`~lpt.optim.norm_preserving_update`, :func:`~lpt.optim.adamw`,
:func:`~lpt.optim.kahan_adamw`) emits ``u = p' − p`` for a new parameter ``p'`` that it rounded to the param's dtype,
so ``p + u`` (in f32) is exactly a value of that dtype. A transform after it that changes ``u`` (a scale by a learning
rate, a clip) moves ``p + u`` off that grid, and ``optax.apply_updates`` then rounds it to nearest: the update rule
is bypassed without an error. A chain cannot be inspected from inside (optax chains are closures), so
:func:`check_last` runs one update on the given params and checks the grid property: every element whose new
value stays within a factor of 2 of the old one (beyond that the rules round the change itself,
:func:`lpt.numerics.change_to`) must land exactly on a value of the param's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lpt.optim.leaves import leaf_name, needs_rounding


def check_last(tx: optax.GradientTransformation, params, grads=None) -> int:
    """Run ``tx.update`` once (``grads``: standard normal ones in the params' dtype when None, seed 0) and raise a
    one-line ValueError naming the first low-precision leaf (dtype narrower than float32) where ``p + u`` is off the
    param dtype's grid, i.e. where a transform after lpt's update rule changed its updates. Returns the number of
    low-precision leaves checked; ValueError when there are none (nothing to check: f32 params need no rule)."""
    if grads is None:
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(0), max(len(leaves), 1))[: len(leaves)]
        normals = [jax.random.normal(k, jnp.shape(p), jnp.float32) for k, p in zip(keys, leaves, strict=True)]
        grads = jax.tree.unflatten(treedef, [g.astype(p.dtype) for g, p in zip(normals, leaves, strict=True)])
    updates, _ = tx.update(grads, tx.init(params), params)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    changes = jax.tree.leaves(updates)
    checked = 0
    for (path, p), u in zip(flat, changes, strict=True):
        p = np.asarray(p)
        if not needs_rounding(p.dtype):  # f32 / f64 leaves: the rules pass them through
            continue
        checked += 1
        old = p.astype(np.float32)  # the param's value, exact in f32
        new = old + np.asarray(u).astype(np.float32)  # what optax.apply_updates adds before it rounds, in f32
        on_grid = new.astype(p.dtype).astype(np.float32) == new  # f32 -> param dtype -> f32: exact on the grid
        near = (np.abs(new) <= 2 * np.abs(old)) & (np.abs(new) >= 0.5 * np.abs(old)) & (new * old > 0)
        off = int(np.sum(near & ~on_grid))
        if off:
            raise ValueError(
                f"check_last: leaf {leaf_name(path)} ({p.dtype}): {off} of {int(near.sum())} updated "
                f"values are not {p.dtype} values, so a transform after lpt's update rule changed its updates (or "
                f"the chain has no lpt rule); put the rule last in the chain"
            )
    if not checked:
        raise ValueError("check_last: params hold no leaf narrower than float32; there is no update rule to check")
    return checked
