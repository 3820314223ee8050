"""Compensated micro-batch accumulation, f32-checkpoint conversion, and sharding-invariant stochastic rounding."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
from cpu_devices import cpu_env

import lpt.optim as O
from lpt.optim import accumulation


def test_compensated_accumulation_keeps_small_microbatch_gradients():
    rng = np.random.default_rng(0)
    big = rng.uniform(1.0, 2.0, (512,)).astype(np.float32)  # one large micro-batch gradient
    small = (1e-3 * rng.uniform(0.5, 1.5, (255, 512))).astype(np.float32)  # many small ones (< half an ulp)
    grads = [big] + list(small)
    truth = np.sum(np.asarray(grads, np.float64), axis=0)

    @jax.jit
    def compensated(gs):
        acc = accumulation.compensated_sum_init(gs[0], jnp.bfloat16)
        acc = jax.lax.fori_loop(0, gs.shape[0], lambda i, a: accumulation.compensated_sum_add(a, gs[i]), acc)
        return accumulation.compensated_sum_value(acc), accumulation.compensated_sum_mean(acc)

    @jax.jit
    def naive(gs):  # bf16 running sum, rounded to nearest after every add
        return jax.lax.fori_loop(
            0, gs.shape[0], lambda i, s: s + gs[i].astype(jnp.bfloat16), jnp.zeros(512, jnp.bfloat16)
        )

    gs = jnp.asarray(np.stack(grads))
    total, mean = compensated(gs)
    err_comp = np.max(np.abs(np.asarray(total) - truth) / truth)
    err_naive = np.max(np.abs(np.asarray(naive(gs), np.float32) - truth) / truth)
    assert err_comp < 2e-4, err_comp  # ~16 significant bits
    assert err_naive > 3e-2, err_naive  # the small gradients were rounded away
    np.testing.assert_allclose(np.asarray(mean), truth / 256, rtol=2e-4)


def test_f32_checkpoint_round_trip_and_continuation():
    rng = np.random.default_rng(1)
    w32 = {
        "w": jnp.asarray(rng.uniform(-2, 2, (64, 64)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal(8), jnp.float32),
    }
    params, comp = O.compensation_from_f32(w32, jnp.bfloat16)
    assert params["w"].dtype == jnp.bfloat16
    back = O.to_f32(params, comp)
    rel = np.max(np.abs(np.asarray(back["w"]) - np.asarray(w32["w"])) / np.abs(np.asarray(w32["w"])))
    assert rel < 2.0**-15, rel  # bf16 value + bf16 compensation ≈ 16 bits
    naive_rel = np.max(
        np.abs(np.asarray(params["w"], np.float32) - np.asarray(w32["w"])) / np.abs(np.asarray(w32["w"]))
    )
    assert naive_rel > 2.0**-10

    # continue training from the converted state: tracks the f32 trajectory better than starting from c = 0
    tx = O.kahan_summation()
    u = {"w": jnp.full((64, 64), 1e-4, jnp.float32), "b": jnp.zeros(8, jnp.float32)}

    def run(state):
        p = params
        for _ in range(50):
            d, state = tx.update(u, state, p)
            p = optax.apply_updates(p, d)
        return np.asarray(O.to_f32(p, O.find_compensation(state))["w"])

    truth = np.asarray(w32["w"]) + 50 * 1e-4
    st0 = optax.chain(optax.identity(), tx).init(params)
    converted = O.replace_compensation(st0, comp)[1]
    err_conv = np.max(np.abs(run(converted) - truth))
    err_zero = np.max(np.abs(run(tx.init(params)) - truth))
    assert err_conv < err_zero / 10, (err_conv, err_zero)


_SHARDED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import lpt.optim as O
    p = {"w": jnp.ones((64, 32), jnp.bfloat16)}
    u = {"w": jnp.full((64, 32), 1e-3, jnp.float32)}
    tx = O.stochastic_rounding(seed=3)
    st = tx.init(p)
    ref = jax.jit(tx.update)(u, st, p)[0]["w"]
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    sh = NamedSharding(mesh, P("a", "b"))
    ps, us = jax.device_put(p, sh), jax.device_put(u, sh)
    out = jax.jit(tx.update, out_shardings=(sh, None))(us, st, ps)[0]["w"]
    assert len(out.sharding.device_set) == 4
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    # kahan_adamw: its state (packed moments, compensation) shards like the params; sharded == unsharded
    w = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((64, 32)), jnp.bfloat16)}
    g = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((64, 32)), jnp.bfloat16)}
    tx = O.kahan_adamw(1e-2, weight_decay=0.1, sequential_leaves=False)
    st = tx.init(w)
    ref_d, ref_st = jax.jit(tx.update)(g, st, w)
    put = lambda t: jax.tree.map(lambda x: jax.device_put(x, sh if x.ndim == 2 else NamedSharding(mesh, P())), t)
    out_d, out_st = jax.jit(tx.update)(put(g), put(st), put(w))
    assert len(out_st.moments["w"].sharding.device_set) == 4 and len(out_st.compensation["w"].sharding.device_set) == 4
    for a, b in zip(jax.tree.leaves((out_d, out_st)), jax.tree.leaves((ref_d, ref_st))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    print("OK", float(jnp.mean(ref)))
    """
)


def test_stochastic_rounding_and_kahan_adamw_are_sharding_invariant():
    env = cpu_env(4)
    r = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "OK" in r.stdout
