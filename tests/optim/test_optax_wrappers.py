"""lpt's optimizers under optax's own wrappers, for bf16, f16 and f32 params (in the style of optax's harness).

A wrapper that is transparent on a good step (inject_hyperparams with float32 hyperparameters, masked with every
leaf on, apply_if_finite with finite gradients, multi_transform sending every leaf to the lpt optimizer) reaches the
plain optimizer's loss within 1% (not bit for bit: the wrapped step is another computation, and optax's own Adam
computes in float32 once its hyperparameters are float32 arrays); MultiSteps and reduce_on_plateau still converge.
inject_hyperparams with its default hyperparameter dtype (the params': b2 = 0.999 becomes 1.0 in bf16) is an error
naming hyperparam_dtype. apply_if_finite builds its skip branch from the gradients' dtype: every lpt transform emits
its updates in the params' dtype (the gradients' dtype under jax.grad), so it traces, and a NaN step changes
nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cpu_compile import UNOPTIMIZED

import lpt.optim as O

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
TRANSFORMS = {
    "kahan_adamw": lambda learning_rate=1e-2: O.kahan_adamw(learning_rate, weight_decay=1e-3),
    "adamw_stochastic": lambda learning_rate=1e-2: O.adamw(learning_rate, update="stochastic"),
    "adam_then_kahan": lambda learning_rate=1e-2: optax.chain(optax.adam(learning_rate), O.kahan_summation()),
    "adam_then_sr": lambda learning_rate=1e-2: optax.chain(optax.adam(learning_rate), O.stochastic_rounding()),
    "readme_chain": lambda learning_rate=1e-2: optax.chain(  # the README's chain
        optax.clip_by_global_norm(1.0),
        O.scale_by_adam(),
        O.add_decayed_weights(1e-3),
        optax.scale_by_learning_rate(learning_rate),
        O.kahan_summation(),
    ),
}


def _params(dtype):
    """One leaf: XLA:CPU compiles a kernel per leaf and op, so every leaf more is another copy of each run's program
    to compile (two leaves take twice the time of one), and a wrapper treats one leaf of a dict as it treats any."""
    w = jnp.full((9, 8), 1.0, dtype)
    return {"w": w.at[8].set(jnp.linspace(-1.0, 1.0, 8).astype(dtype))}


def _loss(p):
    return sum(jnp.sum((x.astype(jnp.float32) - 3.0) ** 2) for x in jax.tree.leaves(p))  # param dtype -> f32


def _steps(tx, p, st, steps, plateau=False, update_dtypes=None):
    """(params, state) after ``steps`` steps of ``tx`` on :func:`_loss` from (p, st), traced inside a jitted
    function (a loop in its program); the dtypes of the updates ``tx`` emits are added to the set ``update_dtypes``
    when one is given."""

    def step(_, carry):
        p, st = carry
        g = jax.grad(_loss)(p)  # in the params' dtype
        kw = {"value": _loss(p)} if plateau else {}
        u, st = tx.update(g, st, p, **kw)
        if update_dtypes is not None:
            update_dtypes.update(x.dtype for x in jax.tree.leaves(u))  # at trace time: the updates' avals
        return O.apply_updates(p, u), st

    return jax.lax.fori_loop(0, steps, step, (p, st))


def _same(a, b):
    return all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _close(a, b) -> bool:
    return abs(float(_loss(a)) - float(_loss(b))) <= 0.01 * float(_loss(b))


# wrappers that are transparent on a good step: name -> wrapped optimizer from the optimizer's factory
WRAPPERS = {
    "inject_hyperparams": lambda make: optax.inject_hyperparams(make, hyperparam_dtype=jnp.float32)(learning_rate=1e-2),
    "masked": lambda make: optax.masked(make(), {"w": True}),
    "multi_transform": lambda make: optax.multi_transform({"lpt": make()}, {"w": "lpt"}),
    "apply_if_finite": lambda make: optax.apply_if_finite(make(), 3),
}


# the runs of one dtype: (transform, wrapper) -> (wrapped optimizer from the transform's factory, steps, plateau);
# wrapper None is the plain optimizer
def _runs():
    runs = {}
    for name, make in TRANSFORMS.items():
        runs[name, None] = (make(), 40, False)
        for wname, wrap in WRAPPERS.items():
            runs[name, wname] = (wrap(make), 40, False)
        runs[name, "MultiSteps"] = (optax.MultiSteps(make(), 2), 80, False)  # 40 updates of 2 accumulated steps
        runs[name, "reduce_on_plateau"] = (optax.chain(make(), optax.contrib.reduce_on_plateau()), 40, True)
    return runs


@pytest.fixture(scope="module")
def trained():
    """``trained(dtype)[name, wrapper]``: (params, state, the optimizer, the dtypes of its updates, and for
    apply_if_finite the (updates, state) of one more step on NaN gradients) after the run's steps of
    TRANSFORMS[name], plain (``wrapper=None``), under WRAPPERS[wrapper], under ``"MultiSteps"`` or
    ``"reduce_on_plateau"``. All the runs of one dtype are one jitted program (a loop per run, no value crossing
    between runs): they compile in well under half the time they take as programs of their own. Each dtype is
    trained once per module: several tests read the same run."""
    done = {}

    def get(dtype):
        dtype = jnp.dtype(dtype)
        if dtype.name not in done:
            runs = _runs()
            update_dtypes = {key: set() for key in runs}

            @jax.jit
            def train_all(p0):
                out = []
                for key, (tx, steps, plateau) in runs.items():
                    p, st = _steps(tx, p0, tx.init(p0), steps, plateau, update_dtypes[key])
                    nan_step = None
                    if key[1] == "apply_if_finite":
                        nan = jax.tree.map(lambda x: jnp.full(x.shape, jnp.nan, x.dtype), p)  # the params' dtype
                        nan_step = tx.update(nan, st, p)
                    out.append((p, st, nan_step))
                return out

            p0 = _params(dtype)
            # LLVM's optimizations off: they take a third of the compile, and 40 steps on 72 numbers run in no time
            out = train_all.lower(p0).compile(UNOPTIMIZED)(p0)
            done[dtype.name] = {
                key: (p, st, runs[key][0], update_dtypes[key], nan_step)
                for key, (p, st, nan_step) in zip(runs, out, strict=True)
            }
        return done[dtype.name]

    return get


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", TRANSFORMS)
def test_transparent_wrappers_reach_the_plain_loss(trained, name, dtype):
    plain = trained(dtype)[name, None][0]
    assert float(_loss(plain)) < 0.8 * float(_loss(_params(dtype)))  # it optimizes
    for wname in WRAPPERS:
        got = trained(dtype)[name, wname][0]
        assert _close(got, plain), wname


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", TRANSFORMS)
def test_updates_have_the_gradients_dtype(trained, name, dtype):
    """The updates the plain optimizer emits inside the jitted train step, where the gradients come from jax.grad
    in the params' dtype."""
    assert trained(dtype)[name, None][3] == {jnp.dtype(dtype)}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", TRANSFORMS)
def test_accumulating_and_plateau_wrappers_converge(trained, name, dtype):
    start = float(_loss(_params(dtype)))
    for wname in ("MultiSteps", "reduce_on_plateau"):
        assert float(_loss(trained(dtype)[name, wname][0])) < 0.8 * start, wname


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_inject_hyperparams_in_the_params_dtype_is_an_error_naming_hyperparam_dtype(dtype):
    for make, kw in (
        (O.kahan_adamw, {"learning_rate": 1e-3}),
        (O.adamw, {"learning_rate": 1e-3}),
        (O.scale_by_adam, {}),
    ):
        tx = optax.inject_hyperparams(make)(**kw)
        with pytest.raises(ValueError, match=r"b1 arrived as a .*hyperparam_dtype=jnp.float32"):
            tx.init(_params(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", TRANSFORMS)
def test_apply_if_finite_skips_a_nan_step_without_changing_the_state(trained, name, dtype):
    _, st, _, _, (u, st2) = trained(dtype)[name, "apply_if_finite"]  # 40 good steps, then NaN gradients
    assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(u))  # optax's zeros_like: exact
    assert _same(st2.inner_state, st.inner_state) and int(st2.total_notfinite) == 1
