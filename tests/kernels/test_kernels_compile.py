"""Every GEMM and optimizer kernel compiles, deviceless, for one TPU v5e chip and one H100 at a realistic shape.

Compiling (not only lowering) runs Mosaic / Triton / ptxas / Mosaic GPU for the target, which is where VMEM and
shared-memory limits, block legality and compute-capability checks live (flash attention has its own file,
test_flash_attention_compile.py; the sharded compiles are in test_kernels_sharded.py). Each case asserts the
kernel is in the compiled program, so a silent fallback to XLA would fail.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from lpt import targets
from lpt.fp8 import blockwise_dot
from lpt.kernels.adamw_kahan import StepOptions
from lpt.kernels.adamw_kahan.kernel import adamw_kahan
from lpt.kernels.fp8_blockwise_matmul.kernel import fp8_blockwise_matmul
from lpt.kernels.fp8_blockwise_matmul.mosaic_gpu import fp8_blockwise_matmul_mgpu

KERNEL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
DEVICE = {"tpu": "v5e:2x2", "cuda": "h100:1x1x8"}


def _compile(f, shapes, platform):
    one = jax.sharding.SingleDeviceSharding(targets.devices(DEVICE[platform])[0])
    args = [jax.ShapeDtypeStruct(s, d, sharding=one) for s, d in shapes]
    with targets.lowering_for(DEVICE[platform]):
        return jax.jit(f).lower(*args).compile().as_text()


def _fp8_marker(text: str, platform: str) -> bool:
    return KERNEL[platform] in text or "triton" in text


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_fp8_gemm_kernel_compiles_at_4096_cubed(platform):
    m = k = n = 4096
    shapes = [((m, k), jnp.float8_e4m3fn), ((m, k // 128), jnp.float32), ((k, n), jnp.float8_e4m3fn)]
    shapes.append(((k // 128, n), jnp.float32))
    text = _compile(fp8_blockwise_matmul, shapes, platform)
    assert _fp8_marker(text, platform)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_fp8_blockwise_dot_forward_and_both_gradients_compile(platform):
    def fwd_bwd(x, w):
        y, vjp = jax.vjp(lambda x, w: blockwise_dot(x, w, impl="pallas"), x, w)
        return y, vjp(y)

    text = _compile(fwd_bwd, [((8, 1024, 2048), jnp.bfloat16), ((2048, 8192), jnp.bfloat16)], platform)
    count = text.count(KERNEL[platform]) if platform == "tpu" else text.count("triton")
    assert count >= 3  # y, dx and dw each run the kernel


def test_hopper_fp8_kernel_compiles_for_h100():
    shapes = [((4096, 4096), jnp.float8_e4m3fn), ((4096, 32), jnp.float32)]
    shapes += [((4096, 4096), jnp.float8_e4m3fn), ((32, 4096), jnp.float32)]
    text = _compile(fp8_blockwise_matmul_mgpu, shapes, "cuda")
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_adamw_kahan_kernel_compiles_for_a_large_leaf(platform):
    shape = (8192, 8192)  # 64M bf16 params: one MLP matrix of a 7B model
    options = StepOptions(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, stochastic=True)
    step = functools.partial(adamw_kahan, options=options)
    shapes = [(shape, jnp.bfloat16)] * 3 + [(shape, jnp.uint32), ((4,), jnp.float32), ((2,), jnp.uint32)]
    text = _compile(step, shapes, platform)
    assert (KERNEL[platform] if platform == "tpu" else "mosaic_gpu_v2") in text and "triton" not in text


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_fp8_gemm_vmem_does_not_grow_with_k(platform):
    """K = 131072 (a 1024-row tile of a would be 128 MiB): the TPU structure holds one K-chunk per block, so this
    compiles; a kernel that held the whole K in VMEM fails with CompileTimeScopedVmemOom from K = 32768."""
    m, k, n = 1024, 131072, 1024
    shapes = [((m, k), jnp.float8_e4m3fn), ((m, k // 128), jnp.float32), ((k, n), jnp.float8_e4m3fn)]
    shapes.append(((k // 128, n), jnp.float32))
    assert _fp8_marker(_compile(fp8_blockwise_matmul, shapes, platform), platform)
