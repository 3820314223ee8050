"""``dot_product_attention`` with the XLA twin (what ``impl="auto"`` runs on a CPU) under a user's Explicit mesh with
batch-sharded q, k, v: the scan carries take q's sharding, so the forward and the backward trace (a carry made with
``jnp.zeros`` was replicated while the step's outputs were sharded: a scan type error), and they return what the
unsharded call returns, within f32 round-off (the per-shard programs may add in another order). Two CPU devices, in a
subprocess."""

import subprocess
import sys
import textwrap

from cpu_devices import cpu_env

_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from lpt.attention import dot_product_attention

    mesh = jax.make_mesh((2,), ("dp",), (AxisType.Explicit,))
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (2, 64, 4, 32), jnp.float32)
    k = jax.random.normal(ks[1], (2, 64, 2, 32), jnp.float32)
    v = jax.random.normal(ks[2], (2, 64, 2, 32), jnp.float32)
    loss = lambda q, k, v: jnp.sum(dot_product_attention(q, k, v) ** 2)  # impl="auto": the twin on a CPU
    ref = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    with jax.set_mesh(mesh):
        put = lambda x: jax.device_put(x, NamedSharding(mesh, P("dp")))
        out = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(put(q), put(k), put(v))
    assert out[1][0].sharding.spec[0] == "dp", out[1][0].sharding  # dq stays batch-sharded
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 2.0**-18 * np.max(np.abs(a)), np.max(np.abs(a - b)) / np.max(np.abs(a))
    print("ok")
    """
)


def test_the_twin_runs_under_an_explicit_mesh_with_sharded_batch():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=cpu_env(2), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
