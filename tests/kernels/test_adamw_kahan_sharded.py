"""Per-shard wrappers of the AdamW kernel (lpt.kernels.adamw_kahan.sharded). Without a mesh they are the kernel itself
(interpret mode here); the multi-device numbers and compiles are in test_kernels_sharded.py."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_adamw_kahan import HP, _leaf

from lpt.kernels.adamw_kahan import StepOptions
from lpt.kernels.adamw_kahan.kernel import adamw_kahan
from lpt.kernels.adamw_kahan.math import adamw_kahan_reference
from lpt.kernels.adamw_kahan.sharded import adamw_kahan_on_shards, adamw_kahan_partitioned


@pytest.mark.parametrize("wrapper", ["on_shards", "partitioned"])
def test_without_a_mesh_the_wrappers_are_the_kernel(wrapper):
    g, p, c, mv = _leaf((96, 160), 3)
    scalars = jnp.asarray([1.5, 2.0, -1e-3, 0.0], jnp.float32)
    words = jnp.asarray([11, 13], jnp.uint32)
    options = StepOptions(**HP, stochastic=True, interpret=True)
    ref = adamw_kahan_reference(g, p, c, mv, scalars, words, options=options)
    direct = adamw_kahan(g, p, c, mv, scalars, words, options=options)
    if wrapper == "on_shards":
        out = adamw_kahan_on_shards(g, p, c, mv, scalars, words, options=options, spec=P("data", None))
    else:
        out = adamw_kahan_partitioned(g, p, c, mv, scalars, words, options=options)
    for a, b, r in zip(out, direct, ref, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))


def test_on_shards_rejects_a_leaf_that_does_not_split():
    import jax

    mesh = jax.sharding.AbstractMesh((2, 2), ("data", "tensor"))
    g, p, c, mv = _leaf((3, 8), 0)
    scalars, words = jnp.zeros((4,), jnp.float32), jnp.zeros((2,), jnp.uint32)
    options = StepOptions(**HP, stochastic=True)
    with (
        jax.sharding.use_abstract_mesh(mesh),
        pytest.raises(ValueError, match=r"dimension 0 of a \(3, 8\) leaf=3 is not divisible by mesh axes \('data',\)"),
    ):
        adamw_kahan_on_shards(g, p, c, mv, scalars, words, options=options, spec=P("data", None))
