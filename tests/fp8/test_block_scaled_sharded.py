"""block_scaled_dot under a 2-device mesh equals the unsharded call (a subprocess with 2 host CPU devices).

The emulated GEMMs are plain XLA ops, so the partitioner splits them: tokens split over one axis (dW then sums the
shards' partials), K split (the forward sums partials; every block of 16 or 32 stays inside a shard of 64), N split
(dX sums partials). The NVFP4 tensor amax is a global max and the stochastic-rounding bits depend on each element's
global index, so the codes are the unsharded ones and only the order of f32 additions may differ: each output is
within ``(K + 4) · eps32 · (|a| @ |b|)`` of the unsharded one. The mesh axis is Auto, as the trainer's.
"""

import subprocess
import sys
import textwrap

from cpu_devices import cpu_env

_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from lpt.fp8 import block_scaled_dot

    assert jax.device_count() == 2
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((96, 128)) * np.exp(rng.standard_normal((96, 1))), jnp.float32)
    w = jnp.asarray(0.05 * rng.standard_normal((128, 64)), jnp.float32)
    g = jnp.asarray(1e-3 * rng.standard_normal((96, 64)), jnp.float32)
    key = jax.random.key(3)
    eps = float(np.finfo(np.float32).eps)

    def run(recipe, x, w, g):
        y, vjp = jax.vjp(lambda x, w: block_scaled_dot(x, w, recipe, key=key), x, w)
        return (y, *vjp(g))

    for recipe in ("mxfp8", "nvfp4"):
        f = jax.jit(run, static_argnums=0)
        want = [np.asarray(a, np.float64) for a in f(recipe, x, w, g)]
        mags = [np.abs(x) @ np.abs(w), np.abs(g) @ np.abs(w).T, np.abs(x).T @ np.abs(g)]
        for what, (xs, ws, gs) in {
            "tokens": (P("d", None), P(None, None), P("d", None)),
            "K": (P(None, "d"), P("d", None), P(None, None)),
            "N": (P(None, None), P(None, "d"), P(None, "d")),
        }.items():
            put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
            with jax.set_mesh(mesh):
                got = f(recipe, put(x, xs), put(w, ws), put(g, gs))
            for name, a, b, m in zip(("y", "dx", "dw"), got, want, mags):
                err = np.abs(np.asarray(a, np.float64) - b)
                k = {"y": 128, "dx": 64, "dw": 96}[name]
                assert np.all(err <= (k + 4) * eps * np.asarray(m) + 1e-37), (recipe, what, name, err.max())
            print(recipe, what, "OK")
    """
)


def test_sharded_equals_unsharded():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=cpu_env(2), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count(" OK") == 6, out.stdout
