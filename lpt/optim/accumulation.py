"""Compensated gradient accumulation over micro-batches.

Zamirai et al.: when many small micro-batch gradients are summed in bf16, each addition rounds to nearest and the small
ones are lost, exactly like small weight updates. A Kahan-compensated sum keeps them: the running total and its
compensation both live in the accumulator dtype (2 + 2 bytes per parameter in bf16) and the result matches an f32
sum to about 16 significant bits.

Functional API, usable inside ``lax.scan`` over micro-batches::

    acc = compensated_sum_init(params, jnp.bfloat16)
    for g in micro_grads:                       # or a lax.scan
        acc = compensated_sum_add(acc, g)
    mean_grads = compensated_sum_mean(acc)      # f32 tree
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lpt.numerics import round_nearest


class _CompensatedSum(NamedTuple):
    total: Any  # tree, accumulator dtype
    compensation: Any  # tree, accumulator dtype: excess of ``total`` over the exact sum
    count: jax.Array  # int32 scalar: number of trees added


def compensated_sum_init(like: Any, dtype=jnp.bfloat16) -> _CompensatedSum:
    """Zeros shaped like ``like`` (params or grads) in the accumulator ``dtype``."""
    zeros = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), dtype), like)
    return _CompensatedSum(total=zeros, compensation=zeros, count=jnp.zeros((), jnp.int32))


def compensated_sum_add(acc: _CompensatedSum, tree: Any) -> _CompensatedSum:
    """``acc + tree`` with Kahan compensation: y = x - c; s = Q(t + y); c = Q((s - t) - y); t = s (f32 arithmetic,
    roundings through :func:`lpt.numerics.round_nearest`, so they survive jit)."""

    def one(t, c, x):
        t32 = t.astype(jnp.float32)  # accumulator dtype -> f32 (exact)
        y = jnp.asarray(x).astype(jnp.float32) - c.astype(jnp.float32)  # grad dtype -> f32; acc dtype -> f32
        s32 = round_nearest(t32 + y, t.dtype, out_dtype=jnp.float32)
        c_new = round_nearest((s32 - t32) - y, c.dtype)  # f32 -> accumulator dtype
        return s32.astype(t.dtype), c_new  # f32 -> accumulator dtype (exact: on the grid)

    leaves_t, treedef = jax.tree.flatten(acc.total)
    if jax.tree.structure(tree) != treedef:
        raise ValueError(f"compensated_sum_add: tree structure {jax.tree.structure(tree)} != accumulator {treedef}")
    pairs = [
        one(t, c, x)
        for t, c, x in zip(leaves_t, treedef.flatten_up_to(acc.compensation), treedef.flatten_up_to(tree), strict=True)
    ]
    return _CompensatedSum(
        total=treedef.unflatten([t for t, _ in pairs]),
        compensation=treedef.unflatten([c for _, c in pairs]),
        count=acc.count + 1,
    )


def compensated_sum_value(acc: _CompensatedSum) -> Any:
    """The accumulated sum as f32: ``total - compensation``."""
    return jax.tree.map(
        lambda t, c: t.astype(jnp.float32) - c.astype(jnp.float32),  # acc dtype -> f32 (both exact)
        acc.total,
        acc.compensation,
    )


def compensated_sum_mean(acc: _CompensatedSum) -> Any:
    """The mean of the added trees as f32 (sum / count; count 0 gives zeros)."""
    n = jnp.maximum(acc.count, 1).astype(jnp.float32)  # int32 -> f32
    return jax.tree.map(lambda v: v / n, compensated_sum_value(acc))
