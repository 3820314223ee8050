"""``dot_product_attention(impl="auto")``, the default: picked by the device the program is lowered for. Lowered
(not run) for compile-only targets (lpt.targets) with a mesh set: on an H100 the forward and backward are the Mosaic
GPU kernels (``mosaic_gpu_v2``) for bf16 / f16 q, k, v of head width 64 or 128, the Triton kernel for f32 inputs or
a width the Hopper backward does not train, on a B200 (no wgmma) the Triton kernel, on a TPU the Mosaic TPU kernel,
on a CPU the XLA twin (no custom call), where it returns exactly what ``impl="xla"`` returns. On a GPU the standard
policy goes to cuDNN's fused attention where it takes the call."""

import functools
import re

import jax
import jax._src.cudnn.fused_attention_stablehlo as cudnn_attention
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED

from lpt import targets
from lpt.attention import auto_impl, cudnn, dot_product_attention

TRITON, MOSAIC_GPU, MOSAIC_TPU = "__gpu$xla.gpu.triton", "mosaic_gpu_v2", "tpu_custom_call"
CUDNN = {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}


def _custom_calls(topology: str | None, dtype, d: int, **options) -> set[str]:
    """The custom-call targets of jax.grad through the default call, lowered for ``topology``'s first device under
    ``jax.set_mesh``, one sequence per device (None: this process's UNOPTIMIZED)."""
    if topology is None:
        mesh = jax.make_mesh((1,), ("data",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    else:
        try:
            mesh = targets.mesh(topology, (len(targets.devices(topology)),), ("data",))
        except ValueError as e:  # jax's CUDA plugin or libtpu is not installed: no compile-only target
            pytest.skip(f"no compile-only target {topology}: {e}")
    rows = jax.sharding.NamedSharding(mesh, jax.P("data"))  # one sequence per device
    spec = jax.ShapeDtypeStruct((mesh.size, 128, 4, d), dtype, sharding=rows)
    kv = jax.ShapeDtypeStruct((mesh.size, 128, 2, d), dtype, sharding=rows)

    def loss(q, k, v):
        return jnp.sum(dot_product_attention(q, k, v, **options).astype(jnp.float32))

    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, kv, kv).as_text()
    return set(re.findall(r"custom_call @([\w$.]+)", text)) & {TRITON, MOSAIC_GPU, MOSAIC_TPU, *CUDNN}


@pytest.mark.parametrize(
    "topology, dtype, d, want",
    [
        ("h100:1x1x1", jnp.bfloat16, 128, {MOSAIC_GPU}),
        ("h100:1x1x1", jnp.float16, 64, {MOSAIC_GPU}),
        ("h100:1x1x1", jnp.float32, 64, {TRITON}),  # wgmma takes 16-bit operands
        ("h100:1x1x1", jnp.bfloat16, 32, {TRITON}),  # the Hopper backward trains D = 64, 128
        ("b200:1x1x1", jnp.bfloat16, 128, {TRITON}),  # no wgmma on Blackwell
        ("v5e:2x2", jnp.bfloat16, 128, {MOSAIC_TPU}),
        (None, jnp.bfloat16, 128, set()),
    ],
    ids=["h100-bf16", "h100-f16-d64", "h100-f32", "h100-d32", "b200", "v5e", "cpu"],
)
def test_auto_lowers_to_the_kernel_of_the_target(topology, dtype, d, want):
    assert _custom_calls(topology, dtype, d) == want


@pytest.mark.parametrize(
    "topology, options, want",
    [
        ("h100:1x1x1", {"stable": False}, CUDNN),
        ("h100:1x1x1", {"stable": False, "sliding_window": 32}, CUDNN),
        ("b200:1x1x1", {"stable": False}, CUDNN),
        ("h100:1x1x1", {}, {MOSAIC_GPU}),  # the stable policy is lpt's own
        ("b200:1x1x1", {}, {TRITON}),
    ],
    ids=["h100-standard", "h100-standard-window", "b200-standard", "h100-stable", "b200-stable"],
)
def test_auto_gives_the_standard_policy_to_cudnn_on_a_gpu(monkeypatch, topology, options, want):
    """Lowered only: this machine has no cuDNN library, so jax's cuDNN version check (the one thing it needs at
    trace time) is given a version; the compile and the numbers are the GPU test's
    (``test_attention_api_cudnn_equals_xla_with_grads``)."""
    monkeypatch.setattr(cudnn_attention, "check_cudnn_version", lambda: 91000)
    assert _custom_calls(topology, jnp.bfloat16, 64, **options) == want


def test_cudnn_window_is_lpt_window():
    """lpt's window of w keys as cuDNN's ``local_window_size``, checked through jax's XLA implementation of the same
    arguments against lpt's f32 softmax: a window one key off changes O by O(1)."""
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(ks[0], (1, 64, 4, 16), jnp.float32)
    k = jax.random.normal(ks[1], (1, 64, 2, 16), jnp.float32)
    v = jax.random.normal(ks[2], (1, 64, 2, 16), jnp.float32)
    for w in (1, 5, 32):
        args = cudnn.arguments(causal=True, sliding_window=w, scale=None)
        got = jax.nn.dot_product_attention(q, k, v, implementation="xla", **args)
        want = dot_product_attention(q, k, v, sliding_window=w, impl="softmax")
        wider = dot_product_attention(q, k, v, sliding_window=w + 1, impl="softmax")
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert np.max(np.abs(np.asarray(wider) - np.asarray(want))) > 0.01


@pytest.mark.parametrize(
    "options, message",
    [
        ({}, "impl='cudnn' computes the standard softmax only"),
        ({"stable": False, "segment_ids": jnp.zeros((1, 16), jnp.int32)}, "impl='cudnn' takes no segment_ids"),
        ({"stable": False, "dtype": jnp.float32}, "impl='cudnn' takes bfloat16 or float16"),
        ({"stable": False, "interpret": True}, "interpret=True: impl='cudnn' has no interpret"),
    ],
    ids=["stable", "segments", "f32", "interpret"],
)
def test_cudnn_refuses_what_it_does_not_compute_in_one_line(options, message):
    options = dict(options)
    q = jnp.zeros((1, 16, 2, 64), options.pop("dtype", jnp.bfloat16))
    with pytest.raises(ValueError) as e:
        dot_product_attention(q, q, q, impl="cudnn", **options)
    assert "\n" not in str(e.value) and str(e.value).startswith(message), str(e.value)


def test_auto_names_what_it_picks():
    cpu = jax.devices()[0]
    assert auto_impl(jnp.bfloat16, 128) == "xla" and cpu.platform == "cpu"
    try:
        h100 = targets.mesh("h100:1x1x1", (1,), ("data",))
    except ValueError as e:
        pytest.skip(f"no compile-only H100 target: {e}")
    assert auto_impl(jnp.bfloat16, 128, h100) == "mosaic_gpu"
    assert auto_impl(jnp.bfloat16, 256, h100) == "pallas"
    assert auto_impl(jnp.bfloat16, 128, h100, standard=True) == "cudnn"
    assert auto_impl(jnp.bfloat16, 128, h100, standard=True, masked=True) == "mosaic_gpu"
    assert auto_impl(jnp.float32, 64, h100, standard=True) == "pallas"
    assert auto_impl(jnp.bfloat16, 128, standard=True) == "xla"  # the CPU


def test_on_a_cpu_auto_is_the_twin_exactly():
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (2, 100, 4, 64), jnp.bfloat16)
    k = jax.random.normal(ks[1], (2, 100, 2, 64), jnp.bfloat16)
    v = jax.random.normal(ks[2], (2, 100, 2, 64), jnp.bfloat16)
    do = jax.random.normal(ks[3], (2, 100, 4, 64), jnp.bfloat16)

    def out_and_grads(impl):  # compiled without LLVM's backend optimizations: less compile time, same check
        @functools.partial(jax.jit, compiler_options=UNOPTIMIZED)
        def run(q, k, v, do):
            o, vjp = jax.vjp(lambda q, k, v: dot_product_attention(q, k, v, impl=impl), q, k, v)
            return o, *vjp(do)

        return [np.asarray(x, np.float32) for x in run(q, k, v, do)]  # bf16 -> f32, exact

    for a, b in zip(out_and_grads("auto"), out_and_grads("xla"), strict=True):
        np.testing.assert_array_equal(a, b)  # the same program: "auto" resolves to "xla" at trace time


def test_auto_with_interpret_is_one_error():
    q = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError) as e:
        dot_product_attention(q, q, q, interpret=True)
    assert "\n" not in str(e.value) and str(e.value).startswith("interpret=True: impl='auto'"), str(e.value)
