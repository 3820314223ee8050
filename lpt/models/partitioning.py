"""Logical-axis sharding for NNX models: parameter specs from the logical names stored on ``nnx.Variable``.

Every parameter carries a tuple of logical axis names (``nnx.Param`` metadata ``out_sharding``), every large
activation passes through :func:`lpt.sharding.constrain` with its logical names. The rules table, the rules context,
``constrain`` and the name -> ``PartitionSpec`` mapping live in :mod:`lpt.sharding` (no Flax there, so the kernel
wrappers in ``lpt.attention`` and ``lpt.fp8`` use them too); this module adds what needs NNX: the specs and
shardings of a model's variables, and :func:`place`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lpt.sharding import RULES, logical_to_mesh

__all__ = ["logical_axes_of", "param_partition_specs", "param_shardings", "place"]


def logical_axes_of(variable: nnx.Variable) -> tuple | None:
    """The logical axis names stored on an ``nnx.Variable`` (None if it has none)."""
    meta = variable.get_metadata()
    axes = meta.get("out_sharding")
    return None if axes is None else tuple(axes)


def param_partition_specs(state, rules: Sequence):
    """A tree like ``state`` (an ``nnx.State`` from ``nnx.split``) of ``PartitionSpec`` from the logical names.

    Variables without logical names (e.g. RNG counters) are replicated.
    """

    def spec(v):
        if isinstance(v, nnx.Variable):
            axes = logical_axes_of(v)
            return v.replace(PartitionSpec() if axes is None else logical_to_mesh(axes, rules))
        return PartitionSpec()

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_shardings(state, mesh: Mesh, rules: Sequence):
    """Like :func:`param_partition_specs` but ``NamedSharding`` on ``mesh`` (use as jit in/out shardings)."""
    specs = param_partition_specs(state, rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def place(model, mesh: Mesh, rules: Sequence = RULES):
    """``(graphdef, state)`` of ``nnx.split(model)`` with every variable put on ``mesh`` by its logical axes
    (:func:`param_shardings`): a model sharded as the trainer shards it, for inference outside the trainer."""
    graphdef, state = nnx.split(model)
    return graphdef, jax.device_put(state, param_shardings(state, mesh, rules))
