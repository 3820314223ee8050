"""The AdamW + Kahan kernel per shard of a leaf: with the leaf's PartitionSpec given (``shard_map``), or on any
sharding the partitioner picks (``jax.experimental.custom_partitioning``).

:func:`adamw_kahan_on_shards` runs the kernel per shard of a leaf whose PartitionSpec the caller knows (the trainer
passes its param shardings to ``kahan_adamw(..., param_specs=...)``); it is a plain ``shard_map``, which every
compiler, the compile-only TPU one included, partitions.

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

__all__ = ["adamw_kahan_on_shards", "adamw_kahan_partitioned"]


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


def _shard_offset(spec: tuple, mesh_shape, local_shape: tuple, global_shape: tuple):
    """uint32 global flat index of this shard's first element (call per shard, with the mesh axes bound):
    the sum over dims of (shard position along the dim * shard size) * the dim's stride."""
    offset = jnp.uint32(0)
    stride = 1
    for dim in range(len(global_shape) - 1, -1, -1):
        pos = jnp.uint32(0)
        for axis in dispatch.as_axes(spec[dim]):
            pos = pos * jnp.uint32(mesh_shape[axis]) + lax.axis_index(axis).astype(jnp.uint32)  # i32 -> u32
        offset = offset + pos * jnp.uint32(local_shape[dim] * stride)
        stride *= global_shape[dim]
    return offset


def _per_shard(spec: tuple, mesh_shape, global_shape: tuple, opts: dict):
    def run(g, p, c, mv, scalars, words):
        offset = _shard_offset(spec, mesh_shape, p.shape, global_shape)
        return tuple(adamw_kahan(g, p, c, mv, scalars, words, global_shape=global_shape, offset=offset, **opts))

    return run


def _partition(static, mesh, arg_shapes, result_shape):
    del mesh, result_shape
    sh = _leaf_sharding(arg_shapes)
    rep = NamedSharding(sh.mesh, PartitionSpec())
    lower = _per_shard(tuple(sh.spec), sh.mesh.shape, tuple(arg_shapes[1].shape), _options(static))
    return sh.mesh, lower, (sh, sh, sh), (sh, sh, sh, sh, rep, rep)


def _rule(static, mesh, arg_shapes, result_shape):
    del static, mesh, result_shape
    dims = " ".join(f"d{i}" for i in range(len(arg_shapes[1].shape)))
    return f"{dims}, {dims}, {dims}, {dims}, s, w -> {dims}, {dims}, {dims}"


_update.def_partition(partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_rule)


def adamw_kahan_partitioned(g, p, c, mv, scalars, words, *, b1, b2, eps, weight_decay, stochastic, interpret=None):
    """:func:`lpt.kernels.adamw_kahan.adamw_kahan` on one leaf, per shard under any sharding (see module doc)."""
    dispatch.check_interpret(interpret)
    opts = dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, stochastic=stochastic, interpret=interpret)
    if p.ndim == 0:  # a scalar leaf has nothing to split
        return adamw_kahan(g, p, c, mv, scalars, words, **opts)
    return _update(g, p, c, mv, scalars, words, tuple(opts.items()))  # hashable: custom_partitioning's static arg


def adamw_kahan_on_shards(
    g, p, c, mv, scalars, words, *, spec, mesh=None, b1, b2, eps, weight_decay, stochastic, interpret=None
):
    """:func:`lpt.kernels.adamw_kahan.adamw_kahan` on one leaf laid out by ``spec`` (a PartitionSpec or a
    NamedSharding) over ``mesh`` (default :func:`lpt.kernels.dispatch.kernel_mesh`): a ``shard_map`` in which every
    device updates its own shard, hashing global element indices (the same bits as unsharded). ``g``, ``c`` and
    ``mv`` must be laid out like ``p``; a replicated leaf is updated whole on every device. With no mesh the kernel
    runs on the whole leaf."""
    dispatch.check_interpret(interpret)
    opts = dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, stochastic=stochastic, interpret=interpret)
    mesh = dispatch.kernel_mesh(mesh)
    spec = tuple(getattr(spec, "spec", spec))
    spec = spec + (None,) * (p.ndim - len(spec))
    if mesh is None or mesh.size == 1:
        return adamw_kahan(g, p, c, mv, scalars, words, **opts)
    for dim, axes in enumerate(spec):
        dispatch.check_divisible(f"dimension {dim} of a {tuple(p.shape)} leaf", p.shape[dim], mesh, axes)
    leaf, rep = PartitionSpec(*spec), PartitionSpec()
    run = _per_shard(spec, mesh.shape, tuple(p.shape), opts)
    fn = dispatch.shard_map(run, mesh, in_specs=(leaf, leaf, leaf, leaf, rep, rep), out_specs=(leaf, leaf, leaf))
    return tuple(fn(g, p, c, mv, scalars, words))
