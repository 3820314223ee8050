"""``apply_updates`` that also works for float8 params (optax's refuses fp8 + f32 promotion)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_updates(params, updates):
    """``new_p = (p.astype(f32) + u.astype(f32)).astype(p.dtype)`` for every leaf (None leaves stay None).

    Equal to ``optax.apply_updates`` for bf16/f16/f32 params, and bit-exact with the f32 deltas of lpt's update
    rules for every dtype, float8 included: JAX forbids implicit fp8 promotion, so ``optax.apply_updates`` (and
    therefore ``nnx.Optimizer``) raises a TypePromotionError on float8 params.
    """

    def one(p, u):
        if p is None:
            return None
        p = jnp.asarray(p)
        if not jnp.issubdtype(p.dtype, jnp.floating):
            raise ValueError(f"apply_updates: param dtype {p.dtype} is not floating point")
        wide = jnp.promote_types(p.dtype, jnp.float32) if p.dtype.itemsize >= 4 else jnp.float32
        return (p.astype(wide) + jnp.asarray(u).astype(wide)).astype(p.dtype)  # p, u -> f32 (or f64); back to p

    return jax.tree.map(one, params, updates, is_leaf=lambda x: x is None)
