"""kahan_adamw (fused) and adamw(update="kahan") (the chain) give the same bf16 params, compensation and moments
bit for bit over 120 steps, with a constant learning rate and with a cosine schedule.

Every product that feeds an addition goes through ``no_fma`` in both (the chain's weight decay ``wd·p`` and its
``−lr·u``, which XLA:CPU otherwise contracts into the next add, or into Kahan's ``u − c``, as one FMA)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lpt.optim as O
from lpt.optim.fused_adamw import kahan_adamw_moments

SHAPE = (256, 512)
STEPS = 120


def _u16(x):
    return np.asarray(x).view(np.uint16)


def _step(tx):
    @jax.jit
    def step(g, st, p):
        d, st = tx.update(g, st, p)
        return optax.apply_updates(p, d), st

    return step


@pytest.mark.parametrize("lr", [1e-2, optax.cosine_decay_schedule(1e-2, STEPS)], ids=["constant", "cosine"])
def test_fused_equals_chain_bit_for_bit_over_120_steps(lr):
    p0 = {"w": jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE), jnp.bfloat16)}
    kw = dict(weight_decay=0.1, seed=4)
    txs = {"fused": O.kahan_adamw(lr, **kw), "chain": O.adamw(lr, update="kahan", **kw)}
    steps = {k: _step(tx) for k, tx in txs.items()}
    p = dict.fromkeys(txs, p0)
    st = {k: tx.init(p0) for k, tx in txs.items()}
    rng = np.random.default_rng(1)
    moved = 0
    for i in range(STEPS):
        g = {"w": jnp.asarray(rng.standard_normal(SHAPE) * 10.0 ** rng.uniform(-3, 0), jnp.bfloat16)}
        before = p["fused"]["w"]
        for k in txs:
            p[k], st[k] = steps[k](g, st[k], p[k])
        moved += int(np.sum(_u16(p["fused"]["w"]) != _u16(before)))
        c_f, c_c = (_u16(O.find_compensation(st[k])["w"]) for k in ("fused", "chain"))
        np.testing.assert_array_equal(_u16(p["fused"]["w"]), _u16(p["chain"]["w"]), err_msg=f"params, step {i + 1}")
        np.testing.assert_array_equal(c_f, c_c, err_msg=f"compensation, step {i + 1}")
    mu, nu = kahan_adamw_moments(st["fused"])
    np.testing.assert_array_equal(np.asarray(mu["w"]), np.asarray(st["chain"][0].mu["w"], np.float32))
    np.testing.assert_array_equal(np.asarray(nu["w"]), np.asarray(st["chain"][0].nu["w"], np.float32))
    assert moved > 0.5 * SHAPE[0] * SHAPE[1]  # the params really move
    assert np.any(c_f != 0)  # and the compensation is in use
