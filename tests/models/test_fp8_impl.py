"""``precision.fp8_impl``: which GEMM the model's "fp8" matmuls run. The training step's gradient lowered for CUDA
calls the chosen kernel three times per FP8 matmul (forward, dX, dW): the Triton kernel for "pallas", the Hopper
wgmma kernel for "mosaic_gpu" (with e4m3 output gradients: wgmma cannot mix formats), neither for "xla". A mesh of
another platform refuses "mosaic_gpu" in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_run import tiny_config

import lpt.models as M
from lpt.train import mesh as mesh_lib

CFG = dict(kind="llama", vocab_size=256, d_model=128, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=256, max_seq_len=16)
FP8 = {k: "fp8" for k in ("qkv", "out", "up", "down")}
TOKENS = np.zeros((2, 16), np.int32)
MARKERS = {"pallas": "__gpu$xla.gpu.triton", "mosaic_gpu": "mosaic_gpu_v2"}


def _cuda_text(impl: str) -> str:
    model = M.build_model(CFG, {"matmul": FP8, "fp8_impl": impl}, rngs=nnx.Rngs(0))
    g, st = nnx.split(model)
    grad = jax.grad(lambda s: nnx.merge(g, s)(TOKENS).astype(jnp.float32).sum())
    return jax.jit(grad).trace(st).lower(lowering_platforms=("cuda",)).as_text()


def test_the_chosen_kernel_runs_every_fp8_gemm():
    texts = {impl: _cuda_text(impl) for impl in ("xla", *MARKERS)}
    counts = {impl: {m: text.count(k) for m, k in MARKERS.items()} for impl, text in texts.items()}
    assert counts["xla"] == {"pallas": 0, "mosaic_gpu": 0}
    gemms = counts["pallas"]["pallas"]
    assert gemms > 0 and gemms % 3 == 0  # forward, dX and dW of each FP8 matmul
    assert counts["mosaic_gpu"] == {"pallas": 0, "mosaic_gpu": gemms}  # the same GEMMs, each a wgmma kernel
    assert "f8E5M2" not in texts["mosaic_gpu"] and "f8E5M2" in texts["pallas"]  # e4m3 gradients with wgmma


def test_mosaic_gpu_needs_a_gpu_mesh():
    fp8_up = {"precision.matmul.up": "fp8", "model.d_model": "128", "model.d_ff": "128"}  # K, N multiples of 128
    cfg = tiny_config({**fp8_up, "precision.fp8_impl": "mosaic_gpu"})
    mesh_lib.check_platform(cfg, "gpu")
    with pytest.raises(ValueError, match=r"fp8_impl='mosaic_gpu' is the Hopper wgmma kernel.*devices are cpu"):
        mesh_lib.check_platform(cfg, "cpu")
    mesh_lib.check_platform(tiny_config({"precision.fp8_impl": "mosaic_gpu"}), "cpu")  # no fp8 matmul: no kernel
