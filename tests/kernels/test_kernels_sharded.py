"""Every Pallas kernel runs per shard under a mesh: sharded == unsharded, and it compiles without gathering.

* numbers: a subprocess with 4 host CPU devices (a 2x2 ("data", "tensor") mesh), the kernels interpreted; the
  outputs and gradients under ``jax.set_mesh`` with batch-sharded inputs equal the unsharded ones bit for bit.
* compiles, deviceless (lpt.targets): on a TPU v5e 2x2 each kernel compiles inside a jit with batch-sharded inputs
  (without the shard_map Mosaic refuses: "cannot be automatically partitioned"); on an 8-GPU H100 node the compiled
  module has no all-gather, while the same call without a mesh (the control) all-gathers its operands.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lpt import targets
from lpt.attention import dot_product_attention
from lpt.fp8 import blockwise_dot

# Compile-only libtpu takes a lock meant for real TPUs; test processes running side by side must share it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

_PRELUDE = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))

    def same(a, b, what):
        for i, (x, y) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)):
            x, y = np.asarray(x), np.asarray(y)
            assert x.dtype == y.dtype and x.shape == y.shape, what
            bad = np.sum(x.view(np.uint8) != y.view(np.uint8))
            assert bad == 0, f"{what}: output {i}: {np.sum(x != y)} of {x.size} differ, max {np.max(abs(x - y))}"
        print(what, "bitwise OK")
    """
)

_ATTENTION = textwrap.dedent(
    """
    from lpt.attention import dot_product_attention
    q = jnp.asarray(rng.standard_normal((4, 32, 4, 16)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((4, 32, 2, 16)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((4, 32, 2, 16)), jnp.bfloat16)
    seg = jnp.asarray(np.repeat([[0, 1]], 16, axis=1).repeat(4, 0), jnp.int32)
    do = jnp.asarray(rng.standard_normal((4, 32, 4, 16)), jnp.bfloat16)

    def f(q, k, v, seg, do):
        o, vjp = jax.vjp(lambda q, k, v: dot_product_attention(q, k, v, impl="pallas", segment_ids=seg), q, k, v)
        return o, vjp(do)

    ref = jax.jit(f)(q, k, v, seg, do)
    with jax.set_mesh(mesh):  # batch over "data", heads and kv heads over "tensor" (lpt.sharding.RULES)
        text = jax.jit(f).lower(q, k, v, seg, do).as_text()
        assert "sdy.manual_computation" in text, "no shard_map around the attention kernels"
        out = jax.jit(f)(put(q, P("data")), put(k, P("data")), put(v, P("data")), put(seg, P("data")), do)
    same(out, ref, "attention o, dq, dk, dv")
    """
)


_FP8 = textwrap.dedent(
    """
    from lpt.fp8 import blockwise_dot
    # 2 x 128 tokens over "data"; K and N are 2 blocks of 128. A result whose contracted dim is not split is computed
    # by each shard exactly as on one device: bit for bit. One that is summed over shards (lax.psum) adds the shards'
    # f32 partials, while one device accumulates the K-chunks inside the kernel, where XLA:CPU contracts
    # acc + partial * scale into an FMA: the two differ by f32 round-off, asserted to 2^-20 of the largest value.
    x = jnp.asarray(rng.standard_normal((2, 128, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 256)) * 0.05, jnp.float32)
    g = jnp.asarray(rng.standard_normal((2, 128, 256)), jnp.float32)
    # w_axes -> which of (y, dx, dw) is psum-ed: None replicates w (dw over "data"); ("embed", "mlp") splits N
    # over "tensor" (dx too); ("mlp", "embed") splits K over "tensor" (y too).
    cases = {None: (False, False, True), ("embed", "mlp"): (False, True, True), ("mlp", "embed"): (True, False, True)}
    for w_axes, summed in cases.items():
        def f(x, w, g):
            y, vjp = jax.vjp(lambda x, w: blockwise_dot(x, w, impl="pallas", w_axes=w_axes), x, w)
            return (y, *vjp(g))

        ref = jax.jit(f)(x, w, g)
        with jax.set_mesh(mesh):
            assert "sdy.manual_computation" in jax.jit(f).lower(x, w, g).as_text(), "no shard_map around the GEMMs"
            out = jax.jit(f)(put(x, P("data")), put(w, P()), put(g, P("data")))
        for name, a, b, psum in zip(("y", "dx", "dw"), out, ref, summed, strict=True):
            if psum:
                a, b = np.asarray(a), np.asarray(b)
                np.testing.assert_allclose(a, b, rtol=0, atol=2.0**-20 * np.max(np.abs(b)), err_msg=f"{w_axes} {name}")
                print(f"fp8 {w_axes} {name} close")
            else:
                same(a, b, f"fp8 {w_axes} {name}")
    """
)


def _run(script: str) -> str:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _PRELUDE + script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


def test_attention_sharded_equals_unsharded_bitwise():
    assert "attention o, dq, dk, dv bitwise OK" in _run(_ATTENTION)


def test_fp8_sharded_equals_unsharded_bitwise():
    out = _run(_FP8)
    for line in ("None y bitwise", "None dx bitwise", "('embed', 'mlp') y bitwise", "('mlp', 'embed') dx bitwise"):
        assert f"fp8 {line} OK" in out, out
    assert out.count(" close") == 5, out


def _sds(shape, dtype, mesh, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _compile(f, args, mesh):
    """``f`` jitted and compiled for ``args``; under ``jax.set_mesh(mesh)`` unless ``mesh`` is None."""
    if mesh is None:
        return jax.jit(f).lower(*args).compile()
    with jax.set_mesh(mesh):
        return jax.jit(f).lower(*args).compile()


def _all_gathers(compiled) -> int:
    text = compiled.as_text()
    return text.count("all-gather(") + text.count("all-gather-start(")


def _attention_fwd_bwd(q, k, v):
    o, vjp = jax.vjp(lambda q, k, v: dot_product_attention(q, k, v, impl="pallas"), q, k, v)
    return o, vjp(o)


def _attention_args(mesh, n):
    return [_sds((n, 128, 2, 128), jnp.bfloat16, mesh, P("data")) for _ in range(3)]


def test_attention_compiles_on_tpu_mesh():
    mesh = targets.mesh("v5e:2x2", (4,), ("data",))
    args = _attention_args(mesh, 4)
    with pytest.raises(NotImplementedError, match="cannot be automatically partitioned"):
        _compile(_attention_fwd_bwd, args, None)
    _compile(_attention_fwd_bwd, args, mesh)


def test_attention_does_not_all_gather_on_gpus():
    mesh = targets.mesh("h100:1x1x8", (8,), ("data",))
    args = _attention_args(mesh, 8)
    assert _all_gathers(_compile(_attention_fwd_bwd, args, None)) > 0  # control: XLA gathers q, k, v
    assert _all_gathers(_compile(_attention_fwd_bwd, args, mesh)) == 0


def test_attention_rejects_uneven_split():
    mesh = jax.sharding.AbstractMesh((2, 2), ("data", "tensor"))
    q = jnp.zeros((3, 16, 4, 16), jnp.bfloat16)
    kv = jnp.zeros((3, 16, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"batch=3 is not divisible by mesh axes \('data',\) of size 2"):
        jax.eval_shape(lambda q, k: dot_product_attention(q, k, k, impl="pallas", mesh=mesh), q, kv)


def _fp8_fwd_bwd(x, w):
    y, vjp = jax.vjp(lambda x, w: blockwise_dot(x, w, impl="pallas", w_axes=("embed", "mlp")), x, w)
    return y, vjp(y)


def _fp8_args(mesh, n):
    return [_sds((n, 128, 128), jnp.float32, mesh, P("data")), _sds((128, 128), jnp.float32, mesh, P())]


def test_fp8_compiles_on_tpu_mesh():
    mesh = targets.mesh("v5e:2x2", (4,), ("data",))
    args = _fp8_args(mesh, 4)
    with pytest.raises(NotImplementedError, match="cannot be automatically partitioned"):
        _compile(_fp8_fwd_bwd, args, None)
    _compile(_fp8_fwd_bwd, args, mesh)


def test_fp8_does_not_all_gather_activations_on_gpus():
    mesh = targets.mesh("h100:1x1x8", (8,), ("data",))
    args = _fp8_args(mesh, 8)
    assert _all_gathers(_compile(_fp8_fwd_bwd, args, None)) > 0  # control: XLA gathers x's rows
    assert _all_gathers(_compile(_fp8_fwd_bwd, args, mesh)) == 0


def test_fp8_rejects_shards_that_split_a_block():
    mesh = jax.sharding.AbstractMesh((2, 2), ("data", "tensor"))
    x, w = jnp.zeros((4, 128), jnp.float32), jnp.zeros((128, 128), jnp.float32)
    with pytest.raises(ValueError, match=r"N=128 split over mesh axes \('tensor',\) gives shards of 64"):
        jax.eval_shape(lambda x, w: blockwise_dot(x, w, impl="pallas", w_axes=("embed", "mlp"), mesh=mesh), x, w)
