"""The warp-specialized Mosaic GPU flash-attention forward (lpt/kernels/flash_attention/mosaic_gpu_ws.py): in the
Mosaic GPU interpreter, bit for bit the single-warpgroup forward's (O, lse) and within the f32 bounds of the XLA twin
(stable and standard policy; causal, cross, full and sliding-window attention; GQA; D = 64, 128; bf16 and f16); the
key blocks it computes; what it refuses; and deviceless compiles for one H100 (the custom call, no ptxas spills,
shared memory per block)."""

import functools
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_devices import cpu_env
from float_bounds import assert_within
from test_flash_attention_mosaic_gpu import (
    POLICIES,
    _bounds,
    _h100_sharding,
    _inputs,
    _kernel,
    _kw,
    _launches,
    _twin,
    _visible_blocks,
    block_visits,
)

from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention import mosaic_gpu as mg
from lpt.kernels.flash_attention import mosaic_gpu_blocks as mgb
from lpt.kernels.flash_attention import mosaic_gpu_ws as ws
from lpt.kernels.flash_attention.options import FlashOptions

# the single-warpgroup kernel's cases that this forward takes (no segment ids, D <= 128), with their block_k; the
# windows with G = 2 ("window-d128") run in a process with three CPU devices (test_window_and_gqa_...): the
# interpreter needs a thread of XLA's CPU pool per warpgroup (lpt/kernels/flash_attention/mosaic_gpu_ws.py)
WS_CASES = ["causal-gqa-d64", "cross-d128", "causal-bk128-large-logits"]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("case", WS_CASES)
def test_interpreted_kernel_equals_single_warpgroup_kernel_and_matches_twin(case, policy):
    """The consumers run the single-warpgroup kernel's per-block code over the same key blocks in the same order, so
    in the interpreter (the same XLA:CPU ops) (O, lse) are those of :func:`lpt.kernels.flash_attention.mosaic_gpu.
    forward` bit for bit, and within the f32 bounds of the twin (tests/kernels/test_flash_attention_mosaic_gpu.py).
    "cross-d128" runs with its block_k = 128 only with O in the input dtype (shared memory), so here with 64."""
    overrides = {"block_k": 64} if case == "cross-d128" else {}
    options = FlashOptions(policy=POLICIES[policy], interpret=True, **_kw(case, **overrides))
    fwd = functools.partial(ws.forward, options=options)
    o, lse = map(np.asarray, jax.jit(fwd)(*_inputs(case)))
    if overrides:
        single = functools.partial(mg.forward, options=options)
        o_1, lse_1 = map(np.asarray, jax.jit(single)(*_inputs(case)))
    else:
        o_1, lse_1 = _kernel(case, POLICIES[policy])
    np.testing.assert_array_equal(o, o_1)
    np.testing.assert_array_equal(lse, lse_1)
    o_t, lse_t = _twin(case, POLICIES[policy], **overrides)
    o_bound, lse_bound = _bounds(case, **overrides)
    assert_within(o, o_t, o_bound, f"{case} {policy} O")
    assert_within(lse, lse_t, lse_bound, f"{case} {policy} lse")
    assert o.dtype == np.float32 and o.shape == o_t.shape


_WINDOW_GQA = textwrap.dedent(
    """
    import functools, jax, jax.numpy as jnp, numpy as np
    from lpt.kernels.flash_attention import math as fm, mosaic_gpu as mg, mosaic_gpu_ws as ws
    from lpt.kernels.flash_attention.options import FlashOptions
    rng = np.random.default_rng(0)
    for d, bk, window in ((128, 64, 100), (64, 128, 20)):
        q = jnp.asarray(rng.integers(-3, 4, (1, 2, 256, d)) / 4, jnp.bfloat16)  # G = 2: one kv head
        k = jnp.asarray(rng.integers(-3, 4, (1, 1, 256, d)) / 4, jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((1, 1, 256, d)), jnp.bfloat16)  # f64 -> bf16 (RNE)
        for name, policy in (("stable", fm.default_policy()), ("standard", fm.standard_policy())):
            options = FlashOptions(
                policy=policy, causal=True, window=window, scale=d**-0.5, block_k=bk, interpret=True
            )
            o, lse = map(np.asarray, jax.jit(functools.partial(ws.forward, options=options))(q, k, v))
            o_1, lse_1 = map(np.asarray, jax.jit(functools.partial(mg.forward, options=options))(q, k, v))
            assert np.array_equal(o, o_1) and np.array_equal(lse, lse_1), (d, bk, window, name)
            print("ws", d, bk, window, name, "bitwise OK", flush=True)
    """
)


def test_window_and_gqa_equal_the_single_warpgroup_kernel_given_a_thread_per_warpgroup():
    """Sliding windows with G = 2 (the second consumer skips the CTA's first blocks, both read one kv head), in a
    process whose XLA CPU pool has a thread for each of the three warpgroups (three CPU devices): bit for bit the
    single-warpgroup forward, both policies. On a 2-core machine with one device the same calls can wait forever
    (two warpgroups blocked on barriers hold the pool's two threads; the module docstring)."""
    r = subprocess.run([sys.executable, "-c", _WINDOW_GQA], env=cpu_env(3), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("bitwise OK") == 4, r.stdout


def test_f16_window_three_stages_and_o_in_the_input_dtype():
    """f16, a sliding window of 100 keys (T = 256, block_k = 64: the second CTA's range is key blocks 0-3, and its
    second consumer, rows 192-255, skips block 0), three K/V slots (the ring wraps mid-range: block 3 reuses block
    0's slot), and the standard policy's O rounded to the input dtype: the single-warpgroup kernel's outputs bit for
    bit."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.integers(-3, 4, (1, 1, 256, 64)) / 4, jnp.float16)  # int -> f64 -> f16, exact
    k = jnp.asarray(rng.integers(-3, 4, (1, 1, 256, 64)) / 4, jnp.float16)  # G = 1 (module docstring)
    v = jnp.asarray(rng.standard_normal((1, 1, 256, 64)), jnp.float16)  # f64 -> f16 (RNE)
    options = FlashOptions(causal=True, scale=0.125, policy=fm.standard_policy(), window=100, interpret=True)
    o, lse = jax.jit(functools.partial(ws.forward, options=options, stages=3))(q, k, v)
    o_1, lse_1 = jax.jit(functools.partial(mg.forward, options=options))(q, k, v)
    assert o.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_1))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_1))


@pytest.mark.parametrize("bk, window", [(64, 70), (128, 20), (64, 0)])
def test_kernel_computes_only_the_key_blocks_in_range(bk, window, monkeypatch):
    """Each consumer builds the mask of each block it computes with block_mask (a block of the other consumer's range
    it only waits for and releases): every (query head, 64-row query block) computes exactly the key blocks with a
    visible pair, once, O(T·w) with a window (one head: the key ranges do not depend on it)."""
    t, h = 256, 1
    # G = 1: G = 2 needs three threads in XLA's CPU pool (module docstring); a 2-core machine has two
    visits = block_visits(ws.forward, monkeypatch, t=t, h=h, hkv=h, bk=bk, window=window)
    assert sorted(visits) == sorted(_visible_blocks(t, mgb.BLOCK_Q, bk, True, window) * h)


def test_rejects_what_it_does_not_support():
    q = jnp.zeros((1, 2, 256, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 1, 256, 64), jnp.bfloat16)
    kw = dict(policy=fm.default_policy(), causal=True, scale=0.125, interpret=True)
    opts = lambda **changes: FlashOptions(**{**kw, **changes})
    seg = jnp.zeros((1, 256), jnp.int32)
    with pytest.raises(ValueError, match=r"^segment ids are not supported by the warp-specialized"):
        ws.forward(q, kv, kv, seg, seg, options=opts())
    assert ws.HEAD_DIMS == (64, 128)
    with pytest.raises(ValueError, match=r"^head dim D=256 is not supported .* allowed: \(64, 128\)"):
        ws.forward(*(jnp.zeros(x.shape[:3] + (256,), jnp.bfloat16) for x in (q, kv, kv)), options=opts())
    with pytest.raises(ValueError, match=r"^Tq=192 must be a multiple of 128"):
        ws.forward(q[:, :, :192], kv[:, :, :192], kv[:, :, :192], options=opts())
    with pytest.raises(ValueError, match=r"^block_q must be 64 .* got block_q=128"):
        ws.forward(q, kv, kv, options=opts(block_q=128))
    with pytest.raises(ValueError, match=r"^stages=1 must be an int >= 2"):
        ws.forward(q, kv, kv, options=opts(), stages=1)
    with pytest.raises(ValueError, match=r"pv_dtype='float32' differs from the input dtype bfloat16"):
        ws.forward(q, kv, kv, options=opts(policy=fm.default_policy(pv_dtype="float32")))
    q128, kv128 = jnp.zeros((1, 2, 256, 128), jnp.bfloat16), jnp.zeros((1, 1, 256, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"^D=128 with block_k=128, stages=2 and a 4-byte O needs 232528 bytes"):
        ws.forward(q128, kv128, kv128, options=opts(block_k=128))


# -- deviceless: compiling for an H100 ---------------------------------------------------------------------------------

B, H, HKV, T = 1, 8, 2, 4096


@pytest.mark.parametrize(
    "d, block_k, stages, causal, window, policy, dtype",
    [
        (128, 64, 2, True, 0, "stable", jnp.bfloat16),
        (128, 64, 2, True, 1024, "stable", jnp.bfloat16),
        (128, 64, 2, False, 0, "stable", jnp.bfloat16),
        (128, 128, 2, True, 0, "standard", jnp.bfloat16),
        (128, 64, 3, True, 0, "standard", jnp.float16),
        (64, 64, 2, True, 0, "stable", jnp.bfloat16),
        (64, 128, 2, True, 0, "standard", jnp.bfloat16),
    ],
    ids=["causal", "window", "full", "bk128-standard", "stages3-f16", "d64", "d64-bk128-standard"],
)
def test_compiles_for_h100_without_spills(d, block_k, stages, causal, window, policy, dtype, monkeypatch, tmp_path):
    """B=1, H=8, Hkv=2, T=4096 compiled for one H100: one Mosaic GPU custom call, no Triton call, and ptxas (its
    report dumped by Mosaic GPU, the compilation cache off so that ptxas runs) spills no register: the consumers hold
    acc [64, D] f32 beside a block's tiles in the 240 registers ``setmaxnreg`` gives them (the stable policy at
    block_k = 128 spills, as in the single-warpgroup kernel). ~3 s per compile on 2 CPU cores."""
    sharding = _h100_sharding()
    q = jax.ShapeDtypeStruct((B, H, T, d), dtype, sharding=sharding)
    kv = jax.ShapeDtypeStruct((B, HKV, T, d), dtype, sharding=sharding)
    pol = fm.default_policy() if policy == "stable" else fm.standard_policy()
    options = FlashOptions(causal=causal, scale=d**-0.5, policy=pol, window=window, block_k=block_k, interpret=False)
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")  # read by the CUDA plugin at each Mosaic GPU compile
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        fwd = functools.partial(ws.forward, options=options, stages=stages)
        text = jax.jit(fwd).lower(q, kv, kv).compile().as_text()
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    assert re.findall(r'custom_call_target="([^"]+)"', text) == ["mosaic_gpu_v2"]
    assert "triton" not in text
    [report] = [p.read_text() for p in tmp_path.glob("*.ptxas")]
    assert "0 bytes spill stores, 0 bytes spill loads" in report and "spilled" not in report, report


@pytest.mark.parametrize(
    "d, block_k, stages, policy", [(128, 64, 2, "stable"), (128, 128, 2, "standard"), (64, 64, 3, "stable")]
)
def test_shared_memory_per_block_does_not_grow_with_t(d, block_k, stages, policy):
    """Lowered for cuda at T = 4096 and T = 32768: the same shared memory per block, equal to smem_bytes (166,992
    bytes at D = 128, block_k = 64 with f32 O; 199,760 at block_k = 128 with bf16 O), and a launch of B × H × T/128
    blocks of three warpgroups (384 threads; grid axes reversed: x = B)."""
    pol = fm.default_policy() if policy == "stable" else fm.standard_policy()
    o_itemsize = 4 if policy == "stable" else 2
    for t in (4096, 32768):
        q = jax.ShapeDtypeStruct((B, H, t, d), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((B, HKV, t, d), jnp.bfloat16)
        options = FlashOptions(causal=True, scale=d**-0.5, policy=pol, block_k=block_k, interpret=False)
        fwd = functools.partial(ws.forward, options=options, stages=stages)
        [launch] = _launches(jax.jit(fwd).trace(q, kv, kv).lower(lowering_platforms=("cuda",)))
        assert launch == (B, H, t // 128, 384, 1, 1, ws.smem_bytes(d, 2, o_itemsize, block_k, stages))
    assert (ws.smem_bytes(128, 2, 4, 64, ws.STAGES), ws.smem_bytes(128, 2, 2, 128)) == (166992, 199760)
    assert ws.smem_bytes(128, 2, 4, 128) > mgb.SMEM_LIMIT
