"""``precision.fp8_impl``: which GEMM the model's "fp8" matmuls run. The training step's gradient lowered for CUDA
calls the chosen kernel three times per FP8 matmul (forward, dX, dW): the Triton kernel for "pallas", the Hopper
wgmma kernel for "mosaic_gpu" (with the recipe's e5m2 output gradients where jax's wgmma mixes FP8 formats, jax >= 0.11,
else e4m3), neither for "xla". A mesh of another platform refuses "mosaic_gpu" in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from lowering import lowering
from tiny_run import tiny_config

import lpt.models as M
from lpt.kernels import compat
from lpt.train import mesh as mesh_lib

CFG = dict(kind="llama", vocab_size=256, d_model=128, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=256, max_seq_len=16)
FP8 = {k: "fp8" for k in ("qkv", "out", "up", "down")}
TOKENS = np.zeros((2, 16), np.int32)
MARKERS = {"pallas": "__gpu$xla.gpu.triton", "mosaic_gpu": "mosaic_gpu_v2"}


def _cuda_text(impl: str) -> str:
    prec = {"matmul": FP8, "fp8_impl": impl, "attention": {"impl": "xla"}}  # only the GEMMs' kernels
    model = M.build_model(CFG, prec, rngs=nnx.Rngs(0))
    g, st = nnx.split(model)
    grad = jax.grad(lambda s: nnx.merge(g, s)(TOKENS).astype(jnp.float32).sum())
    with lowering("cuda"):  # an H100: "mosaic_gpu" and "pallas" both run on it
        return jax.jit(grad).trace(st).lower(lowering_platforms=("cuda",)).as_text()


def test_the_chosen_kernel_runs_every_fp8_gemm():
    texts = {impl: _cuda_text(impl) for impl in ("xla", *MARKERS)}
    counts = {impl: {m: text.count(k) for m, k in MARKERS.items()} for impl, text in texts.items()}
    assert counts["xla"] == {"pallas": 0, "mosaic_gpu": 0}
    gemms = counts["pallas"]["pallas"]
    assert gemms > 0 and gemms % 3 == 0  # forward, dX and dW of each FP8 matmul
    assert counts["mosaic_gpu"] == {"pallas": 0, "mosaic_gpu": gemms}  # the same GEMMs, each a wgmma kernel
    assert "f8E5M2" in texts["pallas"]  # the recipe's e5m2 output gradients
    assert ("f8E5M2" in texts["mosaic_gpu"]) == compat.WGMMA_MIXES_FP8  # wgmma: e5m2 where it mixes formats


def test_mosaic_gpu_needs_a_gpu_mesh():
    fp8_up = {"precision.matmul.up": "fp8", "model.d_model": "128", "model.d_ff": "128"}  # K, N multiples of 128
    cfg = tiny_config({**fp8_up, "precision.fp8_impl": "mosaic_gpu"})
    mesh_lib.check_platform(cfg.precision, "gpu")
    with pytest.raises(ValueError, match=r"fp8_impl='mosaic_gpu' is the Hopper wgmma kernel.*devices are cpu"):
        mesh_lib.check_platform(cfg.precision, "cpu")
    mesh_lib.check_platform(
        tiny_config({"precision.fp8_impl": "mosaic_gpu"}).precision, "cpu"
    )  # no fp8 matmul: no kernel


def _mesh_text(topology: str, impl: str | None) -> str:
    """The step's gradient traced under ``jax.set_mesh`` of ``topology``'s first device and lowered for it;
    ``impl=None``: the default ``precision.fp8_impl``."""
    from lpt import targets

    try:
        mesh = targets.mesh(topology, (1,), ("data",))
    except ValueError as e:  # jax's CUDA plugin is not installed: no compile-only GPU target
        pytest.skip(f"no compile-only target {topology}: {e}")
    prec = {"matmul": FP8, "attention": {"impl": "xla"}}  # only the GEMMs' kernels in the program
    prec |= {} if impl is None else {"fp8_impl": impl}
    model = M.build_model(CFG, prec, rngs=nnx.Rngs(0))
    g, st = nnx.split(model)
    grad = jax.grad(lambda s: nnx.merge(g, s)(TOKENS).astype(jnp.float32).sum())
    with jax.set_mesh(mesh):
        return jax.jit(grad).trace(st).lower(lowering_platforms=("cuda",)).as_text()


def test_the_default_is_auto_the_wgmma_kernel_on_a_hopper_gpu_and_xla_on_a_blackwell():
    """``precision.fp8_impl`` defaults to "auto": on an H100 every FP8 GEMM is the wgmma kernel, with the gradients
    ``"mosaic_gpu"`` gives (e5m2 on jax >= 0.11, e4m3 on 0.10); on a B200 (no wgmma) the XLA twin, with e5m2."""
    from lpt.models.config import Precision

    assert Precision().fp8_impl == "auto"
    gemms = _cuda_text("mosaic_gpu").count(MARKERS["mosaic_gpu"])
    h100 = _mesh_text("h100:1x1x1", None)
    assert gemms > 0 and h100.count(MARKERS["mosaic_gpu"]) == gemms
    assert ("f8E5M2" in h100) == compat.WGMMA_MIXES_FP8
    b200 = _mesh_text("b200:1x1x1", None)
    assert all(m not in b200 for m in MARKERS.values()) and "f8E5M2" in b200


def test_auto_names_what_it_picks():
    from lpt import targets
    from lpt.fp8.blockwise import auto_impl

    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    assert auto_impl(e4m3, e4m3) == "xla"  # this CPU
    try:
        h100, v5e = targets.mesh("h100:1x1x1", (1,), ("d",)), targets.mesh("v5e:2x2", (4,), ("d",))
    except ValueError as e:
        pytest.skip(f"no compile-only target: {e}")
    assert auto_impl(e4m3, e4m3, h100) == "mosaic_gpu"
    assert auto_impl(e4m3, e5m2, h100) == ("mosaic_gpu" if compat.WGMMA_MIXES_FP8 else "xla")  # a mixed wgmma
    assert auto_impl(e4m3, e5m2, v5e) == "pallas"


def test_on_a_cpu_auto_is_the_twin_exactly():
    from lpt.fp8 import blockwise_dot

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)

    def run(impl):
        f = jax.jit(jax.value_and_grad(lambda x, w: blockwise_dot(x, w, impl=impl).sum(), argnums=(0, 1)))
        y, (dx, dw) = f(x, w)
        return [np.asarray(a) for a in (y, dx, dw)]

    for a, b in zip(run("auto"), run("xla"), strict=True):
        np.testing.assert_array_equal(a, b)  # "auto" resolves to "xla" when traced
    with pytest.raises(ValueError, match=r"^interpret=True: impl='auto'"):
        blockwise_dot(x, w, impl="auto", interpret=True)
