"""The jitted train and eval steps.

Loss: mean next-token cross entropy in float32, ``L = mean_{b,t} (logsumexp(z_bt) - z_bt[y_bt])`` over logits ``z``
that the model already returns in float32, plus the model's PQT bitwidth loss (``model.aux_loss()``, already scaled
by ``precision.pqt.loss_weight``) when a PQT method is on. The step key is ``fold_in(PRNGKey(train.seed), step)``
(microbatch ``i`` folds in ``i`` once more), so randomness depends on (seed, step) only, never on the mesh.

With ``optim.microbatches = m > 1`` the batch is split into m equal slices along the batch axis; gradients are
summed in float32 over a ``lax.scan`` and divided by m (cast back to the param dtype before the optimizer). With
``optim.fp8_gather = "step"`` the blockwise-FP8 layers' weights are quantized and moved to their GEMMs' layout (an
FSDP all-gather of e4m3 codes) once, before the microbatches, which all multiply those codes
(:func:`lpt.models.layers.fp8_gemm_weights`): the same numbers as quantizing in each microbatch, one gather per
step instead of one per microbatch (and per remat recompute), for the HBM of every FP8 layer's gathered codes.

Both steps are ``jax.jit``-ed with explicit in/out shardings; the train step donates the incoming state. Their bodies
are traced under :func:`on_mesh`: the logical-axis rules (``lpt.sharding.axis_rules``) and the mesh as the abstract
mesh (``jax.sharding.get_abstract_mesh()``), where the Pallas kernels find it and run per shard.

The diagnostics step (``make_diagnostics_step``) is a separate jitted forward pass with the model's probes on
(``lpt.models.activation_diagnostics``: FP8 underflow/subnormal fractions, scale range and GEMM SNR per layer kind,
attention repeated-max rate); the trainer calls it every ``train.diagnostics_every`` steps on the batch and the
params of the train step it precedes, with that step's key. The train step itself never records them (its jaxpr
is the same whether diagnostics are on or off).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

import lpt.optim
from lpt import models, sharding
from lpt.models import layers as model_layers
from lpt.train import guard as guard_lib
from lpt.train import mesh as mesh_lib
from lpt.train.config import Config, OptimConfig, TrainConfig
from lpt.train.optimizer import optimizer_diagnostics
from lpt.train.state import ModelDef, TrainState


@contextlib.contextmanager
def on_mesh(mesh: Mesh) -> Iterator[None]:
    """Trace-time context of a step body: the logical-axis rules on ``mesh`` and ``mesh`` as the abstract mesh."""
    with sharding.axis_rules(mesh, sharding.RULES), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        yield


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean over all tokens of ``logsumexp(z) - z[target]`` (float32 in, float32 out)."""
    if logits_BTV.dtype != jnp.float32:
        raise ValueError(f"logits must be float32 for the loss, got {logits_BTV.dtype}")
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    picked_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return jnp.mean(lse_BT - picked_BT)


def _model_diagnostics(model) -> dict:
    return {f"model/{k}": jnp.asarray(v, jnp.float32) for k, v in models.diagnostics(model).items()}


def grad_view(params):
    """What the loss is differentiated against: float8 leaves as float32 views, the rest as stored.

    JAX gives a cotangent the primal's dtype, so gradients w.r.t. float8 params would be float8 and most of them
    underflow to 0 (a tiny model's grad norm was exactly 0.0). The f32 view holds the same values (exact), so the
    forward pass is unchanged and the gradient keeps its precision; the update rule rounds into float8 at the end.
    """
    return jax.tree.map(lambda p: p.astype(jnp.float32) if p.dtype.itemsize == 1 else p, params)  # fp8 -> f32


def _fp8_model(model_def: ModelDef):
    """The model with abstract variables: what :func:`lpt.models.layers.fp8_linears` walks."""
    return nnx.merge(model_def.graphdef, model_def.abstract_params, model_def.abstract_rest)


def _fp8_layers(model_def: ModelDef) -> list:
    """The model's blockwise-FP8 ``Linear`` layers (:func:`lpt.models.layers.fp8_linears`)."""
    return model_layers.fp8_linears(_fp8_model(model_def))


def fp8_codes_bytes(optim: OptimConfig, model_def: ModelDef, mesh: Mesh) -> int:
    """Bytes per device of the FP8 codes and block scales that ``optim.fp8_gather="step"`` holds for a whole step
    (each FP8 layer's weight in its GEMM's layout: whole over fsdp, split over tensor); 0 with "microbatch"."""
    if optim.fp8_gather != "step":
        return 0
    model = _fp8_model(model_def)
    params = nnx.to_pure_dict(model_def.abstract_params)
    shapes = jax.eval_shape(lambda p: model_layers.fp8_gemm_weights(model, grad_view(p)), params)
    total = 0
    with on_mesh(mesh):
        for path, layer in model_layers.fp8_linears(model):
            spec = sharding.kernel_spec(("batch", *layer.axes), mesh)[1:]  # the GEMM's (K, N) split
            axes = [a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
            parts = math.prod(mesh.shape[a] for a in axes)
            gw = shapes[path]
            total += (gw.codes.size * gw.codes.dtype.itemsize + gw.scales.size * gw.scales.dtype.itemsize) // parts
    return total


def make_train_step(
    cfg: Config, model_def: ModelDef, tx: optax.GradientTransformation, schedule, mesh: Mesh, shardings: TrainState
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """``train_step(state, batch) -> (state, metrics)``: jitted, state donated, sharded per ``shardings``.

    Args:
      cfg: the run's :class:`lpt.train.config.Config` (seed, microbatches, bad-step policy, FP8 gather, PQT).
      model_def: the :class:`lpt.train.state.ModelDef` of the model.
      tx: the optimizer.
      schedule: the learning-rate schedule (a function of the step), logged as ``lr``.
      mesh: the device mesh.
      shardings: a :class:`lpt.train.state.TrainState` of the state's shardings.
    """
    seed_key = jax.random.PRNGKey(cfg.train.seed)
    m = cfg.optim.microbatches
    use_aux = cfg.precision.pqt.method != "none"
    skip = cfg.train.bad_step == "skip"

    prepare = cfg.optim.fp8_gather == "step" and bool(_fp8_layers(model_def))

    def loss_fn(params, rest, inputs_BT, targets_BT, key, prepared):
        if prepared:  # the FP8 layers multiply the step's codes; their gradients still reach the kernels
            params = model_layers.with_gemm_weights(params, prepared)
        model = model_def.merge(params, rest)
        logits_BTV = model(inputs_BT, key=key)
        ce = cross_entropy(logits_BTV, targets_BT)
        aux = model.aux_loss().astype(jnp.float32) if use_aux else jnp.zeros((), jnp.float32)
        return ce + aux, (ce, aux)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with on_mesh(mesh):
            key = jax.random.fold_in(seed_key, state.step)
            view = grad_view(state.params)
            # optim.fp8_gather="step": FP8 weights quantized and gathered here, once for all microbatches
            prepared = model_layers.fp8_gemm_weights(_fp8_model(model_def), view) if prepare else {}
            if m == 1:
                (_, (ce, aux)), grads = grad_fn(view, state.rest, batch["inputs"], batch["targets"], key, prepared)
            else:
                split = lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:])
                micro = (split(batch["inputs"]), split(batch["targets"]), jnp.arange(m))

                def body(acc, xs):
                    inputs, targets, i = xs
                    (_, (ce_i, aux_i)), g = grad_fn(
                        view, state.rest, inputs, targets, jax.random.fold_in(key, i), prepared
                    )
                    g_f32 = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc[0], g)  # grad dtype -> f32
                    return (g_f32, acc[1] + ce_i, acc[2] + aux_i), None

                zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
                z = jnp.zeros((), jnp.float32)
                (g_sum, ce_sum, aux_sum), _ = jax.lax.scan(body, (zeros, z, z), micro)
                grads = jax.tree.map(lambda g, p: (g / m).astype(p.dtype), g_sum, view)  # f32 -> grad dtype
                ce, aux = ce_sum / m, aux_sum / m
            grad_norm = optax.tree.norm(grads).astype(jnp.float32)
            good, guard = guard_lib.judge(state.guard, ce, grad_norm, cfg.train.spike_sigmas)

            def update(params, opt_state):
                updates, opt_state = tx.update(grads, opt_state, params)
                return lpt.optim.apply_updates(params, updates), opt_state  # f32 add, cast back to each param's dtype

            if skip:  # a bad step runs no update: params and optimizer state stay as they were (lpt.train.guard)
                params, opt_state = guard_lib.if_good(good, update, state.params, state.opt_state)
            else:
                params, opt_state = update(state.params, state.opt_state)
            new_state = TrainState(
                step=state.step + 1, params=params, rest=state.rest, opt_state=opt_state, guard=guard
            )
            finite = [jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)]
            metrics = {
                "loss": ce,
                "grad_norm": grad_norm,
                "lr": jnp.asarray(schedule(state.step), jnp.float32),
                "params_finite": jnp.all(jnp.stack(finite)).astype(jnp.float32),  # 1.0 iff no NaN/inf param
            }
            if use_aux:
                metrics["aux_loss"] = aux
            if skip:
                metrics["skipped"] = (~good).astype(jnp.float32)  # bool -> f32: 1.0 for a skipped step
                metrics["skipped_total"] = guard.skipped.astype(jnp.float32)  # int32 -> f32
                metrics["skipped_in_a_row"] = guard.in_a_row.astype(jnp.float32)  # int32 -> f32
            diag = optimizer_diagnostics(opt_state)
            metrics.update({f"{k}": jnp.asarray(v, jnp.float32) for k, v in diag.items()})
            metrics.update(_model_diagnostics(model_def.merge(params, state.rest)))
            return new_state, metrics

    return jax.jit(
        step,
        in_shardings=(shardings, mesh_lib.batch_sharding(mesh)),
        out_shardings=(shardings, mesh_lib.replicated(mesh)),
        donate_argnums=(0,),
    )


def make_eval_step(model_def: ModelDef, mesh: Mesh, shardings: TrainState):
    """``eval_step(params, rest, batch) -> mean cross entropy`` (no weight noise: key=None)."""

    def step(params, rest, batch):
        with on_mesh(mesh):
            model = model_def.merge(params, rest)
            return cross_entropy(model(batch["inputs"], key=None), batch["targets"])

    return jax.jit(
        step,
        in_shardings=(shardings.params, shardings.rest, mesh_lib.batch_sharding(mesh)),
        out_shardings=mesh_lib.replicated(mesh),
    )


def make_diagnostics_step(train: TrainConfig, model_def: ModelDef, mesh: Mesh, shardings: TrainState):
    """``diag_step(params, rest, batch, step) -> {"model/<name>": f32 scalar}`` from
    ``lpt.models.activation_diagnostics`` on ``batch["inputs"]`` with the key ``fold_in(PRNGKey(seed), step)``
    (the train step's key for step ``step``; with microbatches the train step folds in the microbatch index too)."""
    seed_key = jax.random.PRNGKey(train.seed)

    def step(params, rest, batch, step):
        with on_mesh(mesh):
            model = model_def.merge(params, rest)
            key = jax.random.fold_in(seed_key, step)
            stats = models.activation_diagnostics(model, batch["inputs"], key=key)
            return {f"model/{k}": v for k, v in stats.items()}

    repl = mesh_lib.replicated(mesh)
    return jax.jit(
        step,
        in_shardings=(shardings.params, shardings.rest, mesh_lib.batch_sharding(mesh), repl),
        out_shardings=repl,
    )
