"""The fused AdamW + Kahan kernel with 8-bit moments (FP8 codes, one f32 scale per block of 128 of the last axis).

* numbers: the kernel (interpret mode) equals ``kahan_adamw(impl="xla", moment_dtype="float8_e4m3fn")`` bit for bit
  in params, compensation, codes and scales over 2 steps, nearest and stochastic; its XLA twin for every 8-bit
  format; its rounding and code conversions equal lpt.numerics' (the XLA path calls the same functions);
* sharded (a subprocess with 4 host CPU devices): per shard, through custom_partitioning and through param_specs'
  shard_map, equal to unsharded (stochastic moments), with no all-gather or all-reduce;
* compiles, deviceless (lpt.targets): a sharded 8-bit step for a TPU v5e 2x2 (shard_map: param_specs and the user's
  Explicit mesh) and an 8-GPU H100 node (custom_partitioning), with the kernel's custom call and no all-gather;
* bytes moved per parameter as the kernel declares them (14.125 against 16-bit moments' 18), and the one-line errors.
"""

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from cpu_compile import UNOPTIMIZED
from cpu_devices import cpu_env
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lpt.optim as O
from lpt import targets
from lpt.kernels.adamw_kahan import StepOptions
from lpt.kernels.adamw_kahan import math as K
from lpt.kernels.adamw_kahan.kernel import adamw_kahan
from lpt.kernels.adamw_kahan.sharded import adamw_kahan_on_shards
from lpt.numerics import hash_bits, round_nearest, round_stochastic
from lpt.optim import moments8 as M8

# Compile-only libtpu takes a lock meant for real TPUs; test processes running side by side must share it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

E4M3 = "float8_e4m3fn"
HP = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
FORMATS = ["float8_e4m3fn", "float8_e5m2"]


def _bits_equal(a, b, what=""):
    a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    assert a.dtype == b.dtype and a.shape == b.shape, what
    bad = int(np.sum(a.view(np.uint8) != b.view(np.uint8)))
    assert bad == 0, f"{what}: {np.sum(a != b)} of {a.size} differ"


def _spread(shape, seed):
    """Values over 12 decades with both signs, zeros, and f32 extremes: every rounding path of an 8-bit format."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-8, 4, shape)
    x.reshape(-1)[:6] = [0.0, -0.0, np.inf, -np.inf, np.nan, 3e38]
    return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rounding_and_codes_equal_lpt_numerics(fmt):
    """round_fp8 (what the kernel and moments8 round with) equals round_nearest / round_stochastic(saturate=True) for
    the same random word, and fp8_code / fp8_value are the format's bit patterns (every one of the 256 codes)."""
    x = _spread((4096,), 0)
    key = jax.random.key(7)
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(jnp.dtype(fmt)).astype(np.float32)  # ml_dtypes' decoding
    nan = np.isnan(values)

    def both(x, codes, finite_values):  # lpt's conversions and the kernel's, one program
        q = round_nearest(x, fmt, saturate=True)  # XLA's own float8 array
        return {
            "nearest": (K.round_fp8(x, fmt), round_nearest(x, fmt, saturate=True, out_dtype=jnp.float32)),
            "stochastic": (
                K.round_fp8(x, fmt, hash_bits(key, x.shape)),
                round_stochastic(x, fmt, key, saturate=True, out_dtype=jnp.float32),
            ),
            "fp8_value": K.fp8_value(codes.astype(jnp.uint32), fmt),  # u8 -> u32
            "fp8_code": K.fp8_code(finite_values, fmt).astype(jnp.uint8),
            "codes of XLA's float8": (
                K.fp8_code(q.astype(jnp.float32), fmt).astype(jnp.uint8),
                jax.lax.bitcast_convert_type(q, jnp.uint8),
            ),
        }

    # LLVM's optimizations off: each comparison is of correctly rounded results or of bit patterns, which any
    # compile gives bit for bit
    args = (x, jnp.asarray(codes), jnp.asarray(values[~nan]))
    out = jax.jit(both).lower(*args).compile(UNOPTIMIZED)(*args)
    _bits_equal(*out["nearest"], "nearest")
    _bits_equal(*out["stochastic"], "stochastic")
    got = np.asarray(out["fp8_value"])
    assert np.array_equal(np.isnan(got), nan)
    _bits_equal(got[~nan], values[~nan], "fp8_value")
    _bits_equal(out["fp8_code"], codes[~nan], "fp8_code")
    _bits_equal(*out["codes of XLA's float8"], "codes of XLA's float8")
    assert ml_dtypes.finfo(jnp.dtype(fmt)).bits == 8


def _grads(params, step):
    """Gradients over six decades (blocks whose small elements underflow), different every step."""
    return jax.tree.map(
        lambda x: (
            (
                jnp.sin(jnp.arange(x.size, dtype=jnp.float32) * (step + 1)) * 10.0 ** -(jnp.arange(x.size) % 7)
            )  # i32 -> f32 exponents
            .reshape(x.shape)
            .astype(x.dtype)
        ),
        params,
    )


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_kernel_equals_the_xla_path_over_steps(rounding):
    """2 steps of kahan_adamw(impl="pallas") (interpret mode) and impl="xla" with 8-bit moments: params, compensation,
    codes and scales agree bit for bit. Leaves: (256, 384) (768 rows of 128, one program of 1024 rows, padded), a 1-D
    (512,), (24, 8192) (1536 rows: two programs), and an f32 leaf (XLA in both)."""
    rng = np.random.default_rng(1)
    p = {
        "w": jnp.asarray(rng.standard_normal((256, 384)), jnp.bfloat16),
        "b": jnp.asarray(rng.standard_normal(512), jnp.bfloat16),
        "big": jnp.asarray(rng.standard_normal((24, 8192)), jnp.bfloat16),
        "f": jnp.asarray(rng.standard_normal(130), jnp.float32),
    }
    kw = dict(weight_decay=0.1, seed=3, moment_dtype=E4M3, moment_rounding=rounding)
    out = {}
    for impl in ("xla", "pallas"):
        tx = O.kahan_adamw(optax.linear_schedule(1e-2, 1e-3, 4), impl=impl, interpret=True, **kw)

        @jax.jit
        def step(g, st, q, tx=tx):
            d, st = tx.update(g, st, q)
            return optax.apply_updates(q, d), st

        q, st = p, tx.init(p)
        for i in range(2):
            q, st = step(_grads(p, i), st, q)
        out[impl] = (q, st)
    (qx, sx), (qp, sp) = out["xla"], out["pallas"]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path((qx, sx)), jax.tree.leaves((qp, sp)), strict=True):
        _bits_equal(a, b, jax.tree_util.keystr(path))
    assert np.any(np.asarray(sx.compensation["w"], np.float32) != 0)
    m_codes, v_codes = M8.unpack_codes(sx.moments["big"])
    assert np.mean(np.asarray(m_codes) != 0) > 0.5 and np.mean(np.asarray(v_codes) != 0) > 0.5
    assert np.all(np.asarray(jnp.real(sx.scales["big"])) > 0)


def random_state8(shape, spec: str, seed: int):
    """One step's inputs from a random 8-bit state of ``spec``'s Moment8: gradients over five decades, bf16 params
    and compensation, codes of every magnitude (finite in both FP8 formats; v >= 0), scales over 8 decades, and the
    scalars and key words. Returns ``(g, p, c, codes, scales, scalars, words, moments8)``."""
    m8 = M8.MOMENT8[spec]
    rng = np.random.default_rng(seed)
    g = jnp.asarray(rng.standard_normal(shape) * 10.0 ** rng.uniform(-5, 0, shape), jnp.bfloat16)
    p = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal(shape) * 1e-3, jnp.bfloat16)
    m_codes = rng.integers(0, 256, shape, dtype=np.uint8)
    v_codes = rng.integers(0, 0x7F, shape, dtype=np.uint8)  # v (or sqrt(v)) >= 0, no NaN code
    codes = M8.pack_codes(jnp.asarray(m_codes & 0xF7), jnp.asarray(v_codes & 0x77))  # finite in both formats
    mag = lambda: 10.0 ** rng.uniform(-8, 0, (*shape[:-1], shape[-1] // 128))
    scales = jax.lax.complex(jnp.asarray(mag(), jnp.float32), jnp.asarray(mag(), jnp.float32))  # f32 -> complex64
    scalars = jnp.asarray([1 / 0.19, 1 / 0.002, -1e-2, 0.0], jnp.float32)
    words = jnp.asarray([1, 2, 3, 4], jnp.uint32)
    return g, p, c, codes, scales, scalars, words, (m8.m_format, m8.v_format, m8.v_sqrt)


@pytest.mark.parametrize("spec", sorted(M8.MOMENT8))
@pytest.mark.parametrize("stochastic", [False, True])
def test_kernel_equals_its_xla_twin_for_every_format(spec, stochastic):
    """One step from a random 8-bit state (codes of every magnitude, scales over 8 decades) for each Moment8:
    adamw_kahan (interpreted) equals adamw_kahan_reference on the whole leaf."""
    g, p, c, codes, scales, scalars, words, moments8 = random_state8((40, 256), spec, seed=2)
    options = StepOptions(**HP, stochastic=stochastic, moments8=moments8, interpret=True)
    kernel = jax.jit(lambda *a: adamw_kahan(*a, scales, options=options))(g, p, c, codes, scalars, words)
    twin = jax.jit(lambda *a: K.adamw_kahan_reference(*a, scales, options=options))(g, p, c, codes, scalars, words)
    for name, a, b in zip(("p", "c", "codes", "scales"), kernel, twin, strict=True):
        _bits_equal(a, b, name)
    assert np.mean(np.asarray(kernel[0]) != np.asarray(p)) > 0.3


def test_the_kernel_declares_14_bytes_per_param():
    """cost_estimate's bytes: reads g 2, p 2, c 2, codes 2 and two f32 scales per 128; writes p, c, codes, scales:
    14 + 16/128 = 14.125 bytes/param against 18 with 16-bit moments."""
    shape = (1024, 1024)
    leaf = [jnp.zeros(shape, jnp.bfloat16)] * 3
    scalars = jnp.zeros((4,), jnp.float32)

    def declared(*args, scales=None, moments8=None):
        options = StepOptions(**HP, stochastic=True, moments8=moments8, interpret=True)
        jaxpr = jax.make_jaxpr(functools.partial(adamw_kahan, scales=scales, options=options))(*args)
        (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
        return eqn.params["cost_estimate"].bytes_accessed / np.prod(shape)

    scales = jnp.zeros((1024, 8), jnp.complex64)
    eight = declared(
        *leaf,
        jnp.zeros(shape, jnp.uint16),
        scalars,
        jnp.zeros((4,), jnp.uint32),
        scales=scales,
        moments8=(E4M3, E4M3, True),
    )
    sixteen = declared(*leaf, jnp.zeros(shape, jnp.uint32), scalars, jnp.zeros((2,), jnp.uint32))
    assert eight == 14.125 and sixteen == 18.0, (eight, sixteen)


def test_one_line_errors():
    tx = O.kahan_adamw(1e-3, moment_dtype=E4M3, impl="pallas", interpret=True)
    p = {"w": jnp.zeros((8, 200), jnp.bfloat16)}
    with pytest.raises(ValueError, match=r"multiple of 128; \['w'\] has shape \(8, 200\) \(use impl='xla'\)"):
        tx.update(p, tx.init(p), p)
    g = jnp.zeros((4, 200), jnp.bfloat16)
    options = StepOptions(**HP, stochastic=False, moments8=(E4M3, E4M3, True))
    with pytest.raises(
        ValueError, match=r"needs a last axis that is a multiple of 128, got a leaf of shape \(4, 200\)"
    ):
        adamw_kahan(g, g, g, g.astype(jnp.uint16), jnp.zeros(4), jnp.zeros(4, jnp.uint32), g, options=options)
    mesh = jax.sharding.AbstractMesh((2, 2), ("data", "tensor"))
    x = jnp.zeros((8, 256), jnp.bfloat16)
    args = (x, x, x, x.astype(jnp.uint16), jnp.zeros(4), jnp.zeros(4, jnp.uint32), jnp.zeros((8, 2)))
    with (  # the arrays exist before the abstract mesh is set: jax 0.11 runs no eager op under one
        jax.sharding.use_abstract_mesh(mesh),
        pytest.raises(ValueError, match=r"split over mesh axes \('data', 'tensor'\) of size 4 gives shards of 64, not"),
    ):
        adamw_kahan_on_shards(*args, options=options, spec=P(None, ("data", "tensor")))


# ----------------------------------------------------------------------------- sharded: 4 host CPU devices
_SHARDED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import lpt.optim as O
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))

    def same(a, b, what):
        for i, (x, y) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)):
            x, y = np.asarray(x).reshape(-1), np.asarray(y).reshape(-1)
            assert x.dtype == y.dtype and x.shape == y.shape, what
            bad = np.sum(x.view(np.uint8) != y.view(np.uint8))
            assert bad == 0, f"{what}: output {i}: {np.sum(x != y)} of {x.size} differ"
        print(what, "bitwise OK")

    # split along the first dim and the last (whole blocks), a middle dim and the last, one dim over both axes, the
    # last only, and not at all
    specs = {
        "a": ((64, 512), P("data", "tensor")),
        "b": ((8, 6, 256), P(None, "tensor", "data")),
        "c": ((1024,), P(("data", "tensor"))),
        "d": ((16, 256), P(None, "data")),
        "e": ((8, 128), P()),
    }
    w = {k: jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for k, (s, _) in specs.items()}
    g = {k: jnp.asarray(rng.standard_normal(s) * 10.0 ** rng.integers(-4, 1, s), jnp.bfloat16)
         for k, (s, _) in specs.items()}
    sh = lambda t: {k: put(v, specs[k][1]) for k, v in t.items()}
    for rounding in ("stochastic",):  # the hash of global indices is what a shard can get wrong; nearest has none
        kw = dict(weight_decay=0.1, sequential_leaves=False, moment_dtype="float8_e4m3fn", moment_rounding=rounding)
        unsharded = O.kahan_adamw(1e-2, impl="pallas", **kw)
        st = unsharded.init(w)
        upd = jax.jit(unsharded.update)
        ref = upd(g, st, w)
        ref = upd(g, ref[1], w)
        st_s = st._replace(moments=sh(st.moments), compensation=sh(st.compensation), scales=sh(st.scales))
        given = {"param_specs": {k: s for k, (_, s) in specs.items()}}
        for name, extra in (("custom_partitioning", {}), ("param_specs", given)):
            upd = jax.jit(O.kahan_adamw(1e-2, impl="pallas", **kw, **extra).update)
            with jax.set_mesh(mesh):
                compiled = upd.lower(sh(g), st_s, sh(w)).compile()  # the program both steps run
                hlo = compiled.as_text()
                assert hlo.count("all-gather") == 0 and hlo.count("all-reduce") == 0, "the update gathers"
                out = compiled(sh(g), st_s, sh(w))
                out = compiled(sh(g), out[1], sh(w))
            assert out[1].scales["b"].sharding.spec == P(None, "tensor", "data"), out[1].scales["b"].sharding
            same(out, ref, f"8-bit {rounding} {name}, 2 steps")
    """
)


def test_sharded_equals_unsharded_bitwise():
    r = subprocess.run([sys.executable, "-c", _SHARDED], env=cpu_env(4), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    for rounding in ("stochastic",):
        for name in ("custom_partitioning", "param_specs"):
            assert f"8-bit {rounding} {name}, 2 steps bitwise OK" in r.stdout, r.stdout


# ----------------------------------------------------------------------------- compiles, deviceless
def _all_gathers(text: str) -> int:
    return text.count("all-gather(") + text.count("all-gather-start(")


_SPECS = {"a": ((256, 512), ("x", "y")), "b": ((512,), ()), "c": ((8, 128, 256), (None, None, "y"))}


def _abstract_step(mesh, names, param_specs: bool):
    """A jitted 8-bit kahan_adamw(impl="pallas") update and abstract (params, state) laid out over ``mesh``: the
    moments' codes and the scales split like their param."""
    x, y = names
    specs = {k: P(*[{"x": x, "y": y}.get(a, a) for a in s]) for k, (_, s) in _SPECS.items()}
    sh = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    w = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sh[k]) for k, (s, _) in _SPECS.items()}
    kw = dict(moment_dtype=E4M3, sequential_leaves=False, param_specs=sh if param_specs else None)
    tx = O.kahan_adamw(1e-2, weight_decay=0.1, impl="pallas", **kw)
    st = jax.eval_shape(tx.init, w)
    like = lambda tree: {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) for k, v in tree.items()}
    st = st._replace(moments=like(st.moments), compensation=like(st.compensation), scales=like(st.scales))
    rep = NamedSharding(mesh, P())
    st = jax.tree.map(
        lambda a: a if a.sharding is not None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), st
    )
    return jax.jit(tx.update), w, st


def test_compiles_for_tpu_v5e_sharded_without_gathers():
    """The trainer's path (param_specs: a shard_map) on a 2x2 v5e mesh, and the user's Explicit mesh without
    param_specs: one Mosaic kernel per leaf, no all-gather."""
    mesh = targets.mesh("v5e:2x2", (2, 2), ("data", "tensor"))
    upd, w, st = _abstract_step(mesh, ("data", "tensor"), param_specs=True)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        text = upd.lower(w, st, w).compile().as_text()
    assert text.count("tpu_custom_call") >= 3 and _all_gathers(text) == 0
    import numpy as onp

    devs = onp.asarray(targets.devices("v5e:2x2"), dtype=object).reshape(2, 2)
    user = jax.sharding.Mesh(devs, ("dp", "tp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    upd, w, st = _abstract_step(user, ("dp", "tp"), param_specs=False)
    with jax.set_mesh(user):
        text = upd.lower(w, st, w).compile().as_text()
    assert text.count("tpu_custom_call") >= 3 and _all_gathers(text) == 0


def test_compiles_for_h100_sharded_without_gathers():
    """custom_partitioning (no param_specs, an Auto mesh) on 8 H100s: one Mosaic GPU kernel per leaf, no all-gather;
    the control (the kernel called on the sharded leaf directly) all-gathers it."""
    mesh = targets.mesh("h100:1x1x8", (4, 2), ("data", "tensor"))
    upd, w, st = _abstract_step(mesh, ("data", "tensor"), param_specs=False)
    with targets.lowering_for("h100:1x1x8"):  # the per-shard kernels lower in the partitioner: no mesh there
        text = upd.lower(w, st, w).compile().as_text()
    assert text.count("mosaic_gpu_v2") >= 3 and "triton" not in text and _all_gathers(text) == 0

    def direct(g, p, c, mv, scales):
        options = StepOptions(**HP, stochastic=True, moments8=(E4M3, E4M3, True))
        return adamw_kahan(g, p, c, mv, jnp.ones(4), jnp.arange(4, dtype=jnp.uint32), scales, options=options)

    leaf = NamedSharding(mesh, P("data", "tensor"))
    shapes = [((256, 512), jnp.bfloat16)] * 3 + [((256, 512), jnp.uint16), ((256, 4), jnp.complex64)]
    args = [jax.ShapeDtypeStruct(s, d, sharding=leaf) for s, d in shapes]
    with targets.lowering_for("h100:1x1x8"):
        assert _all_gathers(jax.jit(direct).lower(*args).compile().as_text()) > 0  # control: XLA gathers the leaf


@pytest.mark.parametrize("shape", [(1024, 384), (128, 256)], ids=["row_blocks", "whole_rows"])
@pytest.mark.parametrize("spec", ["float8_e4m3fn", "e4m3_v_direct"])
def test_wide_leaves_run_on_a_2d_grid(shape, spec):
    """8-bit moments on a leaf whose last axis is several 128s and whose rows split into blocks of 1024 (or are one
    block of a power of two >= 128): (rows, 128) tiles of the (m, n) view on a 2-D grid, the scales handed over
    column block by column block, lane-dense; bit for bit the twin."""
    g, p, c, codes, scales, scalars, words, moments8 = random_state8(shape, spec, seed=5)
    options = StepOptions(**HP, stochastic=True, moments8=moments8, interpret=True)
    kernel = lambda *a: adamw_kahan(*a, scales, options=options)
    (eqn,) = [
        e for e in jax.make_jaxpr(kernel)(g, p, c, codes, scalars, words).eqns if e.primitive.name == "pallas_call"
    ]
    assert tuple(eqn.params["grid_mapping"].grid) == (shape[0] // min(shape[0], 1024), shape[1] // 128)
    out = jax.jit(kernel)(g, p, c, codes, scalars, words)
    twin = jax.jit(lambda *a: K.adamw_kahan_reference(*a, scales, options=options))(g, p, c, codes, scalars, words)
    for name, a, b in zip(("p", "c", "codes", "scales"), out, twin, strict=True):
        _bits_equal(a, b, name)
