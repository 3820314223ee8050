"""lpt.optim.scale_by_adam has optax.scale_by_adam's signature and, on f32 params, its numbers."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cpu_compile import UNOPTIMIZED

import lpt.optim as O

# LLVM's optimizations off where the checks are error bounds far above f32 round-off, large differences, or equal
# results of one traced program
jit = functools.partial(jax.jit, compiler_options=UNOPTIMIZED)


def test_signature_starts_like_optax():
    ours = list(inspect.signature(O.scale_by_adam).parameters.values())
    theirs = list(inspect.signature(optax.scale_by_adam).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[: len(theirs)]] == [(p.name, p.kind, p.default) for p in theirs]


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"eps_root": 1e-8},
        {"nesterov": True},
        {"b1": 0.8, "b2": 0.99, "eps": 1e-6, "eps_root": 1e-4, "nesterov": True},
    ],
)
def test_f32_params_follow_optax(kw):
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.standard_normal((64, 32)), jnp.float32), "b": jnp.zeros((32,), jnp.float32)}
    ours, theirs = O.scale_by_adam(**kw), optax.scale_by_adam(**kw)
    s1, s2 = ours.init(p), theirs.init(p)
    for _ in range(20):
        g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), p)
        u1, s1 = jit(ours.update)(g, s1, p)
        u2, s2 = jit(theirs.update)(g, s2, p)
        for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    # the options change the result (the test could fail)
    if kw:
        u0, _ = jit(O.scale_by_adam().update)(g, O.scale_by_adam().init(p), p)
        u_kw, _ = jit(O.scale_by_adam(**kw).update)(g, O.scale_by_adam(**kw).init(p), p)
        assert not np.allclose(np.asarray(u0["w"]), np.asarray(u_kw["w"]))


def test_mu_dtype_sets_the_first_moment_only():
    p = {"w": jnp.ones((8, 8), jnp.bfloat16)}
    state = O.scale_by_adam(mu_dtype=jnp.float32).init(p)
    assert state.mu["w"].dtype == jnp.float32 and state.nu["w"].dtype == jnp.bfloat16
    state = O.scale_by_adam(moment_dtype=jnp.float32).init(p)
    assert state.mu["w"].dtype == state.nu["w"].dtype == jnp.float32


def test_add_decayed_weights_follows_optax_with_mask_schedule_and_none_leaves():
    ours = list(inspect.signature(O.add_decayed_weights).parameters)
    assert ours == list(inspect.signature(optax.add_decayed_weights).parameters)  # (weight_decay, mask)
    p = {"w": jnp.full((4, 4), 2.0, jnp.float32), "b": jnp.full((4,), 2.0, jnp.float32)}
    u = {"w": jnp.ones((4, 4), jnp.float32), "b": jnp.ones((4,), jnp.float32)}
    mask = {"w": True, "b": False}
    schedule = lambda count: 0.1 * (count + 1)
    for kw in (
        {"weight_decay": 0.1, "mask": mask},
        {"weight_decay": schedule},
        {"weight_decay": schedule, "mask": mask},
    ):
        tx_o, tx_r = O.add_decayed_weights(**kw), optax.add_decayed_weights(**kw)
        s_o, s_r = tx_o.init(p), tx_r.init(p)
        for _ in range(3):
            a, s_o = tx_o.update(u, s_o, p)
            b, s_r = tx_r.update(u, s_r, p)
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)
    assert float(a["b"][0]) == 1.0 and float(a["w"][0, 0]) > 1.5  # the mask kept "b" from decaying
    with_none = {"w": None, "b": jnp.ones((4,), jnp.float32)}
    out, _ = O.add_decayed_weights(0.1).update(with_none, O.add_decayed_weights(0.1).init(p), p)
    assert out["w"] is None and float(out["b"][0]) == pytest.approx(1.2)


@pytest.mark.parametrize("make", [O.adamw, O.kahan_adamw])
def test_mask_is_optax_name_and_weight_decay_mask_its_alias(make):
    p = {"w": jnp.full((4, 4), 2.0, jnp.bfloat16), "b": jnp.full((4,), 2.0, jnp.bfloat16)}
    g = jax.tree.map(jnp.zeros_like, p)
    mask = {"w": True, "b": False}
    a = make(1e-1, weight_decay=0.5, mask=mask)
    b = make(1e-1, weight_decay=0.5, weight_decay_mask=mask)
    ua, ub = jit(lambda g, p: (a.update(g, a.init(p), p)[0], b.update(g, b.init(p), p)[0]))(g, p)
    for x, y in zip(jax.tree.leaves(ua), jax.tree.leaves(ub), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert float(ua["b"][0]) == 0.0 and float(ua["w"][0, 0]) < 0.0  # only the masked-in leaf decays
    with pytest.raises(ValueError, match="give the weight-decay mask once"):
        make(1e-1, mask=mask, weight_decay_mask=mask)


def test_adamw_signature_starts_like_optax():
    ours = list(inspect.signature(O.adamw).parameters.values())
    theirs = list(inspect.signature(optax.adamw).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[: len(theirs)]] == [(p.name, p.kind, p.default) for p in theirs]


def test_adamw_f32_master_follows_optax_with_its_options():
    """On f32 params with the nearest rule (exact for f32), lpt's adamw is optax's adamw, options included."""
    rng = np.random.default_rng(1)
    p = {"w": jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)}
    args = (1e-2, 0.8, 0.99, 1e-6, 1e-4, jnp.float32, 0.1)  # lr, b1, b2, eps, eps_root, mu_dtype, weight_decay
    ours, theirs = O.adamw(*args, nesterov=True, update="nearest"), optax.adamw(*args, nesterov=True)
    s1, s2 = ours.init(p), theirs.init(p)
    p1 = p2 = p
    for _ in range(10):
        g = {"w": jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)}
        u1, s1 = jit(ours.update)(g, s1, p1)
        u2, s2 = jit(theirs.update)(g, s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    np.testing.assert_allclose(np.asarray(p1["w"]), np.asarray(p2["w"]), rtol=1e-5, atol=1e-6)
    plain = O.adamw(1e-2, 0.8, 0.99, 1e-6, weight_decay=0.1, update="nearest")  # without eps_root / nesterov
    s0, p0 = plain.init(p), p
    rng = np.random.default_rng(1)
    rng.standard_normal((32, 16))
    for _ in range(10):
        g = {"w": jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)}
        u0, s0 = jit(plain.update)(g, s0, p0)
        p0 = optax.apply_updates(p0, u0)
    assert float(jnp.max(jnp.abs(p0["w"] - p2["w"]))) > 1e-3  # the options change the result
