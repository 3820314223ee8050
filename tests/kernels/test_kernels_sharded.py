"""Every Pallas kernel runs per shard under a mesh: sharded == unsharded, and it compiles without gathering.

* numbers: a subprocess with 4 host CPU devices (a 2x2 ("data", "tensor") mesh), the kernels interpreted; the
  outputs and gradients under ``jax.set_mesh`` with batch-sharded inputs equal the unsharded ones bit for bit
  (FP8: the results summed over shards by a psum within the f32 round-off of adding the chunk partials, see
  ``_FP8``); ``kahan_adamw(impl="pallas")`` on params split in several ways equals the unsharded update bit for bit.
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
from cpu_devices import cpu_env
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lpt import targets
from lpt.attention import dot_product_attention
from lpt.fp8 import blockwise_dot
from lpt.kernels.adamw_kahan import StepOptions
from lpt.kernels.adamw_kahan.kernel import adamw_kahan
from lpt.kernels.adamw_kahan.sharded import adamw_kahan_partitioned

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
            x, y = np.asarray(x).reshape(-1), np.asarray(y).reshape(-1)
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
        args = (put(q, P("data")), put(k, P("data")), put(v, P("data")), put(seg, P("data")), do)
        lowered = jax.jit(f).lower(*args)  # the program that runs below
        assert "sdy.manual_computation" in lowered.as_text(), "no shard_map around the attention kernels"
        out = lowered.compile()(*args)
    same(out, ref, "attention o, dq, dk, dv")
    # the user's own Explicit mesh: batch over "dp", heads over "tp" (read from the operands' types)
    user = jax.make_mesh((2, 2), ("dp", "tp"))
    uput = lambda x, spec: jax.device_put(x, NamedSharding(user, spec))
    with jax.set_mesh(user):
        args = [uput(x, P("dp", None, "tp")) for x in (q, k, v)]
        out = jax.jit(f)(*args, uput(seg, P("dp")), uput(do, P("dp", None, "tp")))
    same(out, ref, "attention o, dq, dk, dv on the user's explicit mesh")
    """
)


_FP8 = textwrap.dedent(
    """
    import lpt.sharding
    from lpt.fp8 import blockwise_dot, dequantize_blocks, dequantize_tiles, quantize_blocks, quantize_tiles
    from lpt.sharding import axis_rules
    # 2 x 128 tokens over "data"; K and N are 2 blocks of 128. A result whose contracted dim is not split is computed
    # by each shard exactly as on one device: bit for bit. One that is summed over shards (lax.psum) adds the shards'
    # f32 partials (each 128-chunk's dot as on one device), while one device accumulates the chunks inside the
    # kernel, where XLA:CPU may contract acc + partial * scale into an FMA: each chunk's partial then meets at most
    # 3 roundings (two scale products, one addition) on either side, so the two differ by <= 2γ_3·Σ_c |partial_c|
    # (|partial_c| + γ_127·Σ|its products| for the f32 partial, from the dequantized FP8 operands in f64).
    x = jnp.asarray(rng.standard_normal((2, 128, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 256)) * 0.05, jnp.float32)
    g = jnp.asarray(rng.standard_normal((2, 128, 256)), jnp.float32)
    f64 = lambda a: np.asarray(a, np.float64)
    x2, g2, e5m2 = x.reshape(256, 256), g.reshape(256, 256), jnp.float8_e5m2

    def tiles(a, dtype=jnp.float8_e4m3fn, axis=-1):
        return dequantize_tiles(*quantize_tiles(a, dtype, axis=axis), axis=axis)

    @jax.jit  # the dequantized FP8 operands of the three GEMMs, in one program
    def operands(x2, w, g2):
        return tiles(x2), dequantize_blocks(*quantize_blocks(w)), tiles(g2, e5m2), tiles(x2, axis=0), tiles(g2, e5m2, 0)

    xq, wq, gq, xt, gt = (f64(a) for a in operands(x2, w, g2))
    gamma = lambda n: n * 2.0**-24 / (1 - n * 2.0**-24)
    part = lambda a, b: np.abs(a @ b) + gamma(127) * (np.abs(a) @ np.abs(b))  # one 128-chunk's f32 partial
    halves = (slice(0, 128), slice(128, 256))
    chunk_sum = {  # Σ_c |partial_c| over the two chunks of each result's contracted dim
        "y": sum(part(xq[:, c], wq[c]) for c in halves).reshape(2, 128, 256),
        "dx": sum(part(gq[:, c], wq[:, c].T) for c in halves).reshape(2, 128, 256),
        "dw": sum(part(xt[c].T, gt[c]) for c in halves),
    }
    # w_axes -> which of (y, dx, dw) is psum-ed: None replicates w (dw over "data"); ("embed", "mlp") splits N
    # over "tensor" (dx too); ("mlp", "embed") splits K over "tensor" (y too).
    # FSDP: rules that store w's K over "data" (which the GEMM's rows take), w put there: each shard quantizes its
    # own rows of w, the codes are gathered, and dw is reduce-scattered back onto them.
    fsdp = [("batch", "data"), ("embed", "data"), ("mlp", "tensor")]
    cases = [
        (None, None, P(), (False, False, True)),
        (("embed", "mlp"), None, P(), (False, True, True)),
        (("mlp", "embed"), None, P(), (True, False, True)),
        (("embed", "mlp"), fsdp, P("data", "tensor"), (False, True, True)),
    ]
    for w_axes, rules, w_spec, summed in cases:
        def f(x, w, g):
            y, vjp = jax.vjp(lambda x, w: blockwise_dot(x, w, impl="pallas", w_axes=w_axes), x, w)
            return (y, *vjp(g))

        ref = jax.jit(f)(x, w, g)
        with jax.set_mesh(mesh), axis_rules(mesh, rules or lpt.sharding.RULES):
            args = (put(x, P("data")), put(w, w_spec), put(g, P("data")))
            lowered = jax.jit(f).lower(*args)  # the program that runs below
            assert "sdy.manual_computation" in lowered.as_text(), "no shard_map around the GEMMs"
            out = lowered.compile()(*args)
        if rules:
            assert out[2].sharding.spec == w_spec, out[2].sharding
        for name, a, b, psum in zip(("y", "dx", "dw"), out, ref, summed, strict=True):
            if psum:
                err = np.abs(f64(a) - f64(b))
                assert np.all(err <= 2 * gamma(3) * chunk_sum[name]), f"{w_axes} {name}: max {err.max()}"
                print(f"fp8 {w_axes} {rules} {name} close")
            else:
                same(a, b, f"fp8 {w_axes} {rules} {name}")
    """
)


_KAHAN = textwrap.dedent(
    """
    import lpt.optim as O
    # leaves split along their first dim, a middle dim, the last dim, over two axes at once, and not at all
    specs = {
        "a": ((64, 48), P("data", "tensor")),
        "b": ((8, 6, 32), P(None, "tensor", "data")),
        "c": ((40,), P(("data", "tensor"))),
        "d": ((16, 24), P(None, "data")),
        "e": ((8, 8), P()),
    }
    w = {k: jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for k, (s, _) in specs.items()}
    g = {k: jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for k, (s, _) in specs.items()}
    tx = O.kahan_adamw(1e-2, weight_decay=0.1, impl="pallas", sequential_leaves=False)  # stochastic moments
    st = tx.init(w)
    upd = jax.jit(tx.update)
    ref = upd(g, st, w)
    ref = upd(g, ref[1], w)
    sh = lambda t: {k: put(v, specs[k][1]) for k, v in t.items()}
    st_s = st._replace(moments=sh(st.moments), compensation=sh(st.compensation))
    with jax.set_mesh(mesh):
        compiled = upd.lower(sh(g), st_s, sh(w)).compile()  # the program both steps run
        hlo = compiled.as_text()
        assert hlo.count("all-gather") == 0 and hlo.count("all-reduce") == 0, "the update gathers the params"
        out = compiled(sh(g), st_s, sh(w))
        out = compiled(sh(g), out[1], sh(w))
    assert out[1].moments["b"].sharding.spec == P(None, "tensor", "data"), out[1].moments["b"].sharding
    same(out, ref, "kahan_adamw pallas, 2 steps")
    # the trainer's path: the param specs given, the kernel in a shard_map
    tx = O.kahan_adamw(1e-2, weight_decay=0.1, impl="pallas", sequential_leaves=False,
                       param_specs={k: s for k, (_, s) in specs.items()})
    upd = jax.jit(tx.update)
    with jax.set_mesh(mesh):
        compiled = upd.lower(sh(g), st_s, sh(w)).compile()  # the program both steps run
        hlo = compiled.as_text()
        assert hlo.count("all-gather") == 0 and hlo.count("all-reduce") == 0, "the update gathers the params"
        out = compiled(sh(g), st_s, sh(w))
        out = compiled(sh(g), out[1], sh(w))
    same(out, ref, "kahan_adamw pallas with param_specs, 2 steps")
    """
)


def _run(script: str) -> str:
    env = cpu_env(4)
    r = subprocess.run([sys.executable, "-c", _PRELUDE + script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


def test_attention_sharded_equals_unsharded_bitwise():
    assert "attention o, dq, dk, dv bitwise OK" in _run(_ATTENTION)


def test_fp8_sharded_equals_unsharded_bitwise():
    out = _run(_FP8)
    bitwise = ("None None y", "None None dx", "('embed', 'mlp') None y", "('mlp', 'embed') None dx")
    for line in (*bitwise, "('embed', 'mlp') [('batch', 'data'), ('embed', 'data'), ('mlp', 'tensor')] y"):
        assert f"fp8 {line} bitwise OK" in out, out
    assert out.count(" close") == 7, out


def test_kahan_adamw_pallas_sharded_equals_unsharded_bitwise():
    out = _run(_KAHAN)
    assert "kahan_adamw pallas, 2 steps bitwise OK" in out
    assert "kahan_adamw pallas with param_specs, 2 steps bitwise OK" in out


def _sds(shape, dtype, mesh, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _compile(f, args, mesh):
    """``f`` jitted and compiled for ``args``; under ``jax.set_mesh(mesh)``, or with ``mesh`` None for the device of
    the args' sharding without a mesh (``targets.lowering_for``)."""
    if mesh is None:
        with targets.lowering_for(args[0].sharding.mesh.devices.flat[0]):
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
    auto = (jax.sharding.AxisType.Auto,) * 2  # lpt's rules split the batch (the default type differs by jax version)
    mesh = jax.sharding.AbstractMesh((2, 2), ("data", "tensor"), axis_types=auto)
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


@pytest.mark.parametrize("topology,n", [("v5e:2x2", 4), ("h100:1x1x8", 8)], ids=["v5e", "h100"])
def test_fp8_weights_stored_split_travel_as_fp8_codes(topology, n):
    """FSDP (w's K over "fsdp", tokens over it too): each shard quantizes its own 128-row blocks, so the weight
    crosses the wire as e4m3 codes plus f32 block scales and dw is reduce-scattered back; the bf16 matmul under the
    same mesh (the baseline) gathers the bf16 weight. Bytes of all-gathers and collective-permutes (XLA:TPU turns
    some gathers into permutes) <= 0.55x the baseline's; no all-reduce carries a weight-sized dw."""
    from lpt.targets import hlo

    mesh = targets.mesh(topology, (n,), ("fsdp",))
    x = _sds((n, 128, 128 * n), jnp.bfloat16, mesh, P("fsdp"))
    w = _sds((128 * n, 512), jnp.bfloat16, mesh, P("fsdp", None))

    def bf16_fwd_bwd(x, w):
        y, vjp = jax.vjp(lambda x, w: jnp.einsum("bsk,kn->bsn", x, w).astype(x.dtype), x, w)
        return y, vjp(y)

    def moved(f):
        text = _compile(f, [x, w], mesh).as_text()
        c = hlo.collectives(text)
        return c["all-gather"]["bytes_per_step"] + c["collective-permute"]["bytes_per_step"], c, text

    fp8, c, text = moved(_fp8_fwd_bwd)
    bf16, _, _ = moved(bf16_fwd_bwd)
    assert fp8 <= 0.55 * bf16, (fp8, bf16)
    assert "f8e4m3fn[" in "".join(ln for ln in text.splitlines() if "all-gather" in ln)
    assert c["all-reduce"]["bytes_per_step"] < 128 * n * 512, c  # dw (f32, K x N) is reduce-scattered
    assert c["reduce-scatter"]["bytes_per_step"] > 0, c


def test_fp8_xla_impl_runs_per_shard_too():
    """The XLA twin under a mesh: without the shard_map the partitioner gathers the batch-split operand of dW's scan
    over token chunks inside the loop (once per chunk); with it nothing is gathered (TPU, 4 chips, 8 token chunks)."""
    mesh = targets.mesh("v5e:2x2", (4,), ("data",))
    args = [_sds((8, 128, 128), jnp.float32, mesh, P("data")), _sds((128, 256), jnp.float32, mesh, P())]

    def fwd_bwd(x, w):
        y, vjp = jax.vjp(lambda x, w: blockwise_dot(x, w, impl="xla", w_axes=("embed", "mlp")), x, w)
        return y, vjp(y)

    assert _all_gathers(_compile(fwd_bwd, args, None)) > 0  # control: no mesh in context
    assert _all_gathers(_compile(fwd_bwd, args, mesh)) == 0


def test_fp8_rejects_shards_that_split_a_block():
    auto = (jax.sharding.AxisType.Auto,) * 2  # the default axis type differs by jax version
    mesh = jax.sharding.AbstractMesh((2, 2), ("data", "tensor"), axis_types=auto)
    x, w = jnp.zeros((4, 128), jnp.float32), jnp.zeros((128, 128), jnp.float32)
    with pytest.raises(ValueError, match=r"N=128 split over mesh axes \('tensor',\) gives shards of 64"):
        jax.eval_shape(lambda x, w: blockwise_dot(x, w, impl="pallas", w_axes=("embed", "mlp"), mesh=mesh), x, w)


_ADAM = StepOptions(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, stochastic=True)


def _kahan_step(partitioned):
    def step(g, p, c, mv, scalars, words):
        run = adamw_kahan_partitioned if partitioned else adamw_kahan  # the control calls the kernel directly
        return run(g, p, c, mv, scalars, words, options=_ADAM)

    return step


def _kahan_args(mesh, spec):
    shape = (256, 512)
    leaf = [_sds(shape, dt, mesh, spec) for dt in (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, jnp.uint32)]
    return [*leaf, _sds((4,), jnp.float32, mesh, P()), _sds((2,), jnp.uint32, mesh, P())]


def test_kahan_adamw_shard_kernel_compiles_for_tpu():
    # The per-shard kernel, as the partition callback runs it on shard (1, 1) of a (512, 1024) leaf split 2 x 2:
    # Mosaic lowers the global index map (div/mod by the shard's dims). The partitioned call itself is checked on
    # GPUs below: with JAX_PLATFORMS=cpu jax registers custom_partitioning's partitioner only with the plugins it
    # discovers, which leaves out the compile-only libtpu ("Custom emitter for CustomSPMDPartitioning not found").
    mesh = jax.sharding.Mesh(list(targets.devices("v5e:2x2")[:1]), ("one",))

    def step(g, p, c, mv, scalars, words):
        offset = jnp.uint32(256 * 1024 + 512)
        return adamw_kahan(g, p, c, mv, scalars, words, options=_ADAM, shard=((512, 1024), offset))

    _compile(step, _kahan_args(mesh, P()), None)


def test_kahan_adamw_does_not_all_gather_on_gpus():
    mesh = targets.mesh("h100:1x1x8", (8,), ("data",))
    args = _kahan_args(mesh, P("data", None))
    assert _all_gathers(_compile(_kahan_step(False), args, None)) > 0  # control: XLA gathers the leaf
    assert _all_gathers(_compile(_kahan_step(True), args, None)) == 0


def test_kahan_adamw_with_param_specs_compiles_on_tpu_mesh_without_gathers():
    """The trainer's path (``param_specs``: a shard_map) partitions on the compile-only TPU too: one kernel per
    leaf, no all-gather, whatever the leaf's layout (split, split on a middle dim, replicated)."""
    import lpt.optim as O

    mesh = targets.mesh("v5e:2x2", (2, 2), ("data", "tensor"))
    specs = {"a": ((256, 512), P("data", "tensor")), "b": ((512,), P()), "c": ((8, 128, 256), P(None, None, "data"))}
    sh = {k: jax.sharding.NamedSharding(mesh, s) for k, (_, s) in specs.items()}
    w = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sh[k]) for k, (s, _) in specs.items()}
    tx = O.kahan_adamw(1e-2, weight_decay=0.1, impl="pallas", sequential_leaves=False, param_specs=sh)
    st = jax.eval_shape(tx.init, w)
    like = lambda tree: {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) for k, v in tree.items()}
    st = st._replace(moments=like(st.moments), compensation=like(st.compensation))
    rep = jax.sharding.NamedSharding(mesh, P())
    st = jax.tree.map(
        lambda x: x if x.sharding is not None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), st
    )
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(tx.update).lower(w, st, w).compile()
    assert compiled.as_text().count("tpu_custom_call") >= 3 and _all_gathers(compiled) == 0


# ----------------------------------------------------------------- the user's own mesh: foreign axis names
def _user_mesh(topology, shape, names, kind=jax.sharding.AxisType.Explicit):
    import numpy as np

    devs = np.asarray(targets.devices(topology), dtype=object).reshape(shape)
    return jax.sharding.Mesh(devs, names, axis_types=(kind,) * len(names))


_USER_MESHES = [("v5e:2x2", (4,), ("dp",)), ("h100:1x1x8", (4, 2), ("dp", "tp"))]


@pytest.mark.parametrize("topology,shape,names", _USER_MESHES, ids=["v5e-dp", "h100-dp-tp"])
def test_kernels_follow_the_users_explicit_mesh_without_gathering(topology, shape, names):
    """A mesh with the user's own axis names and Explicit axes (jax.make_mesh's default): attention (batch over "dp",
    heads over "tp") and the FP8 GEMM (rows over "dp", N over "tp") compile forward + backward per shard, no
    all-gather; the same operands under an Auto mesh of those names, which lpt's rules do not name, are refused."""
    mesh = _user_mesh(topology, shape, names)
    heads = names[1] if len(names) > 1 else None
    n = shape[0]
    qkv = [_sds((n, 128, 2 * len(names), 128), jnp.bfloat16, mesh, P("dp", None, heads)) for _ in range(3)]
    assert _all_gathers(_compile(_attention_fwd_bwd, qkv, mesh)) == 0
    x = _sds((n, 128, 128), jnp.float32, mesh, P("dp"))
    w = _sds((128, 128 * len(names)), jnp.float32, mesh, P(None, heads))
    assert _all_gathers(_compile(_fp8_fwd_bwd, [x, w], mesh)) == 0
    auto = _user_mesh(topology, shape, names, jax.sharding.AxisType.Auto)
    with pytest.raises(ValueError, match=r"mesh axes \('dp'.*are Auto and lpt's sharding rules do not name them"):
        _compile(_attention_fwd_bwd, [_sds(a.shape, a.dtype, auto, P("dp")) for a in qkv], auto)


def test_auto_mesh_with_the_users_rules_runs_per_shard():
    """An Auto mesh named by the user's own rules (lpt.sharding.axis_rules): per shard, no all-gather (H100 x 8);
    without the rules the same call is refused rather than gathered."""
    from lpt.sharding import axis_rules

    mesh = _user_mesh("h100:1x1x8", (8,), ("dp",), jax.sharding.AxisType.Auto)
    args = [_sds((8, 128, 2, 128), jnp.bfloat16, mesh, P("dp")) for _ in range(3)]
    with axis_rules(mesh, [("batch", "dp")]):
        assert _all_gathers(_compile(_attention_fwd_bwd, args, mesh)) == 0
    with pytest.raises(ValueError, match=r"lpt.sharding.axis_rules\(mesh, \[\('batch', 'dp'\)"):
        _compile(lambda q, k, v: _attention_fwd_bwd(q, k, v), args, mesh)  # a new function: jit traces it again


def test_attention_refuses_a_split_sequence():
    abstract = jax.sharding.AbstractMesh((2,), ("sp",), axis_types=(jax.sharding.AxisType.Explicit,))
    q = jax.ShapeDtypeStruct((2, 16, 2, 16), jnp.bfloat16, sharding=NamedSharding(abstract, P(None, "sp")))
    with jax.sharding.use_abstract_mesh(abstract):
        with pytest.raises(ValueError, match=r"q's sequence \(dim 1\) is split over \('sp',\)"):
            jax.eval_shape(lambda q: dot_product_attention(q, q, q, impl="pallas"), q)


def test_kahan_adamw_follows_the_users_explicit_mesh_without_param_specs():
    """kahan_adamw(impl="pallas") with no param_specs on an Explicit ("dp", "tp") mesh: each leaf's kernel runs per
    shard of the sharding in its type (split on both axes, replicated, split on its last dim); it compiles for TPU
    v5e (where the custom_partitioning fallback cannot) with no all-gather."""
    import lpt.optim as O

    mesh = _user_mesh("v5e:2x2", (2, 2), ("dp", "tp"))
    specs = {"a": ((256, 512), P("dp", "tp")), "b": ((512,), P()), "c": ((8, 128, 256), P(None, None, "dp"))}
    w = {k: _sds(s, jnp.bfloat16, mesh, spec) for k, (s, spec) in specs.items()}
    tx = O.kahan_adamw(1e-2, weight_decay=0.1, impl="pallas", sequential_leaves=False)
    with jax.set_mesh(mesh):
        compiled = jax.jit(tx.update).lower(w, jax.eval_shape(tx.init, w), w).compile()
    assert compiled.as_text().count("tpu_custom_call") >= 3 and _all_gathers(compiled) == 0


def test_kahan_adamw_on_a_tpu_auto_mesh_without_param_specs_says_to_pass_them():
    """On Auto axes without param_specs the kernel would go through custom_partitioning, which XLA:TPU cannot
    partition ("Custom emitter for CustomSPMDPartitioning not found", also on real TPUs): a one-line error at trace
    time instead; the same call with param_specs compiles per shard."""
    import lpt.optim as O

    mesh = _user_mesh("v5e:2x2", (4,), ("data",), jax.sharding.AxisType.Auto)
    w = {"a": _sds((256, 512), jnp.bfloat16, mesh, P("data"))}
    tx = O.kahan_adamw(1e-2, impl="pallas")
    state = jax.eval_shape(tx.init, w)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"TPU mesh with Auto axes needs param_specs"):
        jax.jit(tx.update).lower(w, state, w)
    tx = O.kahan_adamw(1e-2, impl="pallas", param_specs={"a": P("data")})
    with jax.set_mesh(mesh):
        compiled = jax.jit(tx.update).lower(w, state, w).compile()
    assert "tpu_custom_call" in compiled.as_text() and _all_gathers(compiled) == 0
