"""``lpt.eval`` and ``lpt.generate`` on a 4-device CPU mesh: the parameters are split as the trainer splits them
(each device holds about a quarter of the bytes, not all of them), and the loss and the generated tokens are those of
the same model on one device. The parameters split over fsdp and tensor (the trainer's rules); data only splits the
batch. The decode steps compile deviceless for TPU v5e and H100 with the parameters and the KV cache split."""

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from cpu_devices import cpu_env

SCRIPT = """
import dataclasses
import jax, numpy as np
from flax import nnx
import lpt.models as M
from lpt import eval as E, generate as G, inference
from lpt.models.partitioning import place
from lpt.train import config as config_lib, mesh as mesh_lib

spec = dict(kind="llama", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=32)
model = M.build_model(spec, {}, rngs=nnx.Rngs(0))
base = config_lib.load_config_file("tiny_cpu")
data = dataclasses.replace(base.data, seq_len=32)
assert dict(inference.inference_mesh(None).shape) == {"data": 1, "fsdp": 4, "tensor": 1}  # a Hugging Face model: FSDP
run = config_lib.with_values(base, {"train.mesh.data": 2, "train.mesh.tensor": 2})
assert dict(inference.inference_mesh(run).shape) == {"data": 2, "fsdp": 1, "tensor": 2}  # a run's own mesh
run = config_lib.with_values(base, {"train.mesh.data": 1, "train.mesh.fsdp": 8, "train.mesh.tensor": 1})  # 8 devices
assert dict(inference.inference_mesh(run).shape) == {"data": 1, "fsdp": 4, "tensor": 1}
ref = E.evaluate(model, data, batch=8, num_batches=2)["loss"]
prompts = [[84, 104, 101], [65], [100, 101, 102, 32, 120]]
want = G.generate_tokens(model, prompts, max_new_tokens=12)
want_t = G.generate_tokens(model, prompts, max_new_tokens=12, temperature=1.0, seed=3)
# every greedy token leads its runner-up by more than both programs' 6σ of tests/float_bounds.py: the sharded
# programs pick the same tokens whatever order they add their f32 sums in
import sys
sys.path.insert(0, "tests")
from float_bounds import transformer_logits_sigma
for p, new in zip(prompts, want):
    z, sigma = transformer_logits_sigma(model, np.asarray([[*p, *new[:-1]]]))
    steps = np.arange(len(p) - 1, len(p) + len(new) - 1)
    top2 = np.argsort(z[0, steps], -1)[:, -2:]
    assert top2[:, 1].tolist() == list(new)
    gap = np.diff(np.take_along_axis(z[0, steps], top2, -1), axis=-1)[:, 0]
    assert np.all(gap > 6 * np.take_along_axis(sigma[0, steps], top2, -1).sum(-1)), gap
for sizes in ((1, 4, 1), (2, 1, 2)):
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(**dict(zip(("data", "fsdp", "tensor"), sizes))))
    _, state = place(model, mesh)
    leaves = jax.tree.leaves(state)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    print("bytes", sizes, per_device / sum(x.nbytes for x in leaves))
    print("loss", sizes, abs(E.evaluate(model, data, batch=8, num_batches=2, mesh=mesh)["loss"] - ref) / ref)
    print("greedy", sizes, G.generate_tokens(model, prompts, max_new_tokens=12, mesh=mesh) == want)
    got_t = G.generate_tokens(model, prompts, max_new_tokens=12, temperature=1.0, seed=3, mesh=mesh)
    print("sampled", sizes, got_t == want_t)
"""


def test_eval_and_generate_shard_over_four_devices():
    env = cpu_env(4)
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "note: the run's train.mesh {'data': 1, 'fsdp': 8, 'tensor': 1} does not fit the 4 device(s)" in p.stderr
    rows = [line.split(" ", 1) for line in p.stdout.splitlines() if line.split(" ", 1)[0] in ("bytes", "loss")]
    values = {(k, v.rsplit(" ", 1)[0]): float(v.rsplit(" ", 1)[1]) for k, v in rows}
    for sizes, split in (("(1, 4, 1)", 4), ("(2, 1, 2)", 2)):  # params split over fsdp * tensor, not data
        assert values["bytes", sizes] < 1 / split + 0.01  # the norm scales (0.3% of the bytes) are replicated
        # the same loss as on one device up to f32 round-off of another split: the mean of 8·32 positive per-token
        # cross entropies errs by 12σ = 12·sqrt(256/3)·2^-24 = 6.6e-6 relative (independent roundings, exceeded
        # with probability 2e-9); each token's lse − z_y by 2·12σ of its logits (<= 1.1e-5 by tests/float_bounds.py)
        # and the 12σ of its logsumexp's 264 roundings, <= 6e-6 of ln 256: 2e-5 in all
        assert values["loss", sizes] < 2e-5
    # the same greedy tokens (checked above to lead by more than the programs' 6σ) and sampled tokens: a sampled
    # token (Gumbel-max, jax.random.categorical) changes only if the top-2 gap of its perturbed logits is below the
    # programs' logit difference (<= 2·1.1e-5); that gap's density is <= 1 at 0, so all 36 draws keep their token
    # except with probability < 36·2.2e-5 = 8e-4
    assert p.stdout.count(" True") == 4 and " False" not in p.stdout


@pytest.mark.parametrize(("topology", "sizes"), [("v5e:2x2", (1, 4, 1)), ("h100:1x1x8", (1, 4, 2))])
def test_decode_compiles_for_tpu_and_h100_with_params_and_cache_split(topology, sizes):
    """The prefill and the decode step of a bf16 Llama compile deviceless for TPU v5e and H100 on a mesh; each
    device's arguments are its share of the parameters and of the KV cache (the cache's rows split over fsdp, its kv
    heads over tensor), not a replicated cache."""
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    import lpt.models as M
    from lpt import generate as G
    from lpt import sharding, targets
    from lpt.models import partitioning
    from lpt.models.decode import init_cache

    mesh = targets.mesh(topology, sizes, ("data", "fsdp", "tensor"))
    spec = dict(kind="llama", vocab_size=8192, d_model=1024, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=2816)
    prec = {"param_dtype": "bfloat16", "compute_dtype": "bfloat16", "update_rule": "nearest"}
    model = nnx.eval_shape(lambda: M.build_model({**spec, "max_seq_len": 1024}, prec, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    shardings = partitioning.param_shardings(state, mesh, sharding.RULES)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    rep = NamedSharding(mesh, PartitionSpec())
    B, P, S = 8, 64, 512

    def sds(shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    static = dict(graphdef=graphdef, sampling=G.Sampling(0.0, 0, 1.0, 0), mesh=mesh)
    prefill = G._prefill.lower(state, sds((B, P)), sds((B,)), sds((2,), jnp.uint32), length=S, **static).compile()
    cache = jax.eval_shape(lambda: init_cache(nnx.merge(graphdef, state), B, S))
    cache = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache, prefill.output_shardings[1]
    )
    step = G._step.lower(state, sds((B,)), cache, sds((2,), jnp.uint32), sds(()), **static).compile()
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    split = sizes[1] * sizes[2]
    assert cache.k.sharding.spec[1] == "fsdp" and (sizes[2] == 1 or cache.k.sharding.spec[3] == "tensor")
    assert step.memory_analysis().argument_size_in_bytes < 1.02 * (param_bytes + cache_bytes) / split
