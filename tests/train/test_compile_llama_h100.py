"""configs/llama_1b.py as it ships (FP8 qkv / out / up / down, bf16 + Kahan, ``impl="auto"`` attention and FP8
GEMMs) compiled for eight H100s (deviceless, lpt.targets): attention and every FP8 GEMM are Mosaic GPU kernels
(``mosaic_gpu_v2``), and so is the fused AdamW + Kahan update (``precision.update_impl="pallas"``): no Pallas
Triton call is left. One layer (the blocks are scanned: the same kernels as 16); ~60-90 s on 2
cores."""

import re

import pytest

from lpt import models, targets
from lpt.targets import hlo
from lpt.train import config as config_lib
from lpt.train import loop
from lpt.train import state as state_lib

ONE_LAYER = {
    "model.n_layers": "1",
    "train.global_batch": "8",
    "optim.microbatches": "1",
    "data.source": "embedded",
    "model.vocab_size": "32768",
}
TRITON = "__gpu$xla.gpu.triton"


def test_llama_1b_runs_attention_and_fp8_gemms_as_mosaic_gpu_kernels_on_h100s():
    try:
        devices = targets.devices("h100:1x1x8")
    except ValueError as e:  # jax's CUDA plugin is not installed: no compile-only GPU target
        pytest.skip(f"no compile-only H100 target: {e}")
    cfg = config_lib.apply_overrides(config_lib.load_config_file("llama_1b"), ONE_LAYER)
    assert cfg.precision.attention.impl == "auto" and cfg.precision.fp8_impl == "auto"
    mesh = loop.make_mesh(cfg, devices)
    prog = loop.program(cfg, mesh)
    state = state_lib.with_shardings(prog.abstract, prog.shardings)
    text = prog.train_step.trace(state, loop.batch_structs(cfg, mesh)).lower().compile().as_text()
    calls = {}
    for line in text.splitlines():
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if target and target.group(1) in (TRITON, "mosaic_gpu_v2"):
            name = re.search(r'op_name="([^"]*)"', line).group(1)
            calls.setdefault(target.group(1), []).append(name)
    mgpu, triton = calls.get("mosaic_gpu_v2", []), calls.get(TRITON, [])
    for kernel in ("lpt_flash_attention_fwd_mgpu", "lpt_flash_attention_dq_mgpu", "lpt_flash_attention_dkdv_mgpu"):
        assert any(kernel in n for n in mgpu), (kernel, hlo.kernels(text))
    # the FP8 GEMMs: forward, dX and dW of each of the 4 FP8 matmul kinds (qkv as three, up as two: 7 weights)
    gemms = [n for n in mgpu if "flash_attention" not in n]
    assert len(gemms) >= 3 * 4, gemms
    assert any("lpt_adamw_kahan" in n for n in mgpu), hlo.kernels(text)  # the fused optimizer step
    assert not triton, triton
    # what the compile report names: the Hopper kernels for this stable policy, cuDNN for the standard one
    assert models.attention_impl(cfg.model, cfg.precision, mesh) == "mosaic_gpu"
    standard = config_lib.apply_overrides(cfg, {"precision.attention.stable": "false"})
    assert models.attention_impl(standard.model, standard.precision, mesh) == "cudnn"
