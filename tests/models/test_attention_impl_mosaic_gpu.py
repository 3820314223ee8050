"""``precision.attention.impl="mosaic_gpu"``: the trainer's step compiled for H100s (deviceless, lpt.targets) runs
every attention forward and backward as the Hopper kernels (``mosaic_gpu_v2`` custom calls: per layer one forward, one
dQ and one dK/dV) and none as Triton, on one device and batch-sharded over eight (per shard, nothing gathered); a mesh
of another platform refuses the key in one line, and a recipe the kernels cannot train is refused by the config's
validation; "auto", the default, picks the same kernels for an H100. ~6 s per compile on 2 CPU cores."""

import re

import pytest
from tiny_run import tiny_config

from lpt import targets
from lpt.targets import hlo
from lpt.train import config as config_lib
from lpt.train import loop
from lpt.train import mesh as mesh_lib
from lpt.train import state as state_lib

# configs/tiny_cpu.py (2 llama layers, d_model 128, 4 query heads on 2 kv heads) with 64-wide heads in bf16: the
# kernels take 16-bit q, k, v and head widths 64 or 128; 8 sequences of 64 tokens (T = 64: no padding)
MOSAIC = {
    "model.head_dim": "64",
    "precision.compute_dtype": "bfloat16",
    "precision.attention.impl": "mosaic_gpu",
    "train.mesh.data": "-1",
    "train.mesh.fsdp": "1",
    "train.global_batch": "8",
}
LAYERS = 2
KERNELS = ("lpt_flash_attention_fwd_mgpu", "lpt_flash_attention_dq_mgpu", "lpt_flash_attention_dkdv_mgpu")


def _compiled_step(topology: str, overrides=MOSAIC) -> str:
    """The HLO text of configs/tiny_cpu.py's train step with ``overrides``, compiled for ``topology``."""
    try:
        devices = targets.devices(topology)
    except ValueError as e:  # jax's CUDA plugin is not installed: no compile-only GPU target
        pytest.skip(f"no compile-only H100 target: {e}")
    cfg = config_lib.apply_overrides(config_lib.load_config_file("tiny_cpu"), overrides)
    mesh = loop.make_mesh(cfg, devices)  # check_platform: "gpu"
    prog = loop.program(cfg, mesh)
    state = state_lib.with_shardings(prog.abstract, prog.shardings)
    return prog.train_step.trace(state, loop.batch_structs(cfg, mesh)).lower().compile().as_text()


@pytest.mark.parametrize("topology, batch", [("h100:1x1x1", 8), ("h100:1x1x8", 1)])
def test_train_step_runs_attention_as_mosaic_gpu_kernels(topology, batch):
    """6 ``mosaic_gpu_v2`` calls, 2 per kernel (one per layer), no Triton call (XLA's own GEMM fusions are kCustom
    fusions, not custom calls). Their q operand is one device's batch rows [batch, H=4, T=64, D=64]: on 8 devices
    each kernel runs per shard (shard_map), and the step gathers nothing (data parallel: only gradient
    all-reduces). No segment ids (nothing padded or packed): the forward takes q, k, v alone."""
    text = _compiled_step(topology)
    found = hlo.kernels(text)
    assert found.get("mosaic_gpu_v2") == 3 * LAYERS, found
    assert "__gpu$xla.gpu.triton" not in found, found  # no Pallas Triton kernel
    calls = [ln for ln in text.splitlines() if 'custom_call_target="mosaic_gpu_v2"' in ln]
    names = [re.search(r'op_name="[^"]*/(lpt_flash_attention_\w+_mgpu)/', ln).group(1) for ln in calls]
    assert sorted(names) == sorted(KERNELS * LAYERS), names
    for ln, name in zip(calls, names, strict=True):
        operands = re.search(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}", ln).group(1)
        if name == KERNELS[0]:
            assert operands.split("{")[0] == f"bf16[{batch},4,64,64]", operands  # q: this device's rows
            assert operands.count("bf16[") == 3 and "s32[" not in operands, operands  # q, k, v; no segment ids
    assert hlo.collectives(text)["all-gather"]["count"] == 0


def test_a_mesh_of_another_platform_refuses_it():
    cfg = tiny_config({**MOSAIC, "train.global_batch": "4"})
    mesh_lib.check_platform(cfg.precision, "gpu")
    for platform in ("cpu", "tpu"):
        with pytest.raises(ValueError) as e:
            mesh_lib.check_platform(cfg.precision, platform)
        message = str(e.value)
        assert "\n" not in message and message.startswith("config key precision.attention.impl='mosaic_gpu'")
        assert f"CUDA GPUs only; this mesh's devices are {platform}: use 'xla' or 'pallas'" in message
    mesh_lib.check_platform(
        tiny_config({"precision.attention.impl": "pallas"}).precision, "cpu"
    )  # the others run anywhere


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"precision.compute_dtype": "float32"}, "takes 16-bit q, k, v (wgmma), but precision.compute_dtype='float32'"),
        ({"model.head_dim": "32"}, "trains head widths (64, 128) only, but the model's head width is 32"),
        ({"model.head_dim": "256"}, "the model's head width is 256"),  # the forward takes it, the backward does not
    ],
)
def test_validation_refuses_what_the_kernels_cannot_train(overrides, needle):
    with pytest.raises(ValueError) as e:
        tiny_config({**MOSAIC, "train.global_batch": "4", **overrides})
    assert "\n" not in str(e.value) and needle in str(e.value), str(e.value)
    assert str(e.value).startswith("config key precision.attention.impl='mosaic_gpu'")


def test_the_default_trains_with_the_hopper_kernels_on_an_h100():
    """``precision.attention.impl`` defaults to "auto", which picks the Hopper kernels for an H100 mesh."""
    from lpt.models.config import AttentionConfig

    assert AttentionConfig().impl == "auto"
    default = {k: v for k, v in MOSAIC.items() if k != "precision.attention.impl"}
    found = hlo.kernels(_compiled_step("h100:1x1x1", default))
    assert found.get("mosaic_gpu_v2") == 3 * LAYERS and "__gpu$xla.gpu.triton" not in found, found
