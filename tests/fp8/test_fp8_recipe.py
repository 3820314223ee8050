"""lpt.fp8.recipe: the one ``impl`` vocabulary of both recipes, each recipe's subset of it and its one-line refusal of
the rest, and the block-scale rule that blockwise FP8 quantizes with."""

import jax.numpy as jnp
import numpy as np
import pytest

from lpt.fp8 import block_scaled_dot, blockwise, blockwise_dot, microscaling, quantize_tiles, recipe
from lpt.numerics import scaling


def test_each_recipe_takes_a_subset_of_one_vocabulary():
    assert set(blockwise.IMPLS) | set(microscaling.IMPLS) == set(recipe.IMPLS)
    assert set(blockwise.IMPLS) & set(microscaling.IMPLS) == {"auto", "xla"}
    with pytest.raises(ValueError, match=r"\['cudnn'\] are not GEMM implementations of lpt.fp8"):
        recipe.impls("xla", "cudnn")


@pytest.mark.parametrize(
    "call,impl,allowed,name",
    [
        (lambda impl: blockwise_dot(np.ones((4, 128), np.float32), np.ones((128, 128), np.float32), impl=impl),
         "scaled_matmul", blockwise.IMPLS, "blockwise FP8"),
        (lambda impl: block_scaled_dot(np.ones((4, 32), np.float32), np.ones((32, 32), np.float32), "mxfp8", impl=impl),
         "pallas", microscaling.IMPLS, "recipe 'mxfp8'"),
    ],
)  # fmt: skip
def test_an_impl_of_the_other_recipe_is_refused_in_one_line(call, impl, allowed, name):
    with pytest.raises(ValueError) as e:
        call(impl)
    msg = str(e.value)
    assert msg == f"impl must be one of {allowed} for {name}, got {impl!r}", msg
    assert "\n" not in msg


def test_blockwise_scales_are_the_shared_rule():
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32) * np.float32(1e-3)
    for scale_format in recipe.SCALE_FORMATS:
        _, s = quantize_tiles(x, jnp.float8_e4m3fn, scale_format=scale_format)
        amax = np.abs(x).reshape(4, 2, 128).max(-1)
        want = recipe.block_scale(jnp.asarray(amax), jnp.float8_e4m3fn, scale_format)
        got_bits, want_bits = np.asarray(s).view(np.int32), np.asarray(want).view(np.int32)
        if scale_format == "f32":  # amax / fp8 max: XLA:CPU may turn the division into a reciprocal multiply
            assert np.abs(got_bits - want_bits).max() <= 1  # f32 ulps
        else:  # a power of two: exact on every CPU
            np.testing.assert_array_equal(got_bits, want_bits)
    assert recipe.block_scale is scaling.block_scale
