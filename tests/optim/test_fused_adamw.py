"""lpt.optim.kahan_adamw (one fused transform): bit-identical to the composable chain, the compiled XLA:CPU structure
it exists for, packed-moment state with working checkpoint helpers and diagnostics, clear errors."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cpu_compile import UNOPTIMIZED

import lpt.optim as O
from lpt.optim.fused_adamw import kahan_adamw_moments


def _tree(pdt, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.standard_normal((24, 40)), jnp.float32).astype(pdt),
        "b": jnp.asarray(rng.standard_normal(7), jnp.float32),  # f32 leaf: plain AdamW
    }


MIXED = {  # one leaf per 16-bit packing: bf16 pair in uint32, f16 pair in uint32
    "bf16": jnp.bfloat16,
    "f16": jnp.float16,
}


def _run(tx, p, steps=3, seed=1):
    """``steps`` updates, each one jitted call, applied with O.apply_updates (float8-safe); returns (params, state).
    Compiled with LLVM's optimizations off: the fused step and the chain compute the same element-wise math, each op
    rounded where it is written and every product that feeds an add kept out of FMAs by a runtime zero, so their
    results do not depend on the compile."""
    rng = np.random.default_rng(seed)

    @functools.partial(jax.jit, compiler_options=UNOPTIMIZED)
    def step(g, st, p):
        d, st = tx.update(g, st, p)
        return O.apply_updates(p, d), st

    st = tx.init(p)
    for _ in range(steps):
        g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 10.0 ** rng.uniform(-3, 0), x.dtype), p)
        g = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype.itemsize == 1 else x, g)  # fp8 grads: bf16
        p, st = step(g, st, p)
    return p, st


def _bits(x):
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}")) if x.ndim else x


@pytest.mark.parametrize(
    "pdt,mdt,rounding",
    [
        (jnp.bfloat16, None, "stochastic"),  # the recipe: uint32-packed bf16 moments
        ("mixed", None, "nearest"),  # bf16 and f16 leaves (and f32: complex64 moments) in one tree
        (jnp.float8_e4m3fn, jnp.bfloat16, "stochastic"),  # float8 params need 16-bit moments
    ],
)
def test_fused_matches_the_chain(pdt, mdt, rounding):
    """Same moments, params and compensation bit for bit: both keep every product that feeds an add out of FMAs
    (lpt.kernels.adamw_kahan.math.no_fma; the chain's decay and -lr products too). 120 steps:
    test_kahan_fused_vs_chain."""
    sched = optax.linear_schedule(1e-2, 1e-3, 3)
    diag = pdt != "mixed"  # diagnostics compared once (they cost compile time)
    kw = dict(weight_decay=0.1, moment_rounding=rounding, moment_dtype=mdt, seed=4, diagnostics=diag)
    p0 = _tree(pdt) if pdt != "mixed" else {k: _tree(d, seed=i)["w"] for i, (k, d) in enumerate(MIXED.items())}
    if pdt == "mixed":
        p0["f32"] = _tree(jnp.bfloat16)["b"]
    pf, sf = _run(O.kahan_adamw(sched, **kw), p0)
    pc, sc = _run(O.adamw(sched, update="kahan", **kw), p0)
    comp_f, comp_c = O.find_compensation(sf), O.find_compensation(sc)
    for k in p0:
        mdt_k = p0[k].dtype if mdt is None else mdt
        mu, nu = (x[k] for x in kahan_adamw_moments(sf, moment_dtype=mdt_k))
        np.testing.assert_array_equal(_bits(pf[k]), _bits(pc[k]), err_msg=k)
        np.testing.assert_array_equal(_bits(comp_f[k]), _bits(comp_c[k]), err_msg=k)
        np.testing.assert_array_equal(np.asarray(mu), np.asarray(sc[0].mu[k], np.float32), err_msg=k)
        np.testing.assert_array_equal(np.asarray(nu), np.asarray(sc[0].nu[k], np.float32), err_msg=k)
    key = "w" if "w" in p0 else "bf16"
    assert np.any(np.asarray(comp_f[key], np.float32) != 0)  # the compensation is really used
    assert not np.array_equal(_bits(pf[key]), _bits(p0[key]))
    df, dc = O.get_diagnostics(sf), O.get_diagnostics(sc)
    assert len(df) == (3 if diag else 0)
    for name in df:
        np.testing.assert_allclose(float(df[name]), float(dc[name]), rtol=1e-3, err_msg=name)


def test_weight_decay_mask():
    p0 = {"a": jnp.full((64,), 1.5, jnp.bfloat16), "b": jnp.full((64,), 1.5, jnp.bfloat16)}
    zero = jax.tree.map(jnp.zeros_like, p0)
    kw = dict(weight_decay=0.5, moment_rounding="nearest", weight_decay_mask=lambda p: {"a": True, "b": False})
    out = {}
    for name, tx in {"fused": O.kahan_adamw(1e-2, **kw), "chain": O.adamw(1e-2, update="kahan", **kw)}.items():
        # LLVM's optimizations off: element-wise math rounded where it is written, no FMAs (as _run)
        update = lambda g, st, p, tx=tx: (lambda d, s: (optax.apply_updates(p, d), s))(*tx.update(g, st, p))
        step = jax.jit(update, compiler_options=UNOPTIMIZED)
        p, st = p0, tx.init(p0)
        for _ in range(20):
            p, st = step(zero, st, p)
        out[name] = p
    a, b = np.asarray(out["fused"]["a"], np.float32), np.asarray(out["fused"]["b"], np.float32)
    np.testing.assert_allclose(a, 1.5 * (1 - 5e-3) ** 20, rtol=2e-3)  # decays like f32 (lr·wd = 5e-3 per step)
    np.testing.assert_array_equal(b, 1.5)  # masked out: zero gradient, no decay
    for k in p0:
        np.testing.assert_array_equal(_bits(out["fused"][k]), _bits(out["chain"][k]))


def test_inject_hyperparams_matches_static():
    """optax.inject_hyperparams passes every hyperparameter traced (f32 here: with bf16 params its default dtype is
    bf16, where b2 = 0.999 rounds to 1.0); the fused transform must not branch on them. Same result up to the f32
    rounding of ``1 − b1`` (f64 then rounded for Python floats, f32 arithmetic for traced ones)."""
    p = _tree(jnp.bfloat16)
    kw = dict(learning_rate=1e-2, weight_decay=0.1, moment_rounding="nearest")
    pi, si = _run(optax.inject_hyperparams(O.kahan_adamw, hyperparam_dtype=jnp.float32)(**kw), p, steps=2)
    ps, ss = _run(O.kahan_adamw(**kw), p, steps=2)
    np.testing.assert_allclose(np.asarray(pi["b"]), np.asarray(ps["b"]), rtol=1e-6)
    w_i, w_s = O.to_f32(pi, si.inner_state.compensation)["w"], O.to_f32(ps, ss.compensation)["w"]
    np.testing.assert_allclose(np.asarray(w_i), np.asarray(w_s), rtol=1e-4)
    assert np.mean(_bits(pi["w"]) == _bits(ps["w"])) > 0.99


def _compiled_structure(tx, p):
    def step(p, s, g):
        d, s = tx.update(g, s, p)
        return optax.apply_updates(p, d), s

    text = jax.jit(step, donate_argnums=(0, 1)).lower(p, tx.init(p), p).compile().as_text()
    entry = text[text.index("\nENTRY") :]
    leaf = [ln for ln in entry.splitlines() if re.search(r"= \w+\[64,128\]", ln)]  # ops over the whole leaf
    return sum(" fusion(" in ln for ln in leaf), sum(" copy(" in ln for ln in leaf)


def test_xla_cpu_compiles_four_passes_and_no_copies():
    """The reason the fused transform exists (XLA:CPU has no multi-output fusion): moments, t, p', c' are one pass
    each and no donated buffer is copied. The composable chain needs 5 passes and 2 copies (measured)."""
    p = {"w": jnp.ones((64, 128), jnp.bfloat16)}
    if jax.default_backend() != "cpu":
        pytest.fail("this structure test is written for XLA:CPU")
    assert _compiled_structure(O.kahan_adamw(1e-3, moment_rounding="nearest"), p) == (4, 0)
    chain_fusions, chain_copies = _compiled_structure(O.adamw(1e-3, moment_rounding="nearest"), p)
    assert chain_fusions + chain_copies > 4


def test_checkpoint_helpers_work_on_the_fused_state():
    rng = np.random.default_rng(2)
    w32 = {"w": jnp.asarray(rng.uniform(-2, 2, (32, 32)), jnp.float32), "b": jnp.zeros(4, jnp.float32)}
    params, comp = O.compensation_from_f32(w32, jnp.bfloat16)
    tx = O.kahan_adamw(1e-3, moment_rounding="nearest")
    st = O.replace_compensation(tx.init(params), comp)
    assert isinstance(st, O.KahanAdamWState)
    np.testing.assert_array_equal(_bits(O.find_compensation(st)["w"]), _bits(comp["w"]))
    back = O.to_f32(params, O.find_compensation(st))
    assert np.max(np.abs(np.asarray(back["w"]) - np.asarray(w32["w"])) / np.abs(np.asarray(w32["w"]))) < 2.0**-15
    # the state mirrors the params tree (shards like the params): same shapes, 8 bytes/param for bf16 leaves
    assert st.moments["w"].shape == (32, 32) and st.moments["w"].dtype == jnp.uint32
    assert st.compensation["w"].shape == (32, 32) and st.compensation["w"].dtype == jnp.bfloat16


def test_bad_input_raises_clear_errors():
    p = {"w": jnp.zeros((4, 4), jnp.float16)}
    with pytest.raises(ValueError, match="impl must be one of"):
        O.kahan_adamw(1e-3, impl="cuda")
    tx = O.kahan_adamw(1e-3, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="needs bf16 params, moments and compensation"):
        jax.jit(tx.update)(p, tx.init(p), p)  # raised while tracing (the jitted path), nothing compiles
    with pytest.raises(ValueError, match="unsupported parameter dtype 'int32'"):
        O.kahan_adamw(1e-3).init({"w": jnp.zeros(3, jnp.int32)})
    with pytest.raises(ValueError, match="trees differ"):
        tx = O.kahan_adamw(1e-3)
        q = {"w": jnp.zeros(3, jnp.bfloat16)}
        jax.jit(tx.update)({"v": jnp.zeros(3)}, tx.init(q), q)
    with pytest.raises(ValueError, match="weight_decay_mask must have the params' tree structure"):
        tx = O.kahan_adamw(1e-3, weight_decay_mask={"x": True})
        q = {"w": jnp.zeros(3, jnp.bfloat16)}
        jax.jit(tx.update)(q, tx.init(q), q)
    with pytest.raises(ValueError, match="moment_rounding must be one of"):
        O.kahan_adamw(1e-3, moment_rounding="up")


@pytest.mark.parametrize("make", [O.kahan_adamw, lambda lr, **kw: O.adamw(lr, update="kahan", **kw)])
def test_8bit_moments_without_a_block_scale_are_an_error(make):
    """Adam moments squeezed into an 8-bit float or int with no block scale lose the loss (docs/results.md: the
    least-squares problem of four decades ends 10^12 above f32 with e4m3 moments), so asking for them is an error
    that names the dtype and the allowed ones, whether asked for directly or through float8 params."""
    q = {"w": jnp.zeros((4, 4), jnp.bfloat16)}
    for mdt in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8):
        with pytest.raises(ValueError, match=rf"moment_dtype='{jnp.dtype(mdt).name}'.*'float32', 'bfloat16'"):
            make(1e-3, moment_dtype=mdt).init(q)
    with pytest.raises(ValueError, match=r"float8_e4m3fn params.*pass moment_dtype"):
        make(1e-3).init({"w": jnp.zeros((4, 4), jnp.float8_e4m3fn)})
    state = make(1e-3, moment_dtype=jnp.bfloat16).init({"w": jnp.zeros((4, 4), jnp.float8_e4m3fn)})
    assert {x.dtype for x in jax.tree.leaves(state)} & {jnp.dtype(jnp.uint32), jnp.dtype(jnp.bfloat16)}
