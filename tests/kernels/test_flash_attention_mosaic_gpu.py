"""The Mosaic GPU (Hopper) flash-attention forward (lpt/kernels/flash_attention/mosaic_gpu.py): math.py's rules on its
row vectors against the same rules on columns, bit for bit; the kernel in the Mosaic GPU interpreter against the XLA
twin (stable and standard policy; causal, cross and sliding-window attention; GQA; D = 64, 128, 256; bf16 and f16)
within a bound from f32 error analysis that a wrong policy or a mask one key off exceeds; the key blocks it visits; its
errors; and deviceless compiles for one H100 (custom call, shared memory per block)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_bounds import U32, assert_within, gamma

from lpt import targets
from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention import mosaic_gpu as mg
from lpt.kernels.flash_attention import reference as fr
from lpt.kernels.flash_attention import tiles

POLICIES = {"stable": fm.default_policy(), "standard": fm.standard_policy(residual="f32")}  # f32 O from both

# name: (B, H, Hkv, Tq, Tk, D, block_k, causal, window, dtype, q scale)
CASES = {
    "causal-gqa-d64": (2, 4, 2, 256, 256, 64, 64, True, 0, jnp.bfloat16, 1),
    "cross-d128": (1, 2, 1, 128, 256, 128, 128, False, 0, jnp.bfloat16, 1),  # Tq != Tk, bk = 128 != bq
    "window-d128": (1, 2, 1, 256, 256, 128, 64, True, 100, jnp.bfloat16, 1),  # window not a multiple of the blocks
    "causal-bk128-large-logits": (1, 2, 2, 256, 256, 64, 128, True, 0, jnp.bfloat16, 16),  # β offsets past the cap
    "f16-d256": (1, 2, 1, 128, 128, 256, 64, True, 0, jnp.float16, 1),
}


def _inputs(case: str):
    """q, k on the grid {−3, …, 3}/4 (times the case's scale), v normal, all in the case's dtype. Every product q_d·k_d
    is a multiple of 2^-4 and every partial sum of D <= 256 of them is exact in f32, so both programs get the same
    logits whatever order they add in; on this grid logits tie often, so the β rule sees repeated maxima."""
    b, h, hkv, tq, tk, d, _, _, _, dtype, mult = CASES[case]
    rng = np.random.default_rng(list(CASES).index(case))
    q = jnp.asarray(rng.integers(-3, 4, (b, h, tq, d)) * (mult / 4), dtype)  # int -> f64 -> dtype, exact
    k = jnp.asarray(rng.integers(-3, 4, (b, hkv, tk, d)) / 4, dtype)
    v = jnp.asarray(rng.standard_normal((b, hkv, tk, d)), dtype)  # f64 -> dtype (RNE)
    return q, k, v


def _kw(case: str, **overrides) -> dict:
    _, _, _, _, _, d, bk, causal, window, _, _ = CASES[case]
    return {"causal": causal, "window": window, "scale": d**-0.5, "block_k": bk, **overrides}


@functools.cache
def _kernel(case: str, policy: fm.AttentionPolicy):
    """The interpreted kernel's (O, lse), as numpy (cached: several tests compare one run)."""
    fwd = functools.partial(mg.forward, policy=policy, interpret=True, **_kw(case))
    return tuple(map(np.asarray, jax.jit(fwd)(*_inputs(case))))


def _twin(case: str, policy: fm.AttentionPolicy, **overrides):
    q, k, v = _inputs(case)
    kw = _kw(case, **overrides)
    segs = (jnp.zeros(q.shape[::2], jnp.int32), jnp.zeros(k.shape[::2], jnp.int32))  # [B, T]: one segment
    fwd = functools.partial(fr.reference_forward, policy=policy, **kw)
    return tuple(map(np.asarray, jax.jit(fwd)(q, k, v, *segs)))


def _bounds(case: str, **overrides):
    """Per element bounds on |O_kernel − O_twin| and |lse_kernel − lse_twin|, from f32 error analysis.

    The logits are exact in both programs (:func:`_inputs`) and scaled by one f32 product, so m, n, c, P̄, P̃ and α
    are the same in both (the same elementwise XLA:CPU functions of the same values); the programs differ in the
    order of the f32 sums inside a key block's P̃V matmul and ℓ (bk terms). Each product W_j·v_j (W_j = P̃_j times
    the later blocks' α) meets at most n = bk + 3·nb + 1 roundings on its way into O: bk − 1 additions in its block's
    sum, one adding the split's two sums, one adding the block to acc, two (×α, +) per later block, the division;
    ℓ the same without the division. So acc_x = Σ W_j v_j (1 + θ_j), ℓ_x = Σ W'_j (1 + θ'_j), |θ| <= γ_n, and to first
    order |O_k − O_t| <= 2·(γ_n·A⁺/L + 2γ_n·|O| + u·|O|) <= 7γ_n·A⁺/L with A⁺/L = Σ W_j|v_j| / Σ W'_j <= 1.1·Σ p_j|v_j|
    (p: the exact softmax in f64; W and W' differ from its weights only by the bf16 roundings of P̃ and α, < 2^-8
    each, over at most nb + 1 factors). lse = c + log ℓ: |Δ log ℓ| <= 2.1γ_{n−1}, the two logs err by <= 2 f32 ulps
    of |log ℓ| <= |lse| + |m| + 64 (c = m + offset, offset <= 64), the additions by u·|lse| each."""
    _, h, hkv, tq, tk, _, _, _, _, _, _ = CASES[case]
    kw = _kw(case, **overrides)
    q, k, v = (np.asarray(x, np.float64) for x in _inputs(case))  # dtype -> f64, exact
    g = h // hkv
    s = np.einsum("bhqd,bhkd->bhqk", q, np.repeat(k, g, axis=1)) * float(np.float32(kw["scale"]))  # exact dot
    pos_q, pos_k = np.arange(tq)[:, None], np.arange(tk)[None, :]
    ok = np.broadcast_to(np.asarray(fm.position_mask(pos_q, pos_k, kw["causal"], kw["window"])), (tq, tk))
    m = np.where(ok, s, -np.inf).max(-1, keepdims=True)
    e = np.where(ok, np.exp(s - m), 0.0)
    p = e / e.sum(-1, keepdims=True)
    weighted = np.einsum("bhqk,bhkd->bhqd", p, np.abs(np.repeat(v, g, axis=1)))
    n = kw["block_k"] + 3 * (tk // kw["block_k"]) + 1
    lse = m[..., 0] + np.log(e.sum(-1))
    o_bound = 7 * gamma(n) * 1.1 * weighted
    lse_bound = 2.1 * gamma(n - 1) + 10 * U32 * (np.abs(lse) + np.abs(m[..., 0]) + 64)
    return o_bound, lse_bound


def _ties(case: str) -> float:
    """Fraction of query rows whose largest visible logit is repeated (what the β rule acts on)."""
    _, h, hkv, tq, tk, _, _, causal, window, _, _ = CASES[case]
    q, k, _ = (np.asarray(x, np.float64) for x in _inputs(case))
    s = np.einsum("bhqd,bhkd->bhqk", q, np.repeat(k, h // hkv, axis=1))
    ok = np.broadcast_to(np.asarray(fm.position_mask(np.arange(tq)[:, None], np.arange(tk), causal, window)), s.shape)
    s = np.where(ok, s, -np.inf)
    return float(np.mean((s == s.max(-1, keepdims=True)).sum(-1) > 1))


# -- math.py's rules on rows (the kernel's layout) and on columns (the twin's) ------------------------------------


@pytest.mark.parametrize(
    "policy",
    [
        fm.default_policy(),
        fm.standard_policy(),
        fm.default_policy(accumulator="pv"),
        fm.AttentionPolicy(accumulator="f32", denominator="f32"),
    ],
    ids=["stable", "standard", "pv", "beta-f32"],
)
def test_forward_step_on_rows_equals_on_columns(policy):
    """Two key blocks of math.py's online softmax on [64] rows (the kernel's layout) and on [64, 1] columns (the twin's
    and the other kernels'): the same carry bit for bit, op by op under XLA, with integer-grid logits (ties), large
    logits (the β cap), a causal mask and a row that sees no key in the first block."""
    rng = np.random.default_rng(1)
    bq, bk, d = 64, 64, 32
    v = jnp.asarray(rng.standard_normal((2, bk, d)), jnp.bfloat16)
    s = rng.integers(-6, 7, (2, bq, bk)) / 4.0
    s[:, :8] *= 16  # repeated maxima of 24: β offsets past the cap
    s = jnp.asarray(s, jnp.float32)
    valid = [jnp.asarray(np.arange(bk)[None, :] <= np.arange(bq)[:, None] - 1), True]  # row 0 sees nothing first
    cols = (jnp.full((bq, 1), -jnp.inf), *(jnp.zeros((bq, 1)),) * 3, jnp.zeros((bq, d)))
    rows = tuple(x[:, 0] for x in cols[:4]) + (cols[4],)
    for j in range(2):

        def matmul(w, j=j):
            return jnp.dot(w, v[j], preferred_element_type=jnp.float32)

        cols = fm.forward_step(cols, s[j], valid[j], matmul, policy, jnp.bfloat16)
        rows = fm.forward_step(rows, s[j], valid[j], matmul, policy, jnp.bfloat16)
        for r, c in zip(rows[:4], cols[:4], strict=True):
            np.testing.assert_array_equal(r, c[:, 0])
        np.testing.assert_array_equal(rows[4], cols[4])
    assert float(jnp.max(rows[1])) > 1  # some rows saw repeated maxima


# -- the kernel in the interpreter against the twin --------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernel_matches_twin(case, policy):
    """O and lse of the interpreted kernel within the f32 bounds of :func:`_bounds` of the XLA twin's (same policy,
    same block_k). Measured on an Intel Xeon: O at most 3 f32 ulps of max|O| (under 1% of the bound), lse equal."""
    o, lse = _kernel(case, POLICIES[policy])
    o_t, lse_t = _twin(case, POLICIES[policy])
    assert o.dtype == np.float32 and lse.dtype == np.float32 and o.shape == o_t.shape and lse.shape == lse_t.shape
    o_bound, lse_bound = _bounds(case)
    assert_within(o, o_t, o_bound, f"{case} {policy} O")
    assert_within(lse, lse_t, lse_bound, f"{case} {policy} lse")
    assert np.isfinite(o).all() and np.isfinite(lse).all()


@pytest.mark.parametrize("case", ["window-d128", "causal-gqa-d64"])
def test_bound_resolves_a_wrong_policy_and_a_mask_one_key_off(case):
    """The bound the kernel meets is tight enough to fail a kernel that used the other policy or a mask one key off:
    the stable kernel's O exceeds it against the standard twin, and against the twin with the window one key wider
    or narrower; causal, against the non-causal twin and the twin with a window of T − 1 keys (which hides key 0
    from the last query only)."""
    o, _ = _kernel(case, POLICIES["stable"])
    o_bound, _ = _bounds(case)
    assert _ties(case) > 0.02  # rows with repeated maxima, where the two policies' P̃ differ most
    wrong = {"standard policy": _twin(case, POLICIES["standard"])[0]}
    window = CASES[case][8]
    if window:
        wrong["window + 1"] = _twin(case, POLICIES["stable"], window=window + 1)[0]
        wrong["window - 1"] = _twin(case, POLICIES["stable"], window=window - 1)[0]
    else:
        wrong["non-causal"] = _twin(case, POLICIES["stable"], causal=False)[0]
        wrong["window T - 1"] = _twin(case, POLICIES["stable"], window=CASES[case][3] - 1)[0]
    for what, o_wrong in wrong.items():
        assert (np.abs(o - o_wrong) > o_bound).any(), what


def test_residual_input_returns_o_rounded_to_the_input_dtype():
    """policy.residual == "input" (the standard policy): the kernel writes O rounded to nearest in bf16, that is the f32
    O of the same arithmetic (residual "f32") within half a bf16 ulp, plus the f32 bound between two programs."""
    case = "causal-gqa-d64"
    fwd = functools.partial(mg.forward, policy=fm.standard_policy(), interpret=True, **_kw(case))
    o16, lse = jax.jit(fwd)(*_inputs(case))
    assert o16.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    o32, lse32 = _kernel(case, POLICIES["standard"])
    o_bound, lse_bound = _bounds(case)
    top = np.abs(o32.astype(np.float64)) + o_bound  # the largest |O| the other program may have rounded
    half_ulp = 2.0 ** (np.floor(np.log2(np.maximum(top, 2.0**-126))) - 8)  # bf16: 8 significant bits
    assert_within(o16.astype(jnp.float32), o32, half_ulp + o_bound, "bf16 O")  # bf16 -> f32, exact
    assert_within(lse, lse32, lse_bound, "lse")


def _visible_blocks(t: int, bq: int, bk: int, causal: bool, window: int) -> list[tuple[int, int]]:
    """(query block, key block) pairs holding at least one (query, key) pair the position rule shows: brute force."""
    pos = np.arange(t)
    seen = np.broadcast_to(np.asarray(fm.position_mask(pos[:, None], pos[None, :], causal, window)), (t, t))
    return [
        (i, j)
        for i in range(t // bq)
        for j in range(t // bk)
        if seen[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any()
    ]


@pytest.mark.parametrize("bk, window", [(64, 70), (128, 20), (64, 0)])
def test_kernel_visits_only_the_key_blocks_in_range(bk, window, monkeypatch):
    """Each pipeline step builds its block's mask with block_mask; a wrapper records (query block, key block) from
    inside the interpreted kernel: every (query head, query block) visits exactly the key blocks with a visible pair,
    once: O(T·w) blocks with a window (a kernel that walked every causal block and masked would record more)."""
    visits = []
    real = mg.block_mask

    def counting(q_start, k_start, shape, causal, window, interpret):
        jax.debug.callback(lambda i, j: visits.append((int(i), int(j))), q_start // shape[0], k_start // shape[1])
        return real(q_start, k_start, shape, causal, window, interpret)

    monkeypatch.setattr(mg, "block_mask", counting)
    t, h = 256, 2
    x = jnp.ones((1, h, t, 64), jnp.bfloat16)
    kw = dict(policy=fm.default_policy(), causal=True, window=window, scale=1.0, block_k=bk, interpret=True)
    jax.block_until_ready(mg.forward(x, x[:, :1], x[:, :1], **kw))
    jax.effects_barrier()
    expected = _visible_blocks(t, mg.BLOCK_Q, bk, True, window)
    assert sorted(visits) == sorted(expected * h)
    nq, nk = t // mg.BLOCK_Q, t // bk
    ranges = [tiles.key_blocks(i, bq=mg.BLOCK_Q, bk=bk, nk=nk, causal=True, window=window) for i in range(nq)]
    assert sorted(expected) == sorted((i, j) for i, (f, e) in enumerate(ranges) for j in range(f, e))
    if window:
        assert len(expected) < len(_visible_blocks(t, mg.BLOCK_Q, bk, True, 0))  # the window leaves blocks out


def test_rejects_what_it_does_not_support():
    q = jnp.zeros((1, 2, 128, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 1, 128, 64), jnp.bfloat16)
    kw = dict(policy=fm.default_policy(), causal=True, scale=0.125, interpret=True)
    seg = jnp.zeros((1, 128), jnp.int32)
    with pytest.raises(ValueError, match=r"^segment ids \(packed sequences, kv padding\) are not supported"):
        mg.forward(q, kv, kv, seg, seg, **kw)
    with pytest.raises(ValueError, match=r"must share one dtype of \['bfloat16', 'float16'\]"):
        mg.forward(q.astype(jnp.float32), kv.astype(jnp.float32), kv.astype(jnp.float32), **kw)  # bf16 -> f32
    with pytest.raises(ValueError, match=r"^head dim D=32 is not supported .* allowed: \(64, 128, 192, 256\)"):
        mg.forward(q[..., :32], kv[..., :32], kv[..., :32], **kw)
    with pytest.raises(ValueError, match=r"^block_q must be 64 .* got block_q=128, block_k=64"):
        mg.forward(q, kv, kv, block_q=128, **kw)
    with pytest.raises(ValueError, match=r"pv_dtype='float32' differs from the input dtype bfloat16"):
        mg.forward(q, kv, kv, **{**kw, "policy": fm.default_policy(pv_dtype="float32")})
    with pytest.raises(ValueError, match=r"^interpret must be True .* got None"):
        mg.forward(q, kv, kv, **{**kw, "interpret": None})
    with pytest.raises(ValueError, match=r"^sliding window=8 needs causal attention"):
        mg.forward(q, kv, kv, **{**kw, "causal": False}, window=8)
    with pytest.raises(ValueError, match=r"^need Tq % block_q == 0"):
        mg.forward(q[:, :, :96], kv[:, :, :96], kv[:, :, :96], **kw)
    q256, kv256 = jnp.zeros((1, 2, 128, 256), jnp.bfloat16), jnp.zeros((1, 1, 128, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"^D=256 with block_k=128 needs 296984 bytes of shared memory"):
        mg.forward(q256, kv256, kv256, block_k=128, **kw)


# -- deviceless: lowering and compiling for an H100 --------------------------------------------------------------------

B, H, HKV, T, D = 1, 8, 2, 4096, 128


def _h100_sharding():
    try:
        device = targets.devices("h100:1x1x8")[0]
    except ValueError as e:  # jax's CUDA plugin is not installed: no compile-only GPU target
        pytest.skip(f"no compile-only H100 target: {e}")
    return jax.sharding.SingleDeviceSharding(device)


@pytest.mark.parametrize(
    "d, block_k, window, policy, dtype",
    [
        (D, 64, 0, "stable", jnp.bfloat16),
        (D, 128, 1024, "stable", jnp.bfloat16),
        (256, 64, 0, "standard", jnp.bfloat16),
        (64, 128, 0, "stable", jnp.float16),
    ],
    ids=["causal", "window-bk128", "d256-standard", "d64-bk128-f16"],
)
def test_compiles_for_h100_as_one_mosaic_gpu_kernel(d, block_k, window, policy, dtype):
    """B=1, H=8, Hkv=2, T=4096 compiled for one H100 (sm_90a target config): the compiled program holds exactly one
    Mosaic GPU custom call (``mosaic_gpu_v2``, the kernel; Mosaic GPU checks its shared memory against the 227 KiB
    limit while lowering) and no Triton call. ~1 s per compile on 2 CPU cores."""
    sharding = _h100_sharding()
    q = jax.ShapeDtypeStruct((B, H, T, d), dtype, sharding=sharding)
    kv = jax.ShapeDtypeStruct((B, HKV, T, d), dtype, sharding=sharding)
    pol = fm.default_policy() if policy == "stable" else fm.standard_policy()
    fwd = functools.partial(mg.forward, policy=pol, causal=True, window=window, scale=d**-0.5, block_k=block_k)
    text = jax.jit(fwd).lower(q, kv, kv).compile().as_text()
    assert re.findall(r'custom_call_target="([^"]+)"', text) == ["mosaic_gpu_v2"]
    assert "triton" not in text


def _launch(lowered) -> tuple[int, ...]:
    """(grid x, y, z, block x, y, z, dynamic shared memory bytes) of the gpu.launch inside the one Mosaic GPU custom
    call of a lowered program. Reads the kernel's serialized MLIR with jax-internal modules; skips if they moved."""
    try:
        from jax._src.interpreters import mlir as jax_mlir
        from jax._src.lib import mosaic_gpu_dialect
        from jax._src.lib.mlir import ir
    except ImportError as e:
        pytest.skip(f"jax's internal MLIR modules moved: {e}")
    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if child.operation.name == "stablehlo.custom_call":
                        calls.append(child)
                    walk(child.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    [call] = calls
    module = ir.StringAttr(ir.DictAttr(call.attributes["mhlo.backend_config"])["module"]).value_bytes
    with jax_mlir.make_ir_context() as ctx:
        mosaic_gpu_dialect.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True
        text = str(ir.Module.parse(module))
    operands = re.search(r'gpu\.launch"\(([^)]*)\)', text).group(1).replace(" ", "").split(",")
    consts = dict(re.findall(r'(%\w+) = "[\w.]*arith\.constant"\(\) \{value = (\d+) : (?:i32|index)\}', text))
    return tuple(int(consts[x]) for x in operands[1:])


@pytest.mark.parametrize("d, block_k", [(64, 128), (128, 64), (128, 128), (256, 64)])
def test_shared_memory_per_block_does_not_grow_with_t(d, block_k):
    """Lowered for cuda at T = 4096 and T = 32768: the same shared memory per block, equal to smem_bytes (the Q block,
    two K/V slots, the reduction scratch and three barriers; 83,992 bytes at D = 128, bk = 64), and a launch of
    B × H × T/64 blocks of one warpgroup (Mosaic GPU launches the grid axes reversed: x = B, y = H, z = T/64)."""
    policy = fm.default_policy()
    for t in (4096, 32768):
        q = jax.ShapeDtypeStruct((B, H, t, d), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((B, HKV, t, d), jnp.bfloat16)
        fwd = functools.partial(mg.forward, policy=policy, causal=True, scale=d**-0.5, block_k=block_k)
        launch = _launch(jax.jit(fwd).trace(q, kv, kv).lower(lowering_platforms=("cuda",)))
        assert launch == (B, H, t // 64, 128, 1, 1, mg.smem_bytes(d, 2, 4, block_k))
    assert mg.smem_bytes(128, 2, 4, 64) == 83992
    assert mg.smem_bytes(256, 2, 4, 64) <= mg.SMEM_LIMIT < mg.smem_bytes(256, 2, 4, 128)
