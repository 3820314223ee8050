"""The AdamW + Kahan kernel per shard of a leaf: with the leaf's PartitionSpec given (``shard_map``), or on any
sharding the partitioner picks (``jax.experimental.custom_partitioning``).

:func:`adamw_kahan_on_shards` runs the kernel per shard of a leaf whose PartitionSpec the caller knows (the trainer
passes its param shardings to ``kahan_adamw(..., param_specs=...)``); it is a plain ``shard_map``, which every
compiler, the compile-only TPU one included, partitions.

:func:`adamw_kahan_partitioned` has the signature of :func:`lpt.kernels.adamw_kahan.kernel.adamw_kahan`. Inside a jit
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

8-bit moments (``scales`` and ``StepOptions.moments8``, see :mod:`lpt.kernels.adamw_kahan.kernel`): the scales (one per
block of 128 along the last axis, ``p.shape[:-1] + (p.shape[-1] // 128,)``) are split like the param, with its
PartitionSpec, so every shard holds its own blocks' scales; a split of the last axis must leave each shard whole blocks
of 128 (:func:`check_whole_blocks`, a one-line ValueError otherwise). The global flat index of each element, hashed for
the stochastic rounding, is the same as for 16-bit moments.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from lpt.kernels import dispatch
from lpt.kernels.adamw_kahan.options import LANES, StepOptions

__all__ = ["adamw_kahan_on_shards", "adamw_kahan_partitioned", "check_whole_blocks"]


def _adamw_kahan():
    """The Pallas kernel, loaded when a shard first runs it (importing this module loads no Pallas)."""
    return dispatch.kernel("lpt.kernels.adamw_kahan.kernel", "adamw_kahan")


@functools.partial(custom_partitioning, static_argnums=(6,))
def _update(g, p, c, mv, scalars, words, options):
    return tuple(_adamw_kahan()(g, p, c, mv, scalars, words, options=options))


@functools.partial(custom_partitioning, static_argnums=(7,))
def _update8(g, p, c, mv, scales, scalars, words, options):
    return tuple(_adamw_kahan()(g, p, c, mv, scalars, words, scales, options=options))


def check_whole_blocks(shape, spec, mesh) -> None:
    """8-bit moments: ValueError unless the split ``spec`` of the last axis of a ``shape`` leaf over ``mesh`` leaves
    every shard whole blocks of 128 (the scales then split like the param)."""
    spec = tuple(getattr(spec, "spec", spec))
    axes = spec[len(shape) - 1] if len(spec) >= len(shape) else None
    n = dispatch.mesh_axis_size(mesh, axes)
    if shape[-1] % (n * LANES):
        raise ValueError(
            f"8-bit moments: the last axis ({shape[-1]}) of a {tuple(shape)} leaf split over mesh axes "
            f"{dispatch.as_axes(axes)} of size {n} gives shards of {shape[-1] / n:g}, not whole blocks of {LANES}"
        )


def _leaf_sharding(arg_shapes) -> NamedSharding:
    """``p``'s sharding (a NamedSharding over the partitioner's mesh), as a full-rank spec."""
    sh = arg_shapes[1].sharding
    spec = tuple(sh.spec) + (None,) * (len(arg_shapes[1].shape) - len(sh.spec))
    return NamedSharding(sh.mesh, PartitionSpec(*spec))


def _infer(options, mesh, arg_shapes, result_shape):
    del mesh, result_shape
    sh = _leaf_sharding(arg_shapes)
    return (sh,) * (4 if options.moments8 is not None else 3)


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


def _per_shard(spec: tuple, mesh_shape, global_shape: tuple, options: StepOptions):
    def run(g, p, c, mv, *rest):
        *scales, scalars, words = rest  # 8-bit moments: the shard's scales before the scalars
        offset = _shard_offset(spec, mesh_shape, p.shape, global_shape)
        shard = (global_shape, offset)
        return tuple(_adamw_kahan()(g, p, c, mv, scalars, words, *scales, options=options, shard=shard))

    return run


def _partition(options, mesh, arg_shapes, result_shape):
    del mesh, result_shape
    sh = _leaf_sharding(arg_shapes)
    rep = NamedSharding(sh.mesh, PartitionSpec())
    shape = tuple(arg_shapes[1].shape)
    eight_bit = options.moments8 is not None
    leaf = (sh,) * (5 if eight_bit else 4)  # g, p, c, mv (and the scales), all split like p
    if eight_bit:
        check_whole_blocks(shape, sh.spec, sh.mesh)
    run = _per_shard(tuple(sh.spec), sh.mesh.shape, shape, options)

    def lower(*args):  # lowered by the partitioner, which cannot lower a Mosaic GPU kernel's mutable references
        with dispatch.fresh_outputs():
            return run(*args)

    return sh.mesh, lower, leaf[1:], (*leaf, rep, rep)


def _rule(options, mesh, arg_shapes, result_shape):
    del mesh, result_shape
    rank = len(arg_shapes[1].shape)
    dims = " ".join(f"d{i}" for i in range(rank))
    if options.moments8 is None:
        return f"{dims}, {dims}, {dims}, {dims}, s, w -> {dims}, {dims}, {dims}"
    # the last axis is (blocks, 128) with the blocks major: a split of the param's last axis is one of the scales'
    # (one block: its own factors, Shardy refuses a compound of a size-1 factor)
    head = " ".join(f"d{i}" for i in range(rank - 1))
    one_block = arg_shapes[1].shape[-1] == LANES
    leaf, scales = (f"{head} k", f"{head} b") if one_block else (f"{head} (b k)", f"{head} b")
    rule = f"{leaf}, {leaf}, {leaf}, {leaf}, {scales}, s, w -> {leaf}, {leaf}, {leaf}, {scales}"
    return rule if one_block else (rule, {"k": LANES})


_update.def_partition(partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_rule)
_update8.def_partition(partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_rule)


def adamw_kahan_partitioned(g, p, c, mv, scalars, words, scales=None, *, options: StepOptions):
    """:func:`lpt.kernels.adamw_kahan.kernel.adamw_kahan` on one leaf, per shard under any sharding (see module doc);
    with 8-bit moments (``scales``, ``options.moments8``) it returns ``(p', c', mv', scales')``.

    Args:
      g, p, c, mv, scalars, words, scales, options: as :func:`lpt.kernels.adamw_kahan.kernel.adamw_kahan`.
    """
    if p.ndim == 0:  # a scalar leaf has nothing to split
        return _adamw_kahan()(g, p, c, mv, scalars, words, scales, options=options)
    if options.moments8 is None:
        return _update(g, p, c, mv, scalars, words, options)  # options: custom_partitioning's static arg (hashable)
    return _update8(g, p, c, mv, scales, scalars, words, options)


def adamw_kahan_on_shards(g, p, c, mv, scalars, words, scales=None, *, options: StepOptions, spec):
    """:func:`lpt.kernels.adamw_kahan.kernel.adamw_kahan` on one leaf laid out by ``spec`` over the mesh in context
    (:func:`lpt.kernels.dispatch.kernel_mesh`): a ``shard_map`` in which every device updates its own shard, hashing
    global element indices (the same bits as unsharded). ``g``, ``c`` and ``mv`` (and the 8-bit moments' ``scales``)
    must be laid out like ``p``; a replicated leaf is updated whole on every device. With no mesh the kernel runs on
    the whole leaf.

    Args:
      g, p, c, mv, scalars, words, scales, options: as :func:`lpt.kernels.adamw_kahan.kernel.adamw_kahan`.
      spec: the leaf's PartitionSpec (or a NamedSharding, whose spec is read); its axes must divide the leaf's
        dimensions, and with 8-bit moments leave every shard whole blocks of 128 of the last axis.
    """
    mesh = dispatch.kernel_mesh(None)
    spec = tuple(getattr(spec, "spec", spec))
    spec = spec + (None,) * (p.ndim - len(spec))
    if mesh is None or mesh.size == 1:
        return _adamw_kahan()(g, p, c, mv, scalars, words, scales, options=options)
    for dim, axes in enumerate(spec):
        dispatch.check_divisible(f"dimension {dim} of a {tuple(p.shape)} leaf", p.shape[dim], mesh, axes)
    eight = options.moments8 is not None
    if eight and p.ndim:
        check_whole_blocks(p.shape, spec, mesh)
    leaf, rep = PartitionSpec(*spec), PartitionSpec()
    run = _per_shard(spec, mesh.shape, tuple(p.shape), options)
    n_leaf = 5 if eight else 4  # g, p, c, mv (and the scales)
    fn = dispatch.shard_map(run, mesh, in_specs=(leaf,) * n_leaf + (rep, rep), out_specs=(leaf,) * (n_leaf - 1))
    return tuple(fn(g, p, c, mv, *((scales,) if eight else ()), scalars, words))
