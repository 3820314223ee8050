"""lpt.optim update rules: the convergence floor, bit-exactness through optax/nnx, weight decay, chains, errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from cpu_compile import UNOPTIMIZED
from flax import nnx
from float_bounds import gamma

import lpt.optim as O

LOW = [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2]


def _apply(p, d):
    # optax.apply_updates for bf16/f16 (the promise); lpt's for float8 (JAX refuses fp8 + f32 promotion)
    if any(x.dtype.itemsize == 1 for x in jax.tree.leaves(p)):
        return O.apply_updates(p, d)
    return optax.apply_updates(p, d)


# ---------------------------------------------------------------- convergence floor (Zamirai et al., Theorem 1)
def _least_squares(d=64, n=256, sigma=0.05, seed=0):
    rng = np.random.default_rng(seed)
    A = jnp.asarray(rng.standard_normal((n, d)) / np.sqrt(n), jnp.float32)
    w_star = jnp.asarray(rng.uniform(0.5, 2.0, d), jnp.float32)
    b = A @ w_star + sigma * jnp.asarray(rng.standard_normal(n), jnp.float32)

    def loss(w):
        r = A @ w.astype(jnp.float32) - b  # param dtype -> f32
        return 0.5 * jnp.sum(r * r)

    return loss, d


@pytest.fixture(scope="module")
def floor_losses():
    """The final loss of 6000 steps of lr 0.01 on _least_squares for each rule: the four runs in one program (no
    value crosses between them), compiled with LLVM's optimizations off (6000 steps of a 256 x 64 problem run in
    well under a second unoptimized; the checks are ratios of losses)."""
    loss, d = _least_squares()
    runs = {
        "f32": (optax.identity(), jnp.float32),
        "nearest": (optax.identity(), jnp.bfloat16),  # what plain optax.apply_updates does
        "kahan": (O.kahan_summation(), jnp.bfloat16),
        "stochastic": (O.stochastic_rounding(seed=1), jnp.bfloat16),
    }

    def run(tx, dtype, steps=6000, lr=0.01):
        def step(carry, _):
            w, st = carry
            u, st = tx.update(-lr * jax.grad(loss)(w), st, w)
            return (optax.apply_updates(w, u), st), None

        w = jnp.zeros(d, dtype)
        (w, _), _ = jax.lax.scan(step, (w, tx.init(w)), None, length=steps)
        return loss(w)

    train = jax.jit(lambda: {name: run(tx, dtype) for name, (tx, dtype) in runs.items()})
    return {k: float(v) for k, v in train.lower().compile(UNOPTIMIZED)().items()}


def test_nearest_rounding_stalls_above_f32(floor_losses):
    assert floor_losses["nearest"] >= 2.0 * floor_losses["f32"], floor_losses  # measured ~10.7x


@pytest.mark.parametrize("rule", ["kahan", "stochastic"])
def test_kahan_and_sr_reach_f32_loss(floor_losses, rule):
    assert floor_losses[rule] <= 1.01 * floor_losses["f32"], floor_losses  # measured +0.13% / +0.09%


# ---------------------------------------------------------------- bit-exactness
def _tree(dtype, seed=0):
    """|p| in [0.5, 4] and |u| <= 0.2: every new value lies within a factor 2 of the old one, where the emitted
    16-bit change is exact (Sterbenz; ``test_large_changes_land_within_half_an_ulp_of_the_change`` covers the rest)."""
    rng = np.random.default_rng(seed)
    mag = rng.uniform(0.5, 4, (33, 17)) * rng.choice([-1.0, 1.0], (33, 17))
    p = {
        "w": jnp.asarray(mag.astype(np.float32)).astype(dtype),
        "b": jnp.asarray(rng.standard_normal(17).astype(np.float32)),  # f32 leaf: passes through
    }
    small = np.clip(rng.standard_normal((33, 17)), -2, 2) * 10.0 ** rng.uniform(-5, -1, (33, 17))
    u = {"w": jnp.asarray(small, jnp.float32), "b": jnp.asarray(rng.standard_normal(17), jnp.float32)}
    return p, u


def _kahan_ref(p, c, u, dtype, cdt):
    """Algorithm 1 of Zamirai et al. (Revisiting BFloat16 Training) in numpy/ml_dtypes (f32 arithmetic, RNE casts),
    independent of lpt.

    The error is measured as ``s - t`` with ``t = p + y`` (the paper writes ``(s - p) - y``; equal up to the f32
    rounding of ``p + y``, see ``lpt.optim.kahan.kahan_step``)."""
    p32 = np.asarray(p).astype(np.float32)
    y = np.asarray(u, np.float32) - np.asarray(c).astype(np.float32)
    t = p32 + y
    s = t.astype(dtype).astype(np.float32)
    c_new = (s - t).astype(cdt)
    return s, c_new


@pytest.mark.parametrize("dtype", LOW)
def test_kahan_bit_exact_through_apply_updates_under_jit(dtype):
    p, u = _tree(dtype)
    tx = O.kahan_summation()
    st = tx.init(p)
    c = np.zeros(p["w"].shape, ml_dtypes.finfo(dtype).dtype)
    step = jax.jit(lambda u, st, p: (lambda d, s: (_apply(p, d), s))(*tx.update(u, st, p)))
    for i in range(3):
        u_i = jax.tree.map(lambda x, k=i + 1: x * k, u)
        ref_w, c = _kahan_ref(p["w"], c, u_i["w"], np.dtype(dtype), np.dtype(dtype))
        p_new, st = step(u_i, st, p)
        assert p_new["w"].dtype == dtype
        np.testing.assert_array_equal(np.asarray(p_new["w"]).astype(np.float32), ref_w)
        np.testing.assert_array_equal(np.asarray(st.compensation["w"]).astype(np.float32), c.astype(np.float32))
        np.testing.assert_array_equal(np.asarray(p_new["b"]), np.asarray(p["b"] + u_i["b"]))
        p = p_new
    assert np.any(c.astype(np.float32) != 0)  # the compensation is really used


@pytest.mark.parametrize("rule", ["nearest", "stochastic", "norm_preserving"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_other_rules_bit_exact_through_apply_updates(rule, dtype):
    p, u = _tree(dtype, seed=3)
    tx = O.update_rule(rule, seed=5)
    st = tx.init(p)
    deltas, _ = jax.jit(tx.update)(u, st, p)
    new = jax.jit(_apply)(p, deltas)
    expect = np.asarray(p["w"]).astype(np.float32) + np.asarray(deltas["w"])  # the values the rule chose
    assert np.array_equal(expect.astype(np.dtype(dtype)).astype(np.float32), expect)  # on the grid
    np.testing.assert_array_equal(np.asarray(new["w"]).astype(np.float32), expect)
    if rule == "nearest":
        ref = (np.asarray(p["w"]).astype(np.float32) + np.asarray(u["w"])).astype(np.dtype(dtype))
        np.testing.assert_array_equal(np.asarray(new["w"]).astype(np.float32), ref.astype(np.float32))


@pytest.mark.parametrize("rule", ["kahan", "nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_large_changes_land_within_half_an_ulp_of_the_change(rule, dtype):
    """Weights that cross zero or shrink/grow more than 2x in one step: the change, emitted in the params' dtype, is
    rounded to nearest there, so ``apply_updates`` lands within half an ulp of the change (in that dtype) of the
    value the rule chose (``p + delta`` in exact arithmetic is what the rule chose: nearest rounding of p + u)."""
    rng = np.random.default_rng(7)
    p = {"w": jnp.asarray(rng.uniform(-1, 1, 4096).astype(np.float32)).astype(dtype)}
    u = {"w": jnp.asarray(rng.uniform(-1, 1, 4096).astype(np.float32) * 4)}
    tx = O.update_rule(rule, seed=5) if rule != "kahan" else O.kahan_summation()
    d, _ = jax.jit(tx.update)(u, tx.init(p), p)
    assert d["w"].dtype == dtype
    p32, d32 = np.asarray(p["w"]).astype(np.float64), np.asarray(d["w"]).astype(np.float64)
    landed = np.asarray(jax.jit(optax.apply_updates)(p, d)["w"]).astype(np.float64)
    if rule == "nearest":
        chosen = (np.asarray(p["w"]).astype(np.float32) + np.asarray(u["w"])).astype(np.dtype(dtype)).astype(np.float64)
        change = chosen - p32
        half_ulp = np.spacing(np.abs(change).astype(np.dtype(dtype))).astype(np.float64) / 2
        assert np.all(np.abs(d32 - change) <= half_ulp)  # the change, rounded to nearest in the params' dtype
        inexact = d32 != change
        assert inexact.mean() > 0.01  # the case this test is about occurs
        assert np.all(landed[~inexact] == chosen[~inexact])  # exact changes land on the chosen value (exact: sums)
        assert np.all(np.abs(landed - chosen) <= half_ulp + np.spacing(np.abs(landed).astype(np.dtype(dtype))) / 2)
    assert np.all(landed == (p32 + d32).astype(np.dtype(dtype)).astype(np.float64))  # one rounding of p + delta


def test_kahan_bit_exact_through_nnx_optimizer():
    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    opt = nnx.Optimizer(model, optax.chain(optax.sgd(1e-3), O.kahan_summation()), wrt=nnx.Param)
    x = jnp.ones((2, 8), jnp.float32)
    grads = nnx.grad(lambda m: jnp.sum(m(x.astype(jnp.bfloat16)).astype(jnp.float32) ** 2))(model)
    w0 = np.asarray(model.kernel[...]).astype(np.float32)
    g = np.asarray(grads.kernel[...]).astype(np.float32)
    opt.update(model, grads)
    ref, _ = _kahan_ref(w0, np.zeros_like(w0, ml_dtypes.bfloat16), -1e-3 * g, ml_dtypes.bfloat16, ml_dtypes.bfloat16)
    assert model.kernel[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(model.kernel[...]).astype(np.float32), ref)


# ---------------------------------------------------------------- weight decay (the anchor that drops it)
def test_decoupled_weight_decay_takes_effect_in_bf16():
    w0 = jnp.asarray(np.random.default_rng(0).uniform(0.5, 2.0, 256), jnp.float32)
    zero = jnp.zeros_like(w0)

    def run(tx, dtype, steps=1000):
        w = w0.astype(dtype)

        @jax.jit
        def go(w):
            def step(carry, _):
                w, st = carry
                u, st = tx.update(zero.astype(dtype), st, w)
                return (optax.apply_updates(w, u), st), None

            return jax.lax.scan(step, (w, tx.init(w)), None, length=steps)[0][0]

        return np.asarray(go(w)).astype(np.float64) / np.asarray(w0, np.float64)

    adamw = optax.adamw(1e-2, weight_decay=1e-2)  # lr·wd = 1e-4
    f32 = run(adamw, jnp.float32)
    kahan = run(optax.chain(adamw, O.kahan_summation()), jnp.bfloat16)
    nearest = run(adamw, jnp.bfloat16)
    np.testing.assert_allclose(f32, 0.9999**1000, rtol=1e-4)
    assert np.max(np.abs(kahan / f32 - 1)) < 0.01  # decays like f32 (within 1%)
    assert np.max(np.abs(nearest - 1)) < 0.005  # the failure mode: plain bf16 never decays


# ---------------------------------------------------------------- stochastic rounding
def test_stochastic_rounding_accumulates_sub_ulp_updates_and_is_deterministic():
    p = {"a": jnp.ones((4096,), jnp.bfloat16), "b": jnp.ones((16,), jnp.bfloat16)}

    def run(seed, p, steps=100):
        u = jax.tree.map(lambda x: jnp.full(x.shape, 1e-3, jnp.float32), p)  # 1/8 of the ulp above 1.0 (2^-7)
        tx = O.stochastic_rounding(seed)
        st = tx.init(p)
        upd = jax.jit(tx.update)
        for _ in range(steps):
            d, st = upd(u, st, p)
            p = optax.apply_updates(p, d)
        return p

    a = run(0, p)
    mean = float(jnp.mean(a["a"].astype(jnp.float32)))  # bf16 -> f32
    # E = 1 + 0.1; each element's sum of 100 Bernoulli steps of 2^-7: sd/sqrt(4096) tiny
    assert abs(mean - 1.1) < 0.005, mean
    np.testing.assert_array_equal(np.asarray(run(0, p)["a"]), np.asarray(a["a"]))
    assert not np.array_equal(np.asarray(run(1, p)["a"]), np.asarray(a["a"]))
    # the randomness of a leaf depends on its path, not on which other leaves exist
    only_a = run(0, {"a": p["a"]})
    np.testing.assert_array_equal(np.asarray(only_a["a"]), np.asarray(a["a"]))


# ---------------------------------------------------------------- chains
def test_works_inside_common_optax_wrappers():
    p, u = _tree(jnp.bfloat16, seed=7)
    sched = optax.linear_schedule(1e-2, 1e-3, 10)
    chains = {
        "clip+schedule": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched), O.kahan_summation()),
        "inject": optax.chain(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2), O.stochastic_rounding()),
        "masked": optax.chain(optax.sgd(1.0), optax.masked(O.kahan_summation(), {"w": True, "b": False})),
        "multisteps": optax.MultiSteps(optax.chain(optax.sgd(1.0), O.kahan_summation()), every_k_schedule=2),
    }
    for name, tx in chains.items():
        st = tx.init(p)
        step = jax.jit(tx.update)
        q = p
        for _ in range(4):
            d, st = step(u, st, q)
            q = optax.apply_updates(q, d)
        assert q["w"].dtype == jnp.bfloat16, name
        moved = np.mean(np.asarray(q["w"] != p["w"]))
        assert moved > 0.3, (name, moved)
        if name == "masked":  # the masked chain equals Kahan on "w" alone; "b" gets the raw update
            tx2 = optax.chain(optax.sgd(1.0), O.kahan_summation())
            st2, r = tx2.init(p), p
            for _ in range(4):
                d, st2 = tx2.update(u, st2, r)
                r = optax.apply_updates(r, d)
            np.testing.assert_array_equal(np.asarray(q["w"]), np.asarray(r["w"]))
            np.testing.assert_allclose(np.asarray(q["b"]), np.asarray(p["b"] - 4 * u["b"]), rtol=1e-6)
    # the Kahan state mirrors the params tree (shards like the params)
    st = optax.chain(optax.sgd(1.0), O.kahan_summation()).init(p)
    assert st[1].compensation["w"].shape == p["w"].shape and st[1].compensation["w"].dtype == jnp.bfloat16


# ---------------------------------------------------------------- diagnostics
def test_diagnostics_report_cancellation_and_norms():
    p = {"w": jnp.ones((1000,), jnp.bfloat16)}
    u = {"w": jnp.full((1000,), 1e-3, jnp.float32)}  # below half an ulp (2^-8): all cancelled by nearest
    for rule in ["nearest", "kahan"]:
        tx = O.update_rule(rule, diagnostics=True)
        _, st = jax.jit(tx.update)(u, tx.init(p), p)
        diag = O.get_diagnostics(st)
        assert float(diag["update/cancelled_fraction"]) == 1.0
        # 1000 squares summed in f32 in an order XLA picks per ISA (a sequential sum is 2.4e-6 off), then a square
        # root: relative error <= γ_1001 (u = 2^-24)
        np.testing.assert_allclose(float(diag["update/intended_norm"]), 1e-3 * np.sqrt(1000), rtol=gamma(1001))
        assert float(diag["update/applied_norm"]) == 0.0
    tx = O.stochastic_rounding(diagnostics=True)
    _, st = jax.jit(tx.update)(u, tx.init(p), p)
    frac = float(O.get_diagnostics(st)["update/cancelled_fraction"])
    assert 0.8 < frac < 0.95  # rounds up with probability 1e-3 / 2^-7 = 0.128


# ---------------------------------------------------------------- norm-preserving update (norm-preserving update note)
def test_norm_preserving_update_keeps_the_norm_where_nearest_loses_it():
    key = jax.random.key(0)
    p = {"w": jax.random.normal(key, (256, 256), jnp.float32).astype(jnp.float8_e4m3fn)}
    u = {"w": 3e-3 * jax.random.normal(jax.random.key(1), (256, 256), jnp.float32)}
    intended = float(jnp.linalg.norm(u["w"]))
    for rule, lo, hi in [("nearest", 0.0, 0.5), ("norm_preserving", 0.97, 1.03)]:
        tx = O.update_rule(rule)
        d, _ = jax.jit(tx.update)(u, tx.init(p), p)
        ratio = float(jnp.linalg.norm(d["w"])) / intended
        assert lo <= ratio <= hi, (rule, ratio)


# ---------------------------------------------------------------- bad input
def test_bad_input_raises_clear_errors():
    tx = O.kahan_summation()
    with pytest.raises(ValueError, match="unsupported parameter dtype 'int32'"):
        tx.init({"w": jnp.zeros(3, jnp.int32)})
    p = {"w": jnp.zeros(3, jnp.bfloat16)}
    st = tx.init(p)
    with pytest.raises(ValueError, match="trees differ"):
        tx.update({"v": jnp.zeros(3)}, st, p)
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update({"w": jnp.zeros(3)}, st)
    with pytest.raises(ValueError, match="shape"):
        tx.update({"w": jnp.zeros(4)}, st, p)
    with pytest.raises(ValueError, match="unsupported parameter dtype 'float8_e4m3fnuz'"):
        tx = O.stochastic_rounding()
        tx.update({"w": jnp.zeros(3)}, tx.init({}), {"w": jnp.zeros(3, jnp.float8_e4m3fnuz)})
    with pytest.raises(ValueError, match="unknown update rule 'kahn'"):
        O.update_rule("kahn")


def test_fused_kahan_adamw_through_nnx_optimizer_equals_the_functional_step():
    def loss(m, x):
        return jnp.sum(m(x.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)  # bf16 -> f32

    x = jax.random.normal(jax.random.key(1), (4, 16), jnp.float32)
    model = nnx.Linear(16, 8, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    twin = nnx.Linear(16, 8, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)  # split shares Variables: use a twin
    graphdef, params = nnx.split(twin, nnx.Param)
    tx = O.kahan_adamw(1e-3, weight_decay=0.1)  # stochastic moments: keys from leaf names, same for Variables
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    state = tx.init(params)

    @jax.jit
    def functional(params, state):
        grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p), x))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(3):
        opt.update(model, nnx.grad(loss)(model, x))
        params, state = functional(params, state)
    assert model.kernel[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(model.kernel[...], np.float32), np.asarray(params["kernel"][...], np.float32)
    )
    np.testing.assert_array_equal(np.asarray(model.bias[...], np.float32), np.asarray(params["bias"][...], np.float32))
    w0 = np.asarray(nnx.Linear(16, 8, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16).kernel[...], np.float32)
    assert np.abs(np.asarray(model.kernel[...], np.float32) - w0).max() > 1e-3  # 3 Adam steps of lr 1e-3 moved it


def test_leaf_names_ignore_the_nnx_variable_wrapper():
    from lpt.optim.leaves import leaf_name

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    wrapped = [leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]]
    pure = [leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.as_pure(nnx.state(model)))[0]]
    assert wrapped == pure == ["['bias']", "['kernel']"]  # keystr alone gives "['bias'].value" for the first
