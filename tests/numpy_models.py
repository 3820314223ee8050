"""Test models whose weights numpy draws: no init program to compile per config (test_decode, test_transformer_forward,
test_sliding_window_model, test_precision_recipe)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import lpt.models as M
from lpt.options import build


def numpy_init(cfg, precision, seed=1):
    """build_model's model of ``cfg`` / ``precision`` (float32 storage) with its init recipe drawn by numpy instead
    of its jitted init program (one compile per config): each parameter N(0, init_std²) from its ``init_std``
    metadata, or its ``init_const``. A bad config raises build_model's error as build_model does (checked before
    ``nnx.eval_shape``, which would append to the message)."""
    spec, prec = M.model_spec(cfg), build(M.Precision, precision)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: M.build_model(spec, prec, rngs=nnx.Rngs(0))))
    rng = np.random.RandomState(seed)

    def draw(v):
        assert v.dtype == jnp.float32, v
        meta = v.get_metadata()
        if "init_std" in meta:
            w = meta["init_std"] * rng.standard_normal(v.shape)
        else:
            w = np.full(v.shape, meta["init_const"])
        return v.replace(jnp.asarray(w.astype(np.float32)))  # f64 -> f32 by numpy: nothing compiled

    return nnx.merge(graphdef, jax.tree.map(draw, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable)))
