"""adamw_kahan Pallas kernel: interpret=True vs its XLA twin and vs kahan_adamw(impl="xla") bit for bit over several
steps (multi-block leaves, stochastic moment rounding), and lowering for cuda (Triton) and tpu (Mosaic)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lpt.optim as O
from lpt.kernels.adamw_kahan import adamw_kahan
from lpt.kernels.adamw_kahan_math import adamw_kahan_reference

HP = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)


def _leaf(shape, seed):
    rng = np.random.default_rng(seed)
    g = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    p = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal(shape) * 1e-3, jnp.bfloat16)
    mv = jnp.asarray(rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32) & 0x3FFF3FFF)  # moments >= 0
    return g, p, c, mv


@pytest.mark.parametrize("stochastic", [False, True])
def test_interpret_matches_xla_twin(stochastic):
    g, p, c, mv = _leaf((37, 129), seed=0)  # 4773 elements: 3 blocks of 16 x 128, the last one padded
    scalars = jnp.asarray([1 / 0.19, 1 / 0.002, -1e-2, 0.0], jnp.float32)
    words = jnp.asarray([1, 2], jnp.uint32)
    kernel = jax.jit(functools.partial(adamw_kahan, **HP, stochastic=stochastic, block_rows=16, interpret=True))
    ref = jax.jit(functools.partial(adamw_kahan_reference, **HP, stochastic=stochastic))
    # the twin's stochastic rounding is lpt.numerics.round_stochastic on the whole leaf: the kernel must draw the
    # same hash bits from each block's global indices
    for out, expect in zip(kernel(g, p, c, mv, scalars, words), ref(g, p, c, mv, scalars, words), strict=True):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(expect))
    moved = np.mean(np.asarray(kernel(g, p, c, mv, scalars, words)[0]) != np.asarray(p))
    assert moved > 0.5, moved


def test_kahan_adamw_pallas_interpreted_equals_xla_over_steps():
    rng = np.random.default_rng(1)
    p = {"w": jnp.asarray(rng.standard_normal((40, 130)), jnp.bfloat16), "b": jnp.zeros(5, jnp.float32)}
    kw = dict(weight_decay=0.1, seed=3)  # stochastic moments (the default)
    out = {}
    for impl in ("xla", "pallas"):
        tx = O.kahan_adamw(optax.linear_schedule(1e-2, 1e-3, 4), impl=impl, interpret=True, **kw)

        @jax.jit
        def step(g, st, q, tx=tx):
            d, st = tx.update(g, st, q)
            return optax.apply_updates(q, d), st

        q, st = p, tx.init(p)
        for i in range(3):
            g = jax.tree.map(
                lambda x, i=i: jnp.sin(jnp.arange(x.size, dtype=jnp.float32) * (i + 1)).reshape(x.shape), p
            )
            q, st = step(jax.tree.map(lambda x, y: x.astype(y.dtype), g, p), st, q)
        out[impl] = (q, st)
    (qx, sx), (qp, sp) = out["xla"], out["pallas"]
    for a, b in zip(jax.tree.leaves((qx, sx)), jax.tree.leaves((qp, sp)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.any(np.asarray(sx.compensation["w"], np.float32) != 0)


@pytest.mark.parametrize("platform,marker", [("cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu_custom_call")])
def test_lowers_to_the_kernel(platform, marker):
    g, p, c, mv = _leaf((40, 300), seed=2)
    scalars, words = jnp.ones(4, jnp.float32), jnp.arange(2, dtype=jnp.uint32)
    f = functools.partial(adamw_kahan, **HP, stochastic=True)  # interpret=None: platform_dependent
    text = jax.jit(f).trace(g, p, c, mv, scalars, words).lower(lowering_platforms=(platform,)).as_text()
    assert marker in text


def test_bad_input():
    g, p, c, mv = _leaf((4, 4), seed=3)
    s, w = jnp.ones(4, jnp.float32), jnp.arange(2, dtype=jnp.uint32)
    with pytest.raises(ValueError, match="interpret must be None"):
        adamw_kahan(g, p, c, mv, s, w, **HP, stochastic=False, interpret=False)
    with pytest.raises(ValueError, match="needs bf16 params"):
        adamw_kahan(g, p.astype(jnp.float16), c, mv, s, w, **HP, stochastic=False)
    with pytest.raises(ValueError, match="block_rows must be a power of two"):
        adamw_kahan(g, p, c, mv, s, w, **HP, stochastic=False, block_rows=24)
