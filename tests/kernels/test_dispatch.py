"""lpt.kernels.dispatch: the one platform switch (interpret / Triton / Mosaic) and the shard_map helper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from lowering import lowering

from lpt.kernels import dispatch


def _double(mode):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    return lambda x: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), **dispatch.mode_kwargs(mode, grid_rank=0)
    )(x)


def test_interpret_true_runs_the_interpreter_and_none_picks_per_platform():
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    call = lambda x: dispatch.platform_call(_double, x, interpret=None)
    np.testing.assert_array_equal(dispatch.platform_call(_double, x, interpret=True), 2 * x)
    np.testing.assert_array_equal(jax.jit(call)(x), 2 * x)
    # no mesh names a device: all three kernels are traced, and lowering picks the platform's
    anywhere = jax.jit(call).trace(x)
    assert str(anywhere.jaxpr).count("pallas_call") == 3
    assert "tpu_custom_call" in anywhere.lower(lowering_platforms=("tpu",)).as_text()
    # a mesh that names the device (the trainer's jax.set_mesh; lowering_for): only that platform's kernel is traced
    with lowering("cuda"):  # the trace keeps the abstract mesh it ran under: the GPU the Triton lowering targets
        cuda = jax.jit(call).trace(x)
        assert str(cuda.jaxpr).count("pallas_call") == 1
        assert "__gpu$xla.gpu.triton" in cuda.lower(lowering_platforms=("cuda",)).as_text()
    with lowering("tpu"):
        tpu = jax.jit(call).trace(x)
        assert str(tpu.jaxpr).count("pallas_call") == 1 and "triton" not in str(tpu.jaxpr)
        assert "tpu_custom_call" in tpu.lower(lowering_platforms=("tpu",)).as_text()
    with jax.set_mesh(jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])):
        here = jax.jit(call).trace(x)
        assert str(here.jaxpr).count("pallas_call") == 1 and "interpret=True" in str(here.jaxpr)
        np.testing.assert_array_equal(here.lower().compile()(x), 2 * x)


def test_mode_kwargs_and_bad_input():
    assert dispatch.mode_kwargs("interpret") == {"interpret": True}
    sem = dispatch.mode_kwargs("mosaic", semantics=("parallel", "arbitrary"))["compiler_params"]
    assert tuple(sem.dimension_semantics) == ("parallel", "arbitrary")
    assert dispatch.mode_kwargs("triton", num_warps=8)["compiler_params"].num_warps == 8
    with pytest.raises(ValueError, match="mode='cuda' is not one of"):
        dispatch.mode_kwargs("cuda")
    with pytest.raises(ValueError, match="interpret must be None .* or True, got False"):
        dispatch.check_interpret(False)


def test_shard_map_is_the_function_itself_without_a_multi_device_mesh():
    f = lambda x: x + 1
    assert dispatch.shard_map(f, None, [None], None) is f
    assert dispatch.kernel_mesh() is None  # no jax.set_mesh in effect
    mesh = jax.sharding.AbstractMesh((2, 2), ("data", "tensor"))
    assert dispatch.kernel_mesh(mesh) is mesh
    assert dispatch.check_divisible("batch", 8, mesh, ("data", "tensor")) == 2
    with pytest.raises(ValueError, match=r"batch=6 is not divisible by mesh axes \('data', 'tensor'\) of size 4"):
        dispatch.check_divisible("batch", 6, mesh, ("data", "tensor"))


def test_training_on_a_cpu_never_imports_the_triton_backend(tmp_path):
    """Pallas' Triton backend (deprecated since jax 0.11) is imported only by a trace of a Triton kernel: importing
    lpt and training ``tiny_cpu_bf16_kahan`` (one layer, 2 steps) with the Pallas attention and update kernels leave
    it unloaded (under the trainer's mesh of CPU devices only the interpreted kernels are traced). It would be loaded
    if dispatch imported it at its top, or traced every platform's kernel."""
    import subprocess
    import sys

    script = (
        "import sys; from lpt.train import config, loop; "
        "cfg = config.apply_overrides(config.load_config_file('tiny_cpu_bf16_kahan'), {'train.steps': '2', "
        "'train.eval_every': '2', 'train.eval_batches': '1', 'train.global_batch': '8', 'model.n_layers': '1', "
        "'precision.attention.impl': 'pallas', 'precision.update_impl': 'pallas'}); "
        "loop.train(cfg, sys.argv[1]); "
        "print(sorted(m for m in sys.modules if m.startswith('jax.experimental.pallas.triton')))"
    )
    cmd = [sys.executable, "-c", script, str(tmp_path / "run")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout
