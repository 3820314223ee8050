"""The optimizer of a config: AdamW with the learning-rate schedule, clipping and ``precision.update_rule``.

``precision.update_rule`` decides how the AdamW update reaches the stored params (this module builds the optimizer of
each rule; :attr:`lpt.models.Precision.store_dtype` derives the parameters' storage from the same rule):

* ``"f32_master"``: params are float32; ``optax.chain(clip, optax.adamw)`` with f32 moments and plain
  ``optax.apply_updates``.
* ``"kahan"`` with 16-bit params: :func:`lpt.optim.kahan_adamw`, AdamW + Kahan-compensated update as one fused
  transform (bf16 moments and compensation, 8 bytes/param; the same numbers as the chain below with
  ``update="kahan"``, in fewer passes over memory; timings in docs/results.md). Its
  leaves are sequenced (bounded f32 temporaries) on one device and not on a multi-device mesh, where sequencing
  would cost a scalar collective per leaf. ``precision.update_impl="pallas"`` runs it as the Pallas kernel
  (:mod:`lpt.kernels.adamw_kahan.kernel`: one pass per leaf on GPU/TPU, the Pallas interpreter on CPU; bf16 params
  only).
* ``"nearest" | "stochastic" | "norm_preserving"`` with 16-bit params: :func:`lpt.optim.adamw`, i.e.
  ``clip -> lpt.optim.scale_by_adam -> decoupled decay (f32) -> -lr -> rule``.
* float8 params (any rule): AdamW runs on a float32 view (``_f32_view``: fp8 moments would underflow) and only the
  update rule touches the fp8 values.

Both 16-bit paths keep Adam's moments in the param dtype (or ``precision.moment_dtype``), computed in f32 and stored
with ``precision.moment_rounding`` (``"stochastic"`` by default: ``optax.adamw`` on bf16 params rounds the moments to
nearest, so with ``b2 = 0.999`` the second moment can never decay: ``0.999·v`` rounds back to ``v``). So the 16-bit
recipes differ from each other only in the update rule.

Learning rate: linear warmup from 0 to ``optim.lr`` over ``optim.warmup_steps``, then constant or cosine decay to
``0.1 * lr`` at ``train.steps``. Weight decay (decoupled, AdamW) applies only to matrices (ndim >= 2). All
update rules are built with ``diagnostics=True`` (cancelled fraction, intended and applied norm in the metrics).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import lpt.optim
from lpt.train.config import Config, OptimConfig


def make_schedule(optim_cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """lr(step): linear warmup over ``warmup_steps`` then ``constant`` or ``cosine`` decay to lr/10."""
    warmup = max(min(int(optim_cfg.warmup_steps), total_steps - 1), 0)
    if optim_cfg.schedule == "constant":
        after = optax.constant_schedule(optim_cfg.lr)
    else:
        after = optax.cosine_decay_schedule(optim_cfg.lr, max(total_steps - warmup, 1), alpha=0.1)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, optim_cfg.lr, warmup), after], [warmup])


def _update_rule_transform(update_rule: str, seed: int) -> optax.GradientTransformation | None:
    """The last transform of the chain for ``update_rule`` (None for f32_master)."""
    if update_rule == "f32_master":
        return None
    return lpt.optim.update_rule(update_rule, seed=seed, diagnostics=True)


def _f32_view(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Run ``inner`` on float32 copies of the gradients and params (its state, e.g. Adam moments, is float32).

    Used for float8 params: Adam's moments in e4m3/e5m2 would underflow (eps = 1e-8 rounds to 0, 0/0 = NaN) and JAX
    refuses implicit fp8 promotion. The returned updates are float32; the update rule after it rounds them into fp8.
    """
    to_f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # fp8 -> f32 (exact)

    def init(params):
        return inner.init(to_f32(params))

    def update(grads, state, params=None):
        return inner.update(to_f32(grads), state, None if params is None else to_f32(params))

    return optax.GradientTransformation(init, update)


def make_optimizer(cfg: Config, mesh_size: int = 1, param_shardings=None) -> optax.GradientTransformation:
    """The AdamW of ``cfg.optim`` with ``cfg.precision``'s update rule (see the module docstring), for a mesh of
    ``mesh_size`` devices (on one device the fused Kahan step updates its leaves in sequence, which bounds its f32
    temporaries; on a mesh that ordering would cost a collective per leaf). ``param_shardings`` (the params'
    NamedShardings) lets ``update_impl="pallas"`` run its kernel per shard in a ``shard_map``."""
    o, p = cfg.optim, cfg.precision
    schedule = make_schedule(o, cfg.train.steps)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
    clip = o.grad_clip if o.grad_clip > 0 else None
    last = _update_rule_transform(p.update_rule, cfg.train.seed)  # None for f32_master
    hyper = dict(b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask)
    if last is not None and not p.param_dtype.startswith("float8"):  # 16-bit params: lpt's AdamW
        moments = dict(
            moment_rounding=p.moment_rounding, moment_dtype=None if p.moment_dtype == "auto" else p.moment_dtype
        )
        lpt_kw = dict(hyper, **moments, grad_clip=clip, seed=cfg.train.seed, diagnostics=True)
        if p.update_rule == "kahan":
            impl = cfg.precision.update_impl
            specs = param_shardings if impl == "pallas" else None
            return lpt.optim.kahan_adamw(
                schedule, **lpt_kw, sequential_leaves=mesh_size == 1, impl=impl, param_specs=specs
            )
        return lpt.optim.adamw(schedule, **lpt_kw, update=p.update_rule)
    parts = [] if clip is None else [optax.clip_by_global_norm(clip)]
    parts.append(optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask))
    if last is None:  # f32_master
        return optax.chain(*parts)
    return optax.chain(_f32_view(optax.chain(*parts)), last)  # fp8 params: moments and update in f32, rounded by last


def optimizer_diagnostics(opt_state) -> dict:
    """Scalars of the update rule (``update/cancelled_fraction``, ``update/intended_norm``, ...); {} if none."""
    return dict(lpt.optim.get_diagnostics(opt_state))
