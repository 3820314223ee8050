"""The optax chain of a config: ``clip -> adamw(schedule) -> [update rule]``.

``precision.update_rule`` picks the last transform: ``"f32_master"`` has none (params are float32 and plain
``optax.apply_updates`` adds the update); ``"nearest" | "kahan" | "stochastic" | "norm_preserving"`` come from
``lpt.optim.update_rule(name, seed=..., diagnostics=True)``, which turns the AdamW update into exactly the change the
chosen rounding makes to the low-precision params. This module is the one place where that switch lives.

Learning rate: linear warmup from 0 to ``optim.lr`` over ``optim.warmup_steps``, then constant or cosine decay to
``0.1 * lr`` at ``train.steps``. Weight decay (decoupled, AdamW) applies only to matrices (ndim >= 2). Adam's moments
take the param dtype (bf16 params: bf16 moments), except for float8 params, where clipping and AdamW run on a float32
view (``f32_view``) and only the update rule touches the fp8 values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import lpt.optim


def make_schedule(optim_cfg, total_steps: int) -> optax.Schedule:
    """lr(step): linear warmup over ``warmup_steps`` then ``constant`` or ``cosine`` decay to lr/10."""
    warmup = max(min(int(optim_cfg.warmup_steps), total_steps - 1), 0)
    if optim_cfg.schedule == "constant":
        after = optax.constant_schedule(optim_cfg.lr)
    else:
        after = optax.cosine_decay_schedule(optim_cfg.lr, max(total_steps - warmup, 1), alpha=0.1)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, optim_cfg.lr, warmup), after], [warmup])


def update_rule_transform(update_rule: str, seed: int) -> optax.GradientTransformation | None:
    """The last transform of the chain for ``update_rule`` (None for f32_master)."""
    if update_rule == "f32_master":
        return None
    if update_rule not in lpt.optim.UPDATE_RULES:
        allowed = ", ".join(("f32_master", *lpt.optim.UPDATE_RULES))
        raise ValueError(f"precision.update_rule={update_rule!r}; allowed: {allowed}")
    return lpt.optim.update_rule(update_rule, seed=seed, diagnostics=True)


def f32_view(inner: optax.GradientTransformation) -> optax.GradientTransformation:
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


def make_optimizer(cfg) -> optax.GradientTransformation:
    """``optax.chain(clip_by_global_norm, adamw(schedule), update rule)`` from ``cfg.optim`` and ``cfg.precision``."""
    o = cfg.optim
    schedule = make_schedule(o, cfg.train.steps)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    parts = []
    if o.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(o.grad_clip))
    parts.append(optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask))
    last = update_rule_transform(cfg.precision.update_rule, cfg.train.seed)
    if cfg.precision.param_dtype.startswith("float8") and last is not None:
        parts = [f32_view(optax.chain(*parts))]  # fp8 params: moments and update in f32, rounded by ``last``
    if last is not None:
        parts.append(last)
    return optax.chain(*parts)


def optimizer_diagnostics(opt_state) -> dict:
    """Scalars of the update rule (``update/cancelled_fraction``, ``update/intended_norm``, ...); {} if none."""
    return dict(lpt.optim.get_diagnostics(opt_state))
