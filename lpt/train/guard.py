"""The bad-step guard: which steps ``train.bad_step="skip"`` leaves out, from the loss and the gradient norm.

A step is **bad** when its loss or its global gradient norm is not finite, or, with ``train.spike_sigmas = k > 0``,
when either exceeds its running mean by more than ``k`` running standard deviations (after ``WARMUP`` good steps).
The running statistics are exponential moving averages over the good steps only (decay ``_DECAY``; West's update of
the variance), so a spike never raises the bar for the next one. The trainer keeps the parameters and the whole
optimizer state of a bad step as they were (Kahan compensation, moments, the stochastic-rounding counter: bit for
bit) and still advances the step and the data position; with ``train.bad_step="stop"`` it computes the same
statistics (so a run resumed with "skip" starts with them) and stops on a non-finite step as before.

:class:`Guard` is part of the train state (replicated f32/int32 scalars). Checkpoints hold it in their JSON metadata
(:func:`to_json` / :func:`from_json`: float32 values are exact in JSON's float64), so the arrays of a checkpoint are
those of the model and the optimizer only, and a checkpoint written without it resumes with fresh statistics.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

BAD_STEPS = ("stop", "skip")
_DECAY = 0.99  # of the running mean and variance: about the last 100 good steps
WARMUP = 20  # good steps needed to judge spikes


class Guard(NamedTuple):
    """Running statistics of the good steps and the skip counters (scalars)."""

    loss_mean: jax.Array  # f32
    loss_var: jax.Array  # f32
    norm_mean: jax.Array  # f32, of the global gradient norm
    norm_var: jax.Array  # f32
    good: jax.Array  # int32: good steps seen
    in_a_row: jax.Array  # int32: bad steps since the last good one
    skipped: jax.Array  # int32: bad steps in all


def init() -> Guard:
    z = jnp.zeros((), jnp.float32)
    n = jnp.zeros((), jnp.int32)
    return Guard(z, z, z, z, n, n, n)


def _ema(mean, var, x, first):
    """West's exponentially weighted mean and variance; the first value starts the mean with variance 0."""
    d = jnp.float32(_DECAY)
    delta = x - mean
    new_mean = jnp.where(first, x, mean + (1 - d) * delta)
    new_var = jnp.where(first, jnp.float32(0), d * (var + (1 - d) * delta * delta))
    return new_mean, new_var


def judge(g: Guard, loss: jax.Array, grad_norm: jax.Array, spike_sigmas: float) -> tuple[jax.Array, Guard]:
    """``(good, guard')`` for a step with f32 ``loss`` and ``grad_norm`` (module doc): ``good`` is a bool scalar;
    ``guard'`` has the statistics updated with this step if it is good, and the counters either way."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    good = finite
    if spike_sigmas > 0:
        k = jnp.float32(spike_sigmas)
        judged = g.good >= WARMUP
        spike = (loss - g.loss_mean > k * jnp.sqrt(g.loss_var)) | (grad_norm - g.norm_mean > k * jnp.sqrt(g.norm_var))
        good = finite & ~(judged & spike)
    first = g.good == 0
    loss_mean, loss_var = _ema(g.loss_mean, g.loss_var, loss, first)
    norm_mean, norm_var = _ema(g.norm_mean, g.norm_var, grad_norm, first)
    keep = lambda new, old: jnp.where(good, new, old)
    one = jnp.ones((), jnp.int32)
    return good, Guard(
        loss_mean=keep(loss_mean, g.loss_mean),
        loss_var=keep(loss_var, g.loss_var),
        norm_mean=keep(norm_mean, g.norm_mean),
        norm_var=keep(norm_var, g.norm_var),
        good=g.good + jnp.where(good, one, 0),
        in_a_row=jnp.where(good, 0, g.in_a_row + one),
        skipped=g.skipped + jnp.where(good, 0, one),
    )


def if_good(good: jax.Array, update, *operands):
    """``update(*operands)`` when the step is good, else ``operands`` as they are (exact: the old bits are kept).

    A conditional, not a select of the updated and the old state: a bad step runs no update, and a good one is the
    update alone, with no extra pass over the state that reads both versions and writes a third (on XLA:CPU, which
    has no multi-output fusion, that pass would also make each leaf's update compute its new moments twice)."""
    return jax.lax.cond(good, update, lambda *same: same, *operands)


def to_json(g: Guard) -> dict:
    """The guard as plain numbers for a checkpoint's JSON metadata (exact)."""
    return {k: (int(v) if jnp.issubdtype(v.dtype, jnp.integer) else float(v)) for k, v in g._asdict().items()}


def from_json(d: dict | None) -> Guard:
    """The guard of a checkpoint's metadata; a fresh one when the checkpoint has none."""
    if not d:
        return init()
    fresh = init()
    return Guard(**{k: jnp.asarray(d[k], getattr(fresh, k).dtype) for k in Guard._fields})
