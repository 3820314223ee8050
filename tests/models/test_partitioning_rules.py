"""Logical axis rules: first unused match wins, constrain is a no-op outside axis_rules, param specs from metadata."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

import lpt.models as M
from lpt import sharding as S
from lpt.models import partitioning as P

RULES = S.RULES


def test_logical_to_mesh_first_unused_rule_wins():
    assert S.logical_to_mesh(("batch", "length", "embed"), RULES) == PartitionSpec(("data", "fsdp"), None, None)
    assert S.logical_to_mesh(("embed", "mlp"), RULES) == PartitionSpec("fsdp", "tensor")
    assert S.logical_to_mesh(("heads", "kv_heads"), RULES) == PartitionSpec("tensor", None)  # tensor used once
    assert S.logical_to_mesh((None, "unknown"), RULES) == PartitionSpec(None, None)
    two = (("embed", "tensor"), ("embed", "fsdp"), ("mlp", "tensor"))
    assert S.logical_to_mesh(("mlp", "embed"), two) == PartitionSpec("tensor", "fsdp")


def test_constrain_is_identity_outside_and_annotates_inside():
    x = jnp.ones((4, 8, 16))
    assert S.constrain(x, ("batch", "length", "embed")) is x
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    # a fresh function per trace: jax caches traces per function, and the rules are read at trace time
    with S.axis_rules(mesh, RULES):
        inside = jax.jit(lambda x: S.constrain(x * 2, ("batch", "length", "embed"))).lower(x).as_text()
    outside = jax.jit(lambda x: S.constrain(x * 2, ("batch", "length", "embed"))).lower(x).as_text()
    assert 'sharding_constraint %1 <@mesh, [{"data", "fsdp"}, {}, {}]>' in inside
    assert "sharding_constraint" not in outside


def test_param_partition_specs_follow_param_metadata():
    cfg = dict(kind="llama", vocab_size=256, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16)
    model = nnx.eval_shape(lambda: M.build_model(cfg, {}, rngs=nnx.Rngs(0)))
    specs = P.param_partition_specs(nnx.state(model), RULES)
    flat = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(specs)}
    assert flat["blocks/0/attn/q/kernel"] == PartitionSpec("fsdp", "tensor")
    assert flat["blocks/0/attn/k/kernel"] == PartitionSpec("fsdp", "tensor")
    assert flat["blocks/0/attn/o/kernel"] == PartitionSpec("tensor", "fsdp")
    assert flat["blocks/0/mlp/down/kernel"] == PartitionSpec("tensor", "fsdp")
    assert flat["embed/embedding"] == PartitionSpec("tensor", "fsdp")
    assert flat["lm_head/kernel"] == PartitionSpec("fsdp", "tensor")
    assert flat["blocks/0/norm1/scale"] == PartitionSpec("fsdp")
