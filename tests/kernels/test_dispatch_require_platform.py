"""``lpt.kernels.dispatch.require_platform``: operands pass through unchanged and add nothing to the program; lowering
for a platform not allowed raises the caller's one-line ValueError (jitted and eager), naming the platform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpt.kernels import dispatch

MESSAGE = "this kernel needs CUDA, lowered for {platform}"


def _f(platforms):
    return lambda x, y: [a * 2 for a in dispatch.require_platform(platforms, MESSAGE, x, y)]


def test_allowed_platform_passes_operands_through_and_adds_nothing():
    x, y = jnp.arange(3.0), jnp.ones((2, 2), jnp.int32)
    out = jax.jit(_f(("cpu",)))(x, y)
    np.testing.assert_array_equal(out[0], 2 * x)
    np.testing.assert_array_equal(out[1], 2 * y)
    plain = jax.jit(lambda x, y: [x * 2, y * 2]).lower(x, y).as_text()
    assert jax.jit(_f(("cpu",))).lower(x, y).as_text() == plain
    cuda = jax.jit(_f(("cuda",))).trace(x, y).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call" not in cuda
    # differentiable and batchable: the identity
    assert jax.jvp(lambda x: _f(("cpu",))(x, y)[0], (x,), (x,))[1].tolist() == (2 * x).tolist()
    assert jax.vmap(lambda x: _f(("cpu",))(x, x)[0])(jnp.ones((2, 3))).shape == (2, 3)


def test_other_platform_raises_the_callers_line():
    x = jnp.arange(3.0)
    for run in (jax.jit(_f(("cuda",))), _f(("cuda",))):  # jitted, and eager
        with pytest.raises(ValueError) as e:
            run(x, x)
        assert str(e.value) == "this kernel needs CUDA, lowered for cpu"
    with pytest.raises(ValueError, match="lowered for tpu"):
        jax.jit(_f(("cuda",))).trace(x, x).lower(lowering_platforms=("tpu",))
