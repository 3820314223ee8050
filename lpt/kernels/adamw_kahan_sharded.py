"""The AdamW + Kahan kernel on any sharding of a leaf: ``jax.experimental.custom_partitioning`` around it.

:func:`adamw_kahan_partitioned` has the signature of :func:`lpt.kernels.adamw_kahan.adamw_kahan`. Inside a jit
whose operands are split over several devices, XLA's partitioner (Shardy, or GSPMD) calls back into ``_partition``
with the shardings it chose for the operands; every device then runs the kernel on its own shard of
``(g, p, c, mv)``, with ``g``, ``c`` and ``mv`` resharded like ``p`` if they differ (they are laid out like the
params already) and the scalars replicated. Nothing is gathered.

Why custom_partitioning and not an explicit sharding argument: under ``AxisType.Auto`` mesh axes a param's sharding
is not visible at trace time (it is decided by the partitioner, from the jit's in_shardings), and the optimizer is
built before the trainer knows the shardings; the partition callback sees the real shardings, so
``kahan_adamw(impl="pallas")`` needs no extra argument and follows any layout, including ones the trainer does not
name. The per-shard function gets its shard's position with ``lax.axis_index`` (the callback runs it with the mesh's
axes bound) and passes the global flat index of its first element to the kernel, which hashes every element's
global flat index for the stochastic rounding: the bits are a function of (key, leaf, element), never of the
sharding. Outside a multi-device partitioned jit the kernel runs on the whole leaf.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from lpt.kernels import dispatch
from lpt.kernels.adamw_kahan import adamw_kahan

__all__ = ["adamw_kahan_partitioned"]


def _options(static) -> dict:
    return dict(static)


@functools.partial(custom_partitioning, static_argnums=(6,))
def _update(g, p, c, mv, scalars, words, static):
    return tuple(adamw_kahan(g, p, c, mv, scalars, words, **_options(static)))


def _leaf_sharding(arg_shapes) -> NamedSharding:
    """``p``'s sharding (a NamedSharding over the partitioner's mesh), as a full-rank spec."""
    sh = arg_shapes[1].sharding
    spec = tuple(sh.spec) + (None,) * (len(arg_shapes[1].shape) - len(sh.spec))
    return NamedSharding(sh.mesh, PartitionSpec(*spec))


def _infer(static, mesh, arg_shapes, result_shape):
    del static, mesh, result_shape
    sh = _leaf_sharding(arg_shapes)
    return (sh, sh, sh)


def _partition(static, mesh, arg_shapes, result_shape):
    del mesh, result_shape
    sh = _leaf_sharding(arg_shapes)
    rep = NamedSharding(sh.mesh, PartitionSpec())
    global_shape = tuple(arg_shapes[1].shape)
    spec = tuple(sh.spec)

    def lower(g, p, c, mv, scalars, words):
        # global flat index of this shard's first element: sum over dims of (shard position * shard size) * stride
        offset = jnp.uint32(0)
        stride = 1
        for dim in range(len(global_shape) - 1, -1, -1):
            pos = jnp.uint32(0)
            for axis in dispatch.as_axes(spec[dim]):
                pos = pos * jnp.uint32(sh.mesh.shape[axis]) + lax.axis_index(axis).astype(jnp.uint32)  # i32 -> u32
            offset = offset + pos * jnp.uint32(p.shape[dim] * stride)
            stride *= global_shape[dim]
        opts = _options(static)
        return tuple(adamw_kahan(g, p, c, mv, scalars, words, global_shape=global_shape, offset=offset, **opts))

    return sh.mesh, lower, (sh, sh, sh), (sh, sh, sh, sh, rep, rep)


def _rule(static, mesh, arg_shapes, result_shape):
    del static, mesh, result_shape
    dims = " ".join(f"d{i}" for i in range(len(arg_shapes[1].shape)))
    return f"{dims}, {dims}, {dims}, {dims}, s, w -> {dims}, {dims}, {dims}"


_update.def_partition(partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_rule)


def adamw_kahan_partitioned(g, p, c, mv, scalars, words, *, b1, b2, eps, weight_decay, stochastic, interpret=None):
    """:func:`lpt.kernels.adamw_kahan.adamw_kahan` on one leaf, per shard under any sharding (see module doc)."""
    dispatch.check_interpret(interpret)
    if p.ndim == 0:  # a scalar leaf has nothing to split
        return adamw_kahan(
            g,
            p,
            c,
            mv,
            scalars,
            words,
            b1=b1,
            b2=b2,
            eps=eps,
            weight_decay=weight_decay,
            stochastic=stochastic,
            interpret=interpret,
        )
    static = (
        ("b1", b1),
        ("b2", b2),
        ("eps", eps),
        ("weight_decay", weight_decay),
        ("stochastic", stochastic),
        ("interpret", interpret),
    )
    return _update(g, p, c, mv, scalars, words, static)
