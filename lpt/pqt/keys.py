"""Per-layer, per-step PRNG keys for PQT noise: a function of (seed, step, layer path) only.

    step key  = fold_in(root, step)
    layer key = fold_in(step key, crc32(layer path))

The trainer folds the step in once per step and hands the step key to the model; every PQT layer folds in its own
path (a stable string such as "blocks/3/mlp/down"). The same (root, step, path) always gives the same R, in
forward and backward alike; different paths or steps give independent R. crc32 is stable across processes and
Python runs (unlike ``hash``). Nothing depends on the process count or the sharding.
"""

import jax

from lpt.numerics.random import path_id


def step_key(key: jax.Array, step) -> jax.Array:
    """Key of one training step: ``fold_in(key, step)`` (step may be a traced int)."""
    return jax.random.fold_in(key, step)


def layer_key(key: jax.Array, path) -> jax.Array:
    """Key of one layer within a step: ``fold_in(key, crc32(path))`` (:func:`lpt.numerics.random.path_id`)."""
    if not path:
        raise ValueError("layer path must be non-empty (two layers with the same path would share their noise)")
    return jax.random.fold_in(key, path_id(path))


def pqt_key(key: jax.Array, path, step) -> jax.Array:
    """The noise key of layer ``path`` at ``step``: ``layer_key(step_key(key, step), path)``."""
    return layer_key(step_key(key, step), path)


__all__ = ["layer_key", "pqt_key", "step_key"]
