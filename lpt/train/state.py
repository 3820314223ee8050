"""Train state: the model split into a static graph and plain-dict arrays, plus the optimizer state.

``nnx.split(model, nnx.Param, ...)`` gives ``(graphdef, params, rest)``. The state keeps ``params`` and ``rest`` as
plain nested dicts of arrays (``nnx.to_pure_dict``): they checkpoint as ordinary pytrees, restore onto any mesh,
and optax runs on them directly. ``ModelDef.merge(params, rest)`` rebuilds the module inside a jitted function.

Shardings come from the logical axis names on each ``nnx.Param`` (metadata ``out_sharding``) through the mesh rules;
optimizer-state subtrees that mirror the params tree (Adam moments, Kahan compensation) get the params' shardings,
everything else (counters, scalars) is replicated. The state is initialised directly in its sharded layout by a
jitted init with ``out_shardings`` (no full copy on one device first).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lpt import models
from lpt.models.partitioning import logical_axes_of
from lpt.train import guard as guard_lib
from lpt.train import mesh as mesh_lib
from lpt.train.config import Config


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: number of updates applied
    params: Any  # pure dict of nnx.Param arrays (stored dtype)
    rest: Any  # pure dict of the model's other variables
    opt_state: Any  # optax state (moments etc. mirror ``params``)
    guard: guard_lib.Guard  # the bad-step guard's statistics (replicated scalars; checkpointed in the metadata)

    def to_dict(self) -> dict:
        """The arrays a checkpoint holds (the guard goes into its JSON metadata: :mod:`lpt.train.guard`)."""
        return {"step": self.step, "params": self.params, "rest": self.rest, "opt_state": self.opt_state}

    @classmethod
    def from_dict(cls, d: dict, guard: guard_lib.Guard) -> TrainState:
        return cls(step=d["step"], params=d["params"], rest=d["rest"], opt_state=d["opt_state"], guard=guard)


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """Static half of the model: graph definition and abstract variable trees (to rebuild inside jit)."""

    graphdef: Any
    abstract_params: Any  # nnx.State of ShapeDtypeStruct
    abstract_rest: Any
    logical_params: Any  # pure dict: tuple of logical axis names or None per param

    def merge(self, params: dict, rest: dict) -> nnx.Module:
        p_state = jax.tree.map(lambda x: x, self.abstract_params)  # fresh Variables to fill
        r_state = jax.tree.map(lambda x: x, self.abstract_rest)
        nnx.replace_by_pure_dict(p_state, params)
        nnx.replace_by_pure_dict(r_state, rest)
        return nnx.merge(self.graphdef, p_state, r_state)


def _build(cfg: Config, seed: int) -> nnx.Module:
    with nnx.use_eager_sharding(False):
        return models.build_model(cfg.model, cfg.precision, rngs=nnx.Rngs(seed))


def make_model_def(cfg: Config) -> ModelDef:
    abstract_model = nnx.eval_shape(lambda: _build(cfg, cfg.train.seed))
    graphdef, params, rest = nnx.split(abstract_model, nnx.Param, ...)
    logical = nnx.to_pure_dict(jax.tree.map(logical_axes_of, params, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    return ModelDef(graphdef, params, rest, logical)


def _mirrors(tree, params_def) -> bool:
    try:
        return jax.tree.structure(tree) == params_def
    except Exception:
        return False


def _fitted(param_sharding: NamedSharding, leaf) -> NamedSharding:
    """The param's sharding for a state leaf that mirrors it: as is for a leaf of the param's shape; for another
    shape of the same rank (the block scales of 8-bit moments, ``shape[:-1] + (blocks,)``) each dim keeps its mesh
    axes only where they divide it (XLA then reduces a block split over shards across them); a scalar placeholder
    (a float32 leaf's compensation) is replicated."""
    shape = getattr(leaf, "shape", ())
    spec = tuple(param_sharding.spec) + (None,) * (len(shape) - len(param_sharding.spec))
    if len(spec) != len(shape):
        return NamedSharding(param_sharding.mesh, PartitionSpec())
    mesh_shape = param_sharding.mesh.shape
    fit = []
    for size, axes in zip(shape, spec, strict=True):
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        fit.append(axes if size % max(1, int(np.prod([mesh_shape[a] for a in names]))) == 0 else None)
    return NamedSharding(param_sharding.mesh, PartitionSpec(*fit))


def param_shardings(model_def: ModelDef, mesh: Mesh):
    """NamedShardings of the params (a pure dict like ``TrainState.params``) on ``mesh``, from their logical axes."""
    return mesh_lib.tree_shardings(model_def.logical_params, nnx.to_pure_dict(model_def.abstract_params), mesh)


def state_shardings(abstract_state: TrainState, model_def: ModelDef, mesh: Mesh) -> TrainState:
    """NamedShardings for every leaf of the train state on ``mesh`` (see module docstring)."""
    param_sh = param_shardings(model_def, mesh)
    params_def = jax.tree.structure(abstract_state.params)
    repl = mesh_lib.replicated(mesh)

    def opt_leaf(sub):
        if not _mirrors(sub, params_def):
            return jax.tree.map(lambda _: repl, sub)
        return jax.tree.map(_fitted, param_sh, sub)

    opt_sh = jax.tree.map(opt_leaf, abstract_state.opt_state, is_leaf=lambda x: _mirrors(x, params_def))
    return TrainState(
        step=repl,
        params=param_sh,
        rest=jax.tree.map(lambda _: repl, abstract_state.rest),
        opt_state=opt_sh,
        guard=jax.tree.map(lambda _: repl, abstract_state.guard),
    )


def init_fn(cfg: Config, tx: optax.GradientTransformation):
    """A function ``() -> TrainState`` building the model from ``cfg.train.seed`` (for jit/eval_shape)."""

    def init() -> TrainState:
        model = _build(cfg, cfg.train.seed)
        _, params, rest = nnx.split(model, nnx.Param, ...)
        params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
        opt_state = tx.init(params)
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=params, rest=rest, opt_state=opt_state, guard=guard_lib.init()
        )

    return init


def abstract_state(cfg: Config, tx: optax.GradientTransformation) -> TrainState:
    return jax.eval_shape(init_fn(cfg, tx))


def create_state(cfg: Config, tx: optax.GradientTransformation, shardings: TrainState) -> TrainState:
    """Initialise the train state directly in its sharded layout."""
    return jax.jit(init_fn(cfg, tx), out_shardings=shardings)()


def with_shardings(abstract: TrainState, shardings: TrainState) -> TrainState:
    """ShapeDtypeStructs carrying the target shardings (what orbax needs to restore onto a given mesh)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
