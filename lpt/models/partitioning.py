"""Logical-axis sharding: names in the model, mesh axes from rules.

Every parameter carries a tuple of logical axis names (``nnx.Param`` metadata ``out_sharding``), every large
activation passes through :func:`constrain` with its logical names. Which mesh axis a logical name maps to is decided
by a list of rules ``((logical_name, mesh_axes), ...)`` where ``mesh_axes`` is a mesh axis name, a tuple of names or
``None``. The first rule for a name whose mesh axes are all still unused in the current spec wins (MaxText's
convention), so ``("batch", ("data", "fsdp"))`` and ``("embed", "fsdp")`` can coexist: an activation
``("batch", "length", "embed")`` shards batch over data×fsdp and leaves embed replicated, while a parameter
``("embed", "mlp")`` shards embed over fsdp.

Usage (the trainer)::

    with partitioning.axis_rules(mesh, rules):
        logits = jax.jit(step, in_shardings=..., out_shardings=...)(...)

Outside that context :func:`constrain` is the identity, so the model runs unchanged on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LOGICAL_AXES = ("batch", "length", "embed", "mlp", "heads", "kv_heads", "head_dim", "vocab", "layers")

# A reasonable default for meshes with axes ("data", "fsdp", "tensor"); the trainer may pass its own.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("layers", None),
)

_CONTEXT: contextvars.ContextVar[tuple[Mesh, tuple] | None] = contextvars.ContextVar("lpt_axis_rules", default=None)


def _check_rules(rules) -> tuple:
    rules = tuple(tuple(r) for r in rules)
    for rule in rules:
        if len(rule) != 2 or not isinstance(rule[0], str):
            raise ValueError(f"axis rule {rule!r} must be (logical_name: str, mesh_axes: str | tuple | None)")
    return rules


@contextlib.contextmanager
def axis_rules(mesh: Mesh, rules: Sequence) -> Iterator[None]:
    """Within this context, :func:`constrain` shards activations on ``mesh`` according to ``rules``."""
    token = _CONTEXT.set((mesh, _check_rules(rules)))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_rules() -> tuple | None:
    """The ``(mesh, rules)`` pair of the innermost :func:`axis_rules` context, or None."""
    return _CONTEXT.get()


def logical_to_mesh(logical_axes: Sequence[str | None], rules: Sequence) -> PartitionSpec:
    """Map logical axis names to a ``PartitionSpec``; unmatched names (and None) stay replicated."""
    rules = _check_rules(rules)
    used: set[str] = set()
    spec = []
    for name in logical_axes:
        chosen = None
        if name is not None:
            for logical, mesh_axes in rules:
                if logical != name:
                    continue
                if mesh_axes is None:
                    break
                axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
                if used.isdisjoint(axes):
                    chosen = axes[0] if len(axes) == 1 else axes
                    used.update(axes)
                    break
        spec.append(chosen)
    return PartitionSpec(*spec)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical names; the identity outside :func:`axis_rules`."""
    if x.ndim != len(logical_axes):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match array of shape {x.shape}")
    ctx = _CONTEXT.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_mesh(logical_axes, rules)))


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
