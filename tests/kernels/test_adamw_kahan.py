"""adamw_kahan Pallas kernel: interpret=True vs its XLA twin and vs kahan_adamw(impl="xla") bit for bit over several
steps (multi-block leaves, stochastic moment rounding), and lowering for cuda (Mosaic GPU on an H100) and tpu
(Mosaic)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cpu_compile import UNOPTIMIZED
from lowering import lowering

import lpt.optim as O
from lpt.kernels.adamw_kahan import StepOptions
from lpt.kernels.adamw_kahan.kernel import adamw_kahan
from lpt.kernels.adamw_kahan.math import adamw_kahan_reference

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
    options = StepOptions(**HP, stochastic=stochastic, block_rows=16, interpret=True)
    # LLVM's optimizations off: the kernel's math and its twin's are the same element-wise ops, each rounded where it
    # is written, products kept out of FMAs by a runtime zero (lpt.kernels.adamw_kahan.math): equal under any compile
    kernel = jax.jit(functools.partial(adamw_kahan, options=options), compiler_options=UNOPTIMIZED)
    ref = jax.jit(functools.partial(adamw_kahan_reference, options=options), compiler_options=UNOPTIMIZED)
    # the twin's stochastic rounding is lpt.numerics.round_stochastic on the whole leaf: the kernel must draw the
    # same hash bits from each block's global indices
    for out, expect in zip(kernel(g, p, c, mv, scalars, words), ref(g, p, c, mv, scalars, words), strict=True):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(expect))
    moved = np.mean(np.asarray(kernel(g, p, c, mv, scalars, words)[0]) != np.asarray(p))
    assert moved > 0.5, moved


def kahan_adamw_steps(impl: str, params, steps: int, **kw):
    """(params, state) after ``steps`` jitted steps of ``kahan_adamw(impl=...)`` (weight decay 0.1, stochastic moments
    seeded 3, a decaying lr) on sin gradients that change every step. Compiled with LLVM's optimizations off: both
    impls run the same element-wise math, rounded where it is written and kept out of FMAs (lpt.kernels.adamw_kahan.
    math), and the same scalar code, so they agree under any compile."""
    tx = O.kahan_adamw(optax.linear_schedule(1e-2, 1e-3, 4), impl=impl, weight_decay=0.1, seed=3, **kw)

    @functools.partial(jax.jit, compiler_options=UNOPTIMIZED)
    def step(g, st, q):
        d, st = tx.update(g, st, q)
        return optax.apply_updates(q, d), st

    q, st = params, tx.init(params)
    for i in range(steps):
        g = jax.tree.map(lambda x, i=i: jnp.sin(jnp.arange(x.size, dtype=jnp.float32) * (i + 1)).reshape(x.shape), q)
        q, st = step(jax.tree.map(lambda x, y: x.astype(y.dtype), g, params), st, q)
    return q, st


def test_kahan_adamw_pallas_interpreted_equals_xla_over_steps():
    rng = np.random.default_rng(1)
    p = {"w": jnp.asarray(rng.standard_normal((40, 130)), jnp.bfloat16), "b": jnp.zeros(5, jnp.float32)}
    out = {impl: kahan_adamw_steps(impl, p, 3, interpret=True) for impl in ("xla", "pallas")}
    (qx, sx), (qp, sp) = out["xla"], out["pallas"]
    for a, b in zip(jax.tree.leaves((qx, sx)), jax.tree.leaves((qp, sp)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.any(np.asarray(sx.compensation["w"], np.float32) != 0)


@pytest.mark.parametrize("platform,marker", [("cuda", "mosaic_gpu_v2"), ("tpu", "tpu_custom_call")])
def test_lowers_to_the_kernel(platform, marker):
    g, p, c, mv = _leaf((40, 300), seed=2)
    scalars, words = jnp.ones(4, jnp.float32), jnp.arange(2, dtype=jnp.uint32)
    f = functools.partial(adamw_kahan, options=StepOptions(**HP, stochastic=True))  # interpret=None: per platform
    with lowering(platform):
        text = jax.jit(f).trace(g, p, c, mv, scalars, words).lower(lowering_platforms=(platform,)).as_text()
    assert marker in text and "triton" not in text  # an H100: the Mosaic GPU variant


def test_bad_input():
    g, p, c, mv = _leaf((4, 4), seed=3)
    s, w = jnp.ones(4, jnp.float32), jnp.arange(2, dtype=jnp.uint32)
    with pytest.raises(ValueError, match="interpret must be None"):
        adamw_kahan(g, p, c, mv, s, w, options=StepOptions(**HP, stochastic=False, interpret=False))
    with pytest.raises(ValueError, match="needs bf16 params"):
        adamw_kahan(g, p.astype(jnp.float16), c, mv, s, w, options=StepOptions(**HP, stochastic=False))
    with pytest.raises(ValueError, match="block_rows must be a power of two"):
        adamw_kahan(g, p, c, mv, s, w, options=StepOptions(**HP, stochastic=False, block_rows=24))


@pytest.mark.parametrize("shape", [(48, 384), (2, 16, 256)], ids=["matrix", "stacked"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_wide_leaves_run_on_a_2d_grid_and_equal_the_twin(shape, stochastic):
    """A leaf whose last axis is several 128s (and whose rows split into blocks of 16) is tiled in place: (rows, 128)
    tiles of its (m, n) view on a 2-D grid, no (rows, 128) reshape. The stochastic rounding maps each tile element to
    its row-major index, so the bits are the twin's: bit for bit, with blocks of 16 rows (several row blocks)."""
    g, p, c, mv = _leaf(shape, seed=4)
    scalars = jnp.asarray([1 / 0.19, 1 / 0.002, -1e-2, 0.0], jnp.float32)
    words = jnp.asarray([5, 6], jnp.uint32)
    options = StepOptions(**HP, stochastic=stochastic, block_rows=16, interpret=True)
    kernel = functools.partial(adamw_kahan, options=options)
    (eqn,) = [e for e in jax.make_jaxpr(kernel)(g, p, c, mv, scalars, words).eqns if e.primitive.name == "pallas_call"]
    m = int(np.prod(shape[:-1]))
    assert tuple(eqn.params["grid_mapping"].grid) == (m // 16, shape[-1] // 128)
    # LLVM's optimizations off: the same element-wise math as the twin, rounded where it is written, no FMAs
    ref = jax.jit(functools.partial(adamw_kahan_reference, options=options), compiler_options=UNOPTIMIZED)
    run = jax.jit(kernel, compiler_options=UNOPTIMIZED)
    for out, expect in zip(run(g, p, c, mv, scalars, words), ref(g, p, c, mv, scalars, words), strict=True):
        assert out.shape == expect.shape == shape
        np.testing.assert_array_equal(np.asarray(out), np.asarray(expect))


@pytest.mark.parametrize("moment_dtype", [None, "float8_e4m3fn"], ids=["bf16_moments", "8bit_moments"])
def test_wide_leaves_are_not_relaid_out_on_tpu(moment_dtype):
    """Compiled for a TPU v5e: a (1024, 512) leaf reaches the kernel without a reshape of its arrays (a reshape into
    (rows, 128) rows is a relayout there: one more pass over each of g, p, c, the moments and the outputs), with
    16-bit or 8-bit moments; the control, 1028 rows (not a multiple of 16, the flattened path), has them: padded
    and reshaped copies in, slices out."""
    from lpt import targets

    sharding = jax.sharding.SingleDeviceSharding(targets.devices("v5e:2x2")[0])

    def reshapes(rows):
        w = {"w": jax.ShapeDtypeStruct((rows, 512), jnp.bfloat16, sharding=sharding)}
        tx = O.kahan_adamw(1e-2, impl="pallas", **({} if moment_dtype is None else {"moment_dtype": moment_dtype}))
        st = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), jax.eval_shape(tx.init, w)
        )
        text = jax.jit(tx.update).lower(w, st, w).compile().as_text()
        entry = text[text.index("\nENTRY") :]
        # the arrays that something other than the kernel makes in (rows, 128) rows: relayouts, pads and slices
        return sum(bool(re.search(r"= \w+\[\d+,128\]", ln)) and "custom-call(" not in ln for ln in entry.splitlines())

    assert reshapes(1024) == 0
    assert reshapes(1028) >= 4
