"""The Mosaic GPU variant of the fused AdamW + Kahan step (Hopper and Blackwell, 16-bit moments): interpreted on CPU
bit for bit against the XLA twin through ``adamw_kahan``'s own operand preparation (flattened and padded leaves, the
2-D grid over several CTAs and pipeline steps, a shard of a leaf), and compiled deviceless for an H100 and a B200 as
one ``mosaic_gpu_v2`` call whose outputs alias the params, compensation and moments."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from lpt import targets
from lpt.kernels import dispatch
from lpt.kernels.adamw_kahan import kernel as kernel_lib
from lpt.kernels.adamw_kahan import mosaic_gpu as mg
from lpt.kernels.adamw_kahan.kernel import adamw_kahan
from lpt.kernels.adamw_kahan.math import adamw_kahan_reference, shard_index_map

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


@pytest.fixture
def interpreted_mgpu(monkeypatch):
    """``adamw_kahan`` with its CUDA choice made on a CPU: the Mosaic GPU variant, run in the Mosaic GPU
    interpreter (everything else of ``adamw_kahan``, the operand preparation, unchanged)."""
    monkeypatch.setattr(kernel_lib, "adamw_kahan_mgpu", functools.partial(mg.adamw_kahan_mgpu, interpret=True))

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
    hp = dict(HP, stochastic=stochastic)
    out = jax.jit(functools.partial(adamw_kahan, **hp))(g, p, c, mv, SCALARS, WORDS)
    _assert_bits_equal(out, adamw_kahan_reference(g, p, c, mv, SCALARS, WORDS, **hp))
    assert np.mean(np.asarray(out[0]) != np.asarray(p)) > 0.5  # the step moved most params


def test_interpreted_mgpu_shard_hashes_global_indices(interpreted_mgpu):
    """The second half (rows 128..255) of a (256, 256) leaf as a shard: its stochastic bits are the whole leaf's, so
    the shard's step equals the twin's step on the whole leaf, restricted to those rows; an index map that ignored
    the offset would hash the first half's indices."""
    g, p, c, mv = _leaf((256, 256), seed=2)
    hp = dict(HP, stochastic=True)
    whole = adamw_kahan_reference(g, p, c, mv, SCALARS, WORDS, **hp)
    half = slice(128, 256)
    offset = jnp.uint32(128 * 256)
    step = functools.partial(adamw_kahan, **hp, global_shape=(256, 256))
    out = jax.jit(step)(g[half], p[half], c[half], mv[half], SCALARS, WORDS, offset=offset)
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
    step = functools.partial(adamw_kahan, **HP, stochastic=True)
    with targets.lowering_for(topology):
        return jax.jit(step, donate_argnums=(1, 2, 3)).lower(*args).compile().as_text()


@pytest.mark.parametrize("topology", ["h100:1x1x1", "b200:1x1x1"])
def test_compiles_as_one_mosaic_gpu_call_updating_in_place(topology):
    """One ``mosaic_gpu_v2`` call, no Triton call, and its three outputs alias the donated p, c and mv: no copy of
    a 4M-element leaf is added around the kernel (a launch with fresh outputs would need three)."""
    text = _compiled(topology)
    assert re.findall(r'custom_call_target="([^"]+)"', text) == ["mosaic_gpu_v2"]
    assert "triton" not in text
    kernel = next(line for line in text.splitlines() if "mosaic_gpu_v2" in line)
    aliased = re.findall(r"\{\d*\}: \((\d+), \{\}\)", kernel)  # output index: (operand index, ...)
    assert len(aliased) == 3, kernel[:400]
    assert not re.search(r"= \S+ copy\(", text)


def test_mosaic_gpu_serves_hopper_and_blackwell_and_triton_the_rest():
    class Gpu:
        platform = "gpu"

        def __init__(self, kind, cc=None):
            self.device_kind, self.compute_capability = kind, cc

    assert dispatch.mosaic_gpu_target(Gpu("NVIDIA H100 80GB HBM3"))
    assert dispatch.mosaic_gpu_target(Gpu("NVIDIA B200"))
    assert dispatch.mosaic_gpu_target(Gpu("anything", "10.0")) and dispatch.mosaic_gpu_target(Gpu("x", "9.0"))
    assert not dispatch.mosaic_gpu_target(Gpu("NVIDIA A100-SXM4-80GB", "8.0"))
    assert not dispatch.mosaic_gpu_target(Gpu("NVIDIA GeForce RTX 5090", "12.0"))
    assert not dispatch.mosaic_gpu_target(jax.devices("cpu")[0])


def test_8bit_moments_stay_on_triton_on_an_h100():
    """The Mosaic GPU variant covers 16-bit moments; 8-bit moments (a per-row amax) lower with Triton."""
    from lpt.optim import moments8 as M8
    from tests.kernels.test_adamw_kahan_8bit import random_state8

    g, p, c, codes, scales, scalars, words, moments8 = random_state8((64, 256), sorted(M8.MOMENT8)[0], seed=3)
    step = functools.partial(adamw_kahan, **HP, stochastic=True, scales=scales, moments8=moments8)
    with targets.lowering_for("h100:1x1x1"):
        text = jax.jit(step).trace(g, p, c, codes, scalars, words).lower(lowering_platforms=("cuda",)).as_text()
    assert "lpt_adamw_kahan8" in text and "mosaic_gpu_v2" not in text


def test_rejects_operands_it_cannot_tile():
    g, p, c, mv = _leaf((24, 200), seed=3)
    with pytest.raises(ValueError, match="width a multiple of 128"):
        mg.adamw_kahan_mgpu(SCALARS, jnp.zeros(3, jnp.uint32), g, p, c, mv, hp=dict(HP, stochastic=False))
