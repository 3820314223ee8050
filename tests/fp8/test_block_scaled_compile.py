"""block_scaled_dot compiles for a B200 without the hardware (lpt.targets, the CUDA plugin).

With ``impl="auto"`` the CUDA branch hands each GEMM to ``jax.nn.scaled_matmul``. XLA turns it into cuDNN's
block-scaled GEMM (custom call ``__cudnn$blockScaledDot``) when the target declares cuDNN 9.10 or newer, as
lpt/targets/b200.txtpb does (XLA's sm_100 file with cuDNN 9.10 in place of its 9.8): forward, dX and dW of a layer
are three such calls for MXFP8 and for NVFP4. With cuDNN 9.8 XLA lowers the same program to a dequantize-and-multiply
in f32 (cuBLAS on f32 operands, no block-scaled call), which the second case pins. jax 0.12.0.1's XLA lowers the
same custom call to dequantize-and-dot fusions even with cuDNN 9.10 declared (no cuDNN call; measured on the
compile-only target): the first case is an expected failure there, strict, so it reports when that changes.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lpt import targets
from lpt.fp8 import block_scaled_dot

BLOCK_SCALED = 'custom_call_target="__cudnn$blockScaledDot"'
_CUDNN = re.compile(r"(dnn_version_info \{\s*major: 9\s*minor: )(\d+)")


def _b200(cudnn_minor: int):
    """One compile-only B200 whose target config declares cuDNN 9.<cudnn_minor>."""
    text = targets.gpu_target_config("b200")
    assert _CUDNN.search(text).group(2) == "10"  # the shipped config's cuDNN
    text = _CUDNN.sub(rf"\g<1>{cudnn_minor}", text)
    return topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x1x1").devices


def _compiled_grad(devices, recipe: str) -> str:
    s = NamedSharding(Mesh(devices, ("d",)), P())
    x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16, sharding=s)
    w = jax.ShapeDtypeStruct((128, 256), jnp.float32, sharding=s)

    def loss(x, w):
        y = block_scaled_dot(x, w, recipe, key=jax.random.key(0))
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()


@pytest.mark.xfail(
    tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 12),
    reason="jax 0.12's XLA dequantizes __op$block_scaled_dot for this compile-only B200 instead of calling cuDNN",
    strict=True,
)
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_b200_gemms_are_cudnn_block_scaled(recipe):
    assert _compiled_grad(_b200(10), recipe).count(BLOCK_SCALED) == 3


def test_b200_with_cudnn_9_8_dequantizes():
    hlo = _compiled_grad(_b200(8), "mxfp8")
    assert BLOCK_SCALED not in hlo and ("__cublas$lt$matmul" in hlo or " dot(" in hlo)  # cuBLAS or XLA's own dot
