"""The Mosaic GPU variant of the fused AdamW + Kahan step (Hopper): interpreted on CPU against the XLA
twin through ``adamw_kahan``'s own operand preparation (flattened and padded leaves, the 2-D grid over several CTAs
and pipeline steps, a shard of a leaf; 16-bit moments bit for bit, 8-bit moments within one code step on a few
elements), and compiled deviceless for an H100 as one ``mosaic_gpu_v2`` call whose outputs alias the params,
compensation and moments; a B200 keeps the Triton kernel."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED
from jax import lax
from test_adamw_kahan_8bit import random_state8

from lpt import targets
from lpt.kernels import dispatch
from lpt.kernels.adamw_kahan import StepOptions
from lpt.kernels.adamw_kahan import kernel as kernel_lib
from lpt.kernels.adamw_kahan import mosaic_gpu as mg
from lpt.kernels.adamw_kahan.kernel import adamw_kahan
from lpt.kernels.adamw_kahan.math import adamw_kahan_reference, shard_index_map
from lpt.optim import moments8 as M8

HP = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
SCALARS = jnp.asarray([1 / 0.19, 1 / 0.002, -1e-2, 0.0], jnp.float32)
WORDS = jnp.asarray([7, 11], jnp.uint32)


def _leaf(shape, seed, g_dtype=jnp.float32):
    kg, kp, kc, km = jax.random.split(jax.random.key(seed), 4)
    g = jax.random.normal(kg, shape, jnp.float32).astype(g_dtype)  # f32 -> the gradient dtype
    p = jax.random.normal(kp, shape, jnp.float32).astype(jnp.bfloat16)  # f32 -> bf16
    c = (jax.random.normal(kc, shape, jnp.float32) * 1e-3).astype(jnp.bfloat16)  # f32 -> bf16
    mv = jax.random.bits(km, shape, jnp.uint32) & jnp.uint32(0x3F7F3F7F)  # two positive bf16 moments below 1
    return g, p, c, mv


def _interpreted(fn):
    """A Mosaic GPU entry point run in the Mosaic GPU interpreter: its ``options`` with ``interpret=True``."""
    return lambda *args, options, **kw: fn(*args, options=dataclasses.replace(options, interpret=True), **kw)


@pytest.fixture
def interpreted_mgpu(monkeypatch):
    """``adamw_kahan`` with its CUDA choice made on a CPU: the Mosaic GPU variant, run in the Mosaic GPU
    interpreter (everything else of ``adamw_kahan``, the operand preparation, unchanged)."""
    monkeypatch.setattr(kernel_lib, "adamw_kahan_mgpu", _interpreted(mg.adamw_kahan_mgpu))

    def platform_call(build, *args, interpret, mosaic_gpu=False):
        assert mosaic_gpu  # adamw_kahan offers the variant for 16-bit moments
        return build("mosaic_gpu")(*args)

    monkeypatch.setattr(dispatch, "platform_call", platform_call)


def _assert_bits_equal(out, ref):
    for a, b in zip(out, ref, strict=True):
        bits = jnp.uint16 if a.dtype == jnp.bfloat16 else a.dtype
        np.testing.assert_array_equal(
            np.asarray(lax.bitcast_convert_type(a, bits)), np.asarray(lax.bitcast_convert_type(b, bits))
        )


@pytest.mark.parametrize(
    "shape, stochastic, g_dtype",
    [
        ((48, 200), True, jnp.float32),  # flattened, zero-padded to 128 rows of 128: one CTA, 8 pipeline steps
        ((256, 256), True, jnp.bfloat16),  # the 2-D grid: 2 x 2 CTAs of 8 steps, hashed by row-major index
        ((3, 128, 128), False, jnp.float32),  # a stacked leaf on the 2-D grid, nearest moments
    ],
    ids=["flattened", "grid2d-bf16-grads", "stacked-nearest"],
)
def test_interpreted_mgpu_step_equals_the_twin_bit_for_bit(interpreted_mgpu, shape, stochastic, g_dtype):
    g, p, c, mv = _leaf(shape, seed=1, g_dtype=g_dtype)
    options = StepOptions(**HP, stochastic=stochastic)
    out = jax.jit(functools.partial(adamw_kahan, options=options), compiler_options=UNOPTIMIZED)(
        g, p, c, mv, SCALARS, WORDS
    )
    _assert_bits_equal(out, adamw_kahan_reference(g, p, c, mv, SCALARS, WORDS, options=options))
    assert np.mean(np.asarray(out[0]) != np.asarray(p)) > 0.5  # the step moved most params


def test_interpreted_mgpu_shard_hashes_global_indices(interpreted_mgpu):
    """The second half (rows 128..255) of a (256, 256) leaf as a shard: its stochastic bits are the whole leaf's, so
    the shard's step equals the twin's step on the whole leaf, restricted to those rows; an index map that ignored
    the offset would hash the first half's indices."""
    g, p, c, mv = _leaf((256, 256), seed=2)
    options = StepOptions(**HP, stochastic=True)
    whole = adamw_kahan_reference(g, p, c, mv, SCALARS, WORDS, options=options)
    half = slice(128, 256)
    offset = jnp.uint32(128 * 256)
    step = lambda *leaf, offset: adamw_kahan(*leaf, options=options, shard=((256, 256), offset))
    out = jax.jit(step, compiler_options=UNOPTIMIZED)(
        g[half], p[half], c[half], mv[half], SCALARS, WORDS, offset=offset
    )
    _assert_bits_equal(out, tuple(x[half] for x in whole))
    assert shard_index_map((128, 256), (256, 256), offset)(jnp.uint32(0)) == 128 * 256


def _compiled(topology: str, shape=(4096, 1024)):
    try:
        device = targets.devices(topology)[0]
    except ValueError as e:  # jax's CUDA plugin is not installed: no compile-only GPU target
        pytest.skip(f"no compile-only {topology} target: {e}")
    one = jax.sharding.SingleDeviceSharding(device)
    shapes = [(shape, jnp.bfloat16)] * 3 + [(shape, jnp.uint32), ((4,), jnp.float32), ((2,), jnp.uint32)]
    args = [jax.ShapeDtypeStruct(s, d, sharding=one) for s, d in shapes]
    step = functools.partial(adamw_kahan, options=StepOptions(**HP, stochastic=True))
    with targets.lowering_for(topology):
        return jax.jit(step, donate_argnums=(1, 2, 3)).lower(*args).compile().as_text()


def test_compiles_as_one_mosaic_gpu_call_updating_in_place():
    """One ``mosaic_gpu_v2`` call, no Triton call, and its three outputs alias the donated p, c and mv: no copy of
    a 4M-element leaf is added around the kernel (a launch with fresh outputs would need three)."""
    text = _compiled("h100:1x1x1")
    assert re.findall(r'custom_call_target="([^"]+)"', text) == ["mosaic_gpu_v2"]
    assert "triton" not in text
    kernel = next(line for line in text.splitlines() if "mosaic_gpu_v2" in line)
    aliased = re.findall(r"\{\d*\}: \((\d+), \{\}\)", kernel)  # output index: (operand index, ...)
    assert len(aliased) == 3, kernel[:400]
    assert not re.search(r"= \S+ copy\(", text)


def test_mosaic_gpu_serves_hopper_and_triton_the_rest():
    """adamw_kahan lowered for a mesh of H100s runs the Mosaic GPU variant; for B200s (Blackwell) the Triton kernel."""
    g, p, c, mv = _leaf((64, 256), seed=4)
    step = functools.partial(adamw_kahan, options=StepOptions(**HP, stochastic=True))
    texts = {}
    for topology in ("h100:1x1x1", "b200:1x1x1"):
        try:
            with targets.lowering_for(topology):
                texts[topology] = jax.jit(step).trace(g, p, c, mv, SCALARS, WORDS).lower(lowering_platforms=("cuda",))
        except ValueError as e:
            pytest.skip(f"no compile-only {topology} target: {e}")
    h100, b200 = (texts[t].as_text() for t in ("h100:1x1x1", "b200:1x1x1"))
    assert "mosaic_gpu_v2" in h100 and "triton" not in h100
    assert "triton" in b200 and "mosaic_gpu_v2" not in b200


@pytest.fixture
def interpreted_mgpu8(monkeypatch):
    """As ``interpreted_mgpu``, for the 8-bit variant."""
    monkeypatch.setattr(kernel_lib, "adamw_kahan8_mgpu", _interpreted(mg.adamw_kahan8_mgpu))
    monkeypatch.setattr(dispatch, "platform_call", lambda build, *args, **_: build("mosaic_gpu")(*args))


def _codes_apart(a, b) -> np.ndarray:
    """Per element, how many FP8 code steps the m and the v code of two packed uint16 codes differ by (the larger)."""
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    step = lambda x: np.where(x & 0x80, -(x & 0x7F), x & 0x7F)  # sign-magnitude code -> ordered integer
    return np.maximum(abs(step(a >> 8) - step(b >> 8)), abs(step(a & 0xFF) - step(b & 0xFF)))


@pytest.mark.parametrize(
    "spec, shape, stochastic",
    [
        ("float8_e4m3fn", (40, 256), True),  # flattened and padded to 128 rows: 2 blocks of 64 rows
        ("e4m3_m_e5m2_v_direct", (128, 256), False),  # the 2-D grid: 2 column blocks
        ("float8_e5m2", (2, 64, 384), True),  # a stacked leaf on the 2-D grid, 3 column blocks
        ("e4m3_v_direct", (2, 64, 384), False),
    ],
)
def test_interpreted_mgpu_8bit_step_equals_the_twin(interpreted_mgpu8, spec, shape, stochastic):
    """8-bit moments in the WGMMA layout, the rows' scales as row vectors: the step of ``adamw_kahan`` through the
    Mosaic GPU variant against the twin. Both are XLA:CPU programs, and XLA:CPU turns some divisions by a broadcast
    block scale into multiplications by its reciprocal, differently per program; so a moment code may land one
    grid step apart (seen: 1 element of 49,152). The scales agree bit for bit; at most 2^-12 of the elements may
    differ, each by one code step, and p and c only there. A wrong tile, row or scale moves most elements."""
    g, p, c, codes, scales, scalars, words, moments8 = random_state8(shape, spec, seed=2)
    options = StepOptions(**HP, stochastic=stochastic, moments8=moments8)
    step = lambda *a: adamw_kahan(*a, scales, options=options)
    out = jax.jit(step, compiler_options=UNOPTIMIZED)(g, p, c, codes, scalars, words)
    ref = adamw_kahan_reference(g, p, c, codes, scalars, words, scales, options=options)
    np.testing.assert_array_equal(np.asarray(out[3]).view(np.uint32), np.asarray(ref[3]).view(np.uint32))
    apart = _codes_apart(out[2], ref[2])
    assert apart.max() <= 1 and np.mean(apart > 0) <= 2.0**-12, (apart.max(), np.mean(apart > 0))
    for new, old in zip(out[:2], ref[:2], strict=True):
        moved = np.asarray(lax.bitcast_convert_type(new, jnp.uint16) != lax.bitcast_convert_type(old, jnp.uint16))
        assert not np.any(moved & (apart == 0))
    assert np.mean(np.asarray(out[0]) != np.asarray(p)) > 0.3  # the step moved the params


def test_8bit_moments_compile_as_one_mosaic_gpu_call():
    topology = "h100:1x1x1"
    try:
        device = targets.devices(topology)[0]
    except ValueError as e:
        pytest.skip(f"no compile-only {topology} target: {e}")
    g, p, c, codes, scales, scalars, words, moments8 = random_state8((2048, 1024), sorted(M8.MOMENT8)[0], seed=3)
    one = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one) for x in (g, p, c, codes, scales, scalars, words)]
    step = functools.partial(adamw_kahan, options=StepOptions(**HP, stochastic=True, moments8=moments8))
    with targets.lowering_for(topology):
        text = jax.jit(lambda g, p, c, m, s, sc, w: step(g, p, c, m, sc, w, s)).lower(*args).compile().as_text()
    assert re.findall(r'custom_call_target="([^"]+)"', text) == ["mosaic_gpu_v2"] and "lpt_adamw_kahan8" in text
    assert "triton" not in text


def test_rejects_operands_it_cannot_tile():
    g, p, c, mv = _leaf((24, 200), seed=3)
    with pytest.raises(ValueError, match="width a multiple of 128"):
        mg.adamw_kahan_mgpu(SCALARS, jnp.zeros(3, jnp.uint32), g, p, c, mv, options=StepOptions(**HP, stochastic=False))
