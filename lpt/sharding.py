"""Logical-axis sharding without Flax: the one rules table, the rules context, logical names -> ``PartitionSpec``.

Arrays carry *logical* axis names ("batch", "embed", "mlp", ...). Which mesh axes a name maps to is decided by a list
of rules ``((logical_name, mesh_axes), ...)`` where ``mesh_axes`` is a mesh axis name, a tuple of names or ``None``.
The first rule for a name whose mesh axes are all still unused in the current spec wins (MaxText's convention), so
``("batch", ("data", "fsdp"))`` and ``("embed", "fsdp")`` coexist: an activation ``("batch", "length", "embed")``
shards batch over data×fsdp and leaves embed replicated, while a weight ``("embed", "mlp")`` shards embed over fsdp
and mlp over tensor (FSDP + Megatron-style tensor parallelism).

* :data:`RULES`: the rules for the trainer's ``("data", "fsdp", "tensor")`` mesh (``lpt.train.mesh``), and the
  default of every lookup below.
* :func:`axis_rules`: context ``(mesh, rules)``; :func:`constrain` and the kernel wrappers
  (``lpt.attention``, ``lpt.fp8``) read it at trace time.
* :func:`logical_to_mesh`: names -> ``PartitionSpec`` with the given rules.
* :func:`kernel_spec`: names -> ``PartitionSpec`` on a kernel's mesh, with the rules in context (else
  :data:`RULES`), keeping only mesh axes that the mesh has.
* :func:`operand_spec`: the mesh axes a kernel splits an operand over: on a mesh with ``Explicit`` axes (the default of
  ``jax.make_mesh``) the operand's own sharding, read from its type, whatever the axes are called; on ``Auto`` axes
  :func:`rule_spec`: :func:`kernel_spec` after checking that the rules name every axis the mesh splits (an axis they
  do not name is a ValueError: the kernel would otherwise gather its operands onto every device).

This module imports only JAX: every layer (kernels' callers, models, train) may use it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

__all__ = [
    "LOGICAL_AXES",
    "RULES",
    "axis_rules",
    "constrain",
    "kernel_spec",
    "logical_to_mesh",
    "operand_spec",
    "rule_spec",
]

LOGICAL_AXES = ("batch", "length", "embed", "mlp", "heads", "kv_heads", "head_dim", "vocab", "layers")

# logical axis name -> mesh axes of the ("data", "fsdp", "tensor") mesh (first unused match wins; None = replicated)
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
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

_CONTEXT: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("lpt_axis_rules", default=None)


def _check_rules(rules) -> tuple:
    """``rules`` as a tuple of ``(name, mesh_axes)`` pairs; ValueError for a malformed rule."""
    rules = tuple(tuple(r) for r in rules)
    for rule in rules:
        if len(rule) != 2 or not isinstance(rule[0], str):
            raise ValueError(f"axis rule {rule!r} must be (logical_name: str, mesh_axes: str | tuple | None)")
    return rules


@contextlib.contextmanager
def axis_rules(mesh, rules: Sequence = RULES) -> Iterator[None]:
    """Within this context, logical names resolve on ``mesh`` with ``rules`` (read at trace time)."""
    token = _CONTEXT.set((mesh, _check_rules(rules)))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def logical_to_mesh(logical_axes: Sequence[str | None], rules: Sequence = RULES) -> PartitionSpec:
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


def kernel_spec(logical_axes: Sequence[str | None], mesh) -> PartitionSpec:
    """``logical_to_mesh`` on ``mesh`` with the rules of the :func:`axis_rules` context (else :data:`RULES`).

    Each rule keeps only the mesh axes ``mesh`` has (a rule left with none maps to replicated), so the same rules
    serve a ``("data",)`` mesh and the trainer's ``("data", "fsdp", "tensor")`` one."""
    ctx = _CONTEXT.get()
    rules = RULES if ctx is None else ctx[1]
    names = set(mesh.axis_names)
    kept = []
    for logical, mesh_axes in rules:
        axes = () if mesh_axes is None else (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        axes = tuple(a for a in axes if a in names)
        kept.append((logical, axes or None))
    return logical_to_mesh(logical_axes, kept)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical names; the identity outside :func:`axis_rules`."""
    if x.ndim != len(logical_axes):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match array of shape {x.shape}")
    ctx = _CONTEXT.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_mesh(logical_axes, rules)))


def explicit(mesh) -> bool:
    """True if every axis of ``mesh`` that splits anything (size > 1) is ``Explicit``: operands carry their sharding
    in their types (``jax.typeof(x).sharding``)."""
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    return all(types[a] == jax.sharding.AxisType.Explicit for a in mesh.axis_names if mesh.shape[a] > 1)


def rule_spec(logical_axes: Sequence[str | None], mesh, what: str) -> PartitionSpec:
    """:func:`kernel_spec`, after checking that the rules in effect name every axis ``mesh`` splits: an axis they do
    not name is a ValueError (``what`` names the call), since the kernel would gather its operands over it."""
    ctx = _CONTEXT.get()
    rules = RULES if ctx is None else ctx[1]
    named = {a for _, axes in rules if axes is not None for a in ((axes,) if isinstance(axes, str) else axes)}
    unknown = [a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in named]
    if unknown:
        raise ValueError(
            f"{what}: mesh axes {tuple(unknown)} are Auto and lpt's sharding rules do not name them, so the kernel "
            f"cannot tell what they split (it would gather its operands onto every device); make them Explicit "
            f"(jax.make_mesh's default: the kernel then follows the operands' shardings) or name them: "
            f"with lpt.sharding.axis_rules(mesh, [('batch', {unknown[0]!r}), ...])"
        )
    return kernel_spec(logical_axes, mesh)


def operand_spec(x, logical_axes: Sequence[str | None], mesh, what: str) -> PartitionSpec:
    """The mesh axes of each dim of ``x`` for a kernel that runs per shard on ``mesh``: its own sharding, read from
    its type, on Explicit axes (:func:`explicit`); else :func:`rule_spec` of ``logical_axes``."""
    if len(logical_axes) != x.ndim:
        raise ValueError(f"{what}: logical axes {tuple(logical_axes)} do not match an operand of shape {x.shape}")
    if not explicit(mesh):
        return rule_spec(logical_axes, mesh, what)
    spec = tuple(jax.typeof(x).sharding.spec)
    return PartitionSpec(*spec, *(None,) * (x.ndim - len(spec)))
