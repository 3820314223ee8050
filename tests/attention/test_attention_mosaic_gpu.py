"""``dot_product_attention(impl="mosaic_gpu")``: the Hopper kernels behind the public call. Interpreted
(``interpret=True``) against the XLA twin (``impl="xla"``) run with the same blocks, outputs and the three gradients,
both policies, causal GQA with a T that needs padding, a sliding window, packed segments; the block_k it picks; the
segment ids passed only when needed; and compiled (``interpret=None``) lowered for CUDA, refused in one line on CPU.

Tolerance. The kernels themselves are tested within a few f32 ulps of the twin on the same blocks
(tests/kernels/test_flash_attention_mosaic_gpu.py). Here both sides return bf16: the wrapper rounds O and the f32
dq, dk, dv to the input dtype, and an f32-ulp difference can flip that rounding by one bf16 ulp, at most 2^-7·|x| <=
2^-7·max|x|. So every element is asserted within 2^-7·max|twin| and at least 97% of them equal (a one-key window
error or ignored segments move O by several times that bound, asserted below)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED

from lpt.attention import dot_product_attention
from lpt.attention.core import mosaic_gpu_block_k
from lpt.kernels.flash_attention import mosaic_gpu as mg

# name: (B, T, H, Hkv, D, sliding_window, packed)
CASES = {
    "causal-gqa-pad-d64": (1, 100, 2, 1, 64, 0, False),  # T = 100 -> 128 (block_k 128): padding as segment ids
    "window-gqa-d128": (1, 128, 2, 1, 128, 40, False),  # no padding, no segments: the kernels without segment ids
    "packed-d64": (1, 128, 2, 1, 64, 0, True),  # three packed sequences of 50, 60, 18 tokens
}
BOUND = 2.0**-7  # one bf16 ulp of the largest magnitude (module doc)


def _inputs(case: str):
    b, t, h, hkv, d, _, _ = CASES[case]
    ks = jax.random.split(jax.random.PRNGKey(list(CASES).index(case)), 4)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, t, hkv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, hkv, d), jnp.bfloat16)
    do = jax.random.normal(ks[3], (b, t, h, d), jnp.bfloat16)
    return q, k, v, do


def _segments(case: str):
    b, t, *_, packed = CASES[case]
    return jnp.asarray(np.broadcast_to(np.repeat([0, 1, 2], [50, 60, t - 110]), (b, t)), jnp.int32) if packed else None


def _out_and_grads(fn, q, k, v, do):
    def both(q, k, v):
        o, vjp = jax.vjp(fn, q, k, v)
        return o, *vjp(do)

    return [
        np.asarray(x, np.float32) for x in jax.jit(both, compiler_options=UNOPTIMIZED)(q, k, v)
    ]  # bf16 -> f32, exact


def _check(got, want, what: str):
    """Every element within BOUND·max|want| and >= 97% of them equal (module doc)."""
    for name, x, ref in zip(("o", "dq", "dk", "dv"), got, want, strict=True):
        tol = BOUND * np.abs(ref).max()
        assert tol > 0, (what, name)
        worst = np.abs(x - ref).max()
        assert worst <= tol, f"{what} {name}: |mosaic_gpu - xla| = {worst:.3g} > {tol:.3g}"
        assert np.mean(x == ref) >= 0.97, f"{what} {name}: only {np.mean(x == ref):.4f} equal"


@pytest.mark.parametrize("case, stable", [(c, s) for c in CASES for s in (True, False) if not (CASES[c][6] and not s)])
def test_interpreted_matches_xla_twin(case, stable):
    b, t, h, hkv, d, window, _ = CASES[case]
    q, k, v, do = _inputs(case)
    bk = mosaic_gpu_block_k(d, t, t)
    kw = dict(causal=True, sliding_window=window, stable=stable, segment_ids=_segments(case))
    mosaic = lambda q, k, v: dot_product_attention(q, k, v, impl="mosaic_gpu", interpret=True, **kw)
    twin = lambda q, k, v: dot_product_attention(q, k, v, impl="xla", block_q=mg.BLOCK_Q, block_k=bk, **kw)
    got = _out_and_grads(mosaic, q, k, v, do)
    assert got[0].shape == (b, t, h, d) and got[2].shape == (b, t, hkv, d)
    _check(got, _out_and_grads(twin, q, k, v, do), case)
    if window or CASES[case][6]:  # the bound sees a window one key longer, or segments ignored, in O alone
        wrong = dict(kw, sliding_window=window + 1) if window else dict(kw, segment_ids=None)
        twin_wrong = lambda q, k, v: dot_product_attention(q, k, v, impl="xla", block_q=mg.BLOCK_Q, block_k=bk, **wrong)
        o_wrong = jax.jit(twin_wrong, compiler_options=UNOPTIMIZED)(q, k, v)
        o_wrong = np.asarray(o_wrong, np.float32)  # bf16 -> f32, exact
        assert np.abs(got[0] - o_wrong).max() > 3 * BOUND * np.abs(o_wrong).max()


def test_block_k_follows_the_head_dim_and_padding():
    """128 only where the backward's registers allow it (D = 64) and it pads no further than 64 does."""
    assert mosaic_gpu_block_k(64, 4096, 4096) == 128
    assert mosaic_gpu_block_k(64, 100, 100) == 128  # both pad to 128
    assert mosaic_gpu_block_k(64, 192, 192) == 64  # 128 would pad 192 to 256
    assert mosaic_gpu_block_k(64, 128, 192) == 64  # cross attention: either length decides
    for d in (128, 192, 256):
        assert mosaic_gpu_block_k(d, 4096, 4096) == 64


def _cuda_kernel_operands(t: int, **kw) -> list[int]:
    """The operand count of each ``mosaic_gpu_v2`` custom call of forward+backward lowered for CUDA (compiled:
    ``interpret=None``), B=1, H=4, Hkv=2, D=64."""
    q = jax.ShapeDtypeStruct((1, t, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, t, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(dot_product_attention(q, k, v, impl="mosaic_gpu", **kw).astype(jnp.float32))  # bf16 -> f32

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "mosaic_gpu_v2" in ln and "custom_call" in ln]
    return [ln.split("custom_call", 1)[1].split("(", 1)[1].split(")", 1)[0].count("%") for ln in calls]


def test_compiled_kernels_get_segment_ids_only_when_needed():
    """Lowered for CUDA: forward (q, k, v), dQ (q, k, v, dO, lse, δ), dK/dV (the same) kernels; with padding (T =
    100) or a kv mask each also takes q_seg, kv_seg."""
    assert sorted(_cuda_kernel_operands(128)) == [3, 6, 6]
    assert sorted(_cuda_kernel_operands(100)) == [5, 8, 8]
    mask = jnp.ones((1, 128), jnp.bool_)
    assert sorted(_cuda_kernel_operands(128, kv_mask=mask)) == [5, 8, 8]


@pytest.mark.parametrize("interpret", [None, False])
def test_compiled_on_cpu_is_refused_in_one_line(interpret):
    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    f = lambda q, k, v: dot_product_attention(q, k, v, impl="mosaic_gpu", interpret=interpret)
    refusal = r"for CUDA only, but this program is lowered for cpu: pass interpret=True"
    for run in (jax.jit(f), f):  # jitted, and eager
        with pytest.raises(ValueError, match=refusal) as e:
            run(q, kv, kv)
        assert "\n" not in str(e.value) and str(e.value).startswith("dot_product_attention(impl='mosaic_gpu')")
    with pytest.raises(ValueError, match=r"interpret='yes': impl='mosaic_gpu' takes None or False .* or True"):
        dot_product_attention(q, kv, kv, impl="mosaic_gpu", interpret="yes")


def test_compiles_per_shard_with_segment_ids_on_eight_h100s():
    """Batch-sharded over 8 H100s (deviceless) with T = 100 (padded: segment ids): each kernel runs per shard on one
    batch row (k, v [1, Hkv, 128, D] in the kernels' layout and q_seg, kv_seg [1, 128] in all three) and nothing is
    all-gathered."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lpt import targets
    from lpt.targets import hlo

    try:
        mesh = targets.mesh("h100:1x1x8", (8,), ("data",))
    except ValueError as e:  # jax's CUDA plugin is not installed: no compile-only GPU target
        pytest.skip(f"no compile-only H100 target: {e}")
    sds = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    q, kv = sds((8, 100, 4, 64)), sds((8, 100, 2, 64))

    def fwd_bwd(q, k, v):
        o, vjp = jax.vjp(lambda q, k, v: dot_product_attention(q, k, v, impl="mosaic_gpu"), q, k, v)
        return o, vjp(o)

    with jax.set_mesh(mesh):
        text = jax.jit(fwd_bwd).lower(q, kv, kv).compile().as_text()
    assert hlo.kernels(text).get("mosaic_gpu_v2") == 3 and "__gpu$xla.gpu.triton" not in hlo.kernels(text)
    calls = [ln for ln in text.splitlines() if 'custom_call_target="mosaic_gpu_v2"' in ln]
    for ln in calls:  # k, v [1, Hkv, 128, D] and q_seg, kv_seg [1, 128] in all three; in dK/dV q is [1, Hkv, G·T, D]
        operands = re.search(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}", ln).group(1)
        assert operands.count("bf16[1,2,128,64]") == 2 and operands.count("s32[1,128]") == 2, operands
    assert hlo.collectives(text)["all-gather"]["count"] == 0
