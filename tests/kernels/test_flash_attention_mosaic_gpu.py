"""The Mosaic GPU (Hopper) flash attention (lpt/kernels/flash_attention/mosaic_gpu.py), forward and backward: math.py's
rules on its row vectors against the same rules on columns, bit for bit; the kernels in the Mosaic GPU interpreter
against the XLA twin (stable and standard policy; causal, cross, full and sliding-window attention; GQA; segment ids
with padding; D = 64, 128 (and 256 forward); bf16 and f16) within bounds from f32 error analysis that a wrong policy, a
mask one key off or ignored segments exceed; the blocks they visit; their errors; and deviceless compiles for one H100
(custom calls, shared memory per block, ptxas register spills)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED
from float_bounds import U32, assert_within, gamma

from lpt import targets
from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention import mosaic_gpu as mg
from lpt.kernels.flash_attention import mosaic_gpu_blocks as mgb
from lpt.kernels.flash_attention import reference as fr
from lpt.kernels.flash_attention import tiles
from lpt.kernels.flash_attention.options import FlashOptions

POLICIES = {"stable": fm.default_policy(), "standard": fm.standard_policy(residual="f32")}  # f32 O from both

# name: (B, H, Hkv, Tq, Tk, D, block_k, causal, window, dtype, q scale)
CASES = {
    "causal-gqa-d64": (1, 2, 1, 256, 256, 64, 64, True, 0, jnp.bfloat16, 1),
    "cross-d128": (1, 2, 1, 128, 256, 128, 128, False, 0, jnp.bfloat16, 1),  # Tq != Tk, bk = 128 != bq
    "window-d128": (1, 2, 1, 256, 256, 128, 64, True, 100, jnp.bfloat16, 1),  # window not a multiple of the blocks
    "causal-bk128-large-logits": (1, 2, 2, 256, 256, 64, 128, True, 0, jnp.bfloat16, 16),  # β offsets past the cap
    "f16-d256": (1, 2, 1, 128, 128, 256, 64, True, 0, jnp.float16, 1),
    "packed-padded-gqa-d64": (1, 2, 1, 256, 256, 64, 64, True, 0, jnp.bfloat16, 1),  # segment ids: SEGMENTED
}
SEGMENTED = {"packed-padded-gqa-d64"}  # the cases run with segment ids (:func:`_segment_ids`)


def _segment_ids(b: int, t: int):
    """(q_seg, kv_seg) int32 [B, T] as lpt.attention builds them for three packed sequences of 90, 100 and 40 tokens
    padded to T: the last T − 230 queries get −2 and keys −1, ids that match nothing (those queries see no key)."""
    seg = np.repeat([0, 1, 2, -1], [90, 100, 40, t - 230])
    q_seg = np.where(seg < 0, -2, seg)
    return tuple(jnp.asarray(np.broadcast_to(x, (b, t)), jnp.int32) for x in (q_seg, seg))  # int64 -> int32


def _visible(q_seg, kv_seg, tq: int, tk: int, causal: bool, window: int):
    """[B, 1, Tq, Tk] bool: which keys each query sees (positions and segments; None: one segment)."""
    ok = np.asarray(fm.position_mask(np.arange(tq)[:, None], np.arange(tk)[None, :], causal, window))
    ok = np.broadcast_to(ok, (tq, tk))[None, None]
    if q_seg is None:
        return ok
    return ok & (np.asarray(q_seg)[:, None, :, None] == np.asarray(kv_seg)[:, None, None, :])


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


def _segments_of(case: str, cases: dict):
    """The segment ids of a case: :func:`_segment_ids` for the SEGMENTED cases, else None (one segment)."""
    b, _, _, tq = cases[case][:4]
    return _segment_ids(b, tq) if case in SEGMENTED else None


def _twin_segments(q, k, segs):
    """The twin's segment ids: ``segs``, or one segment (zeros [B, T]) for None."""
    return segs if segs is not None else (jnp.zeros(q.shape[::2], jnp.int32), jnp.zeros(k.shape[::2], jnp.int32))


@functools.cache
def _kernel(case: str, policy: fm.AttentionPolicy):
    """The interpreted kernel's (O, lse), as numpy (cached: several tests compare one run). Compiled with XLA's
    default optimizations, not ``CPU``: test_flash_attention_mosaic_gpu_ws.py compares it bit for bit with the
    warp-specialized kernel's, and the two programs' f32 results agree bit for bit only as both compile by default."""
    fwd = functools.partial(mg.forward, options=FlashOptions(policy=policy, interpret=True, **_kw(case)))
    segs = _segments_of(case, CASES) or (None, None)
    return tuple(map(np.asarray, jax.jit(fwd)(*_inputs(case), *segs)))


def _twin(case: str, policy: fm.AttentionPolicy, segs="case", **overrides):
    """The twin's (O, lse) of the case (``segs``: the case's segment ids, or the given ones; None: one segment)."""
    q, k, v = _inputs(case)
    kw = _kw(case, **overrides)
    segs = _twin_segments(q, k, _segments_of(case, CASES) if segs == "case" else segs)
    fwd = functools.partial(fr.reference_forward, options=FlashOptions(policy=policy, **kw))
    return tuple(map(np.asarray, jax.jit(fwd, compiler_options=UNOPTIMIZED)(q, k, v, *segs)))


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
    ok = _visible(*(_segments_of(case, CASES) or (None, None)), tq, tk, kw["causal"], kw["window"])
    m = np.where(ok, s, -np.inf).max(-1, keepdims=True)
    e = np.where(ok, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    ell = e.sum(-1, keepdims=True)
    p = e / np.where(ell > 0, ell, 1.0)  # rows that see no key: O = 0 in both programs (bound 0)
    weighted = np.einsum("bhqk,bhkd->bhqd", p, np.abs(np.repeat(v, g, axis=1)))
    n = kw["block_k"] + 3 * (tk // kw["block_k"]) + 1
    with np.errstate(divide="ignore"):
        lse = m[..., 0] + np.log(ell[..., 0])  # −inf where the row sees no key (compared for equality)
    o_bound = 7 * gamma(n) * 1.1 * weighted
    lse_bound = 2.1 * gamma(n - 1) + 10 * U32 * (np.abs(lse) + np.abs(m[..., 0]) + 64)
    return o_bound, lse_bound


def _ties(case: str) -> float:
    """Fraction of query rows whose largest visible logit is repeated (what the β rule acts on)."""
    _, h, hkv, tq, tk, _, _, causal, window, _, _ = CASES[case]
    q, k, _ = (np.asarray(x, np.float64) for x in _inputs(case))
    s = np.einsum("bhqd,bhkd->bhqk", q, np.repeat(k, h // hkv, axis=1))
    ok = np.broadcast_to(_visible(*(_segments_of(case, CASES) or (None, None)), tq, tk, causal, window), s.shape)
    s = np.where(ok, s, -np.inf)
    return float(np.mean(((s == s.max(-1, keepdims=True)) & ok).sum(-1) > 1))


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
    seen = np.isfinite(lse_t)  # rows that see a key (all but the padded queries of the SEGMENTED cases)
    assert_within(lse[seen], lse_t[seen], lse_bound[seen], f"{case} {policy} lse")
    assert np.isfinite(o).all() and np.isfinite(lse[seen]).all() and (lse[~seen] == -np.inf).all()
    assert seen.all() == (case not in SEGMENTED)


def _shifted_segments(case: str, cases: dict):
    """The case's segment ids with the key segments one key off: every boundary between two kv segments one key
    later."""
    q_seg, kv_seg = _segments_of(case, cases)
    return q_seg, jnp.concatenate([kv_seg[:, :1], kv_seg[:, :-1]], axis=1)


@pytest.mark.parametrize("case", ["window-d128", "causal-gqa-d64", "packed-padded-gqa-d64"])
def test_bound_resolves_a_wrong_policy_and_a_mask_one_key_off(case):
    """The bound the kernel meets is tight enough to fail a kernel that used the other policy or a mask one key off:
    the stable kernel's O exceeds it against the standard twin, and against the twin with the window one key wider
    or narrower; causal, against the non-causal twin and the twin with a window of T − 1 keys (which hides key 0
    from the last query only); with segment ids, against the twin without them and the twin with every kv segment
    boundary one key later."""
    o, _ = _kernel(case, POLICIES["stable"])
    o_bound, _ = _bounds(case)
    assert _ties(case) > 0.02  # rows with repeated maxima, where the two policies' P̃ differ most
    wrong = {"standard policy": _twin(case, POLICIES["standard"])[0]}
    window = CASES[case][8]
    if case in SEGMENTED:
        wrong["no segments"] = _twin(case, POLICIES["stable"], segs=None)[0]
        wrong["kv segments one key off"] = _twin(case, POLICIES["stable"], segs=_shifted_segments(case, CASES))[0]
    elif window:
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
    fwd = functools.partial(mg.forward, options=FlashOptions(policy=fm.standard_policy(), interpret=True, **_kw(case)))
    o16, lse = jax.jit(fwd, compiler_options=UNOPTIMIZED)(*_inputs(case))
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


def block_visits(forward, monkeypatch, *, t, h, hkv, bk, window):
    """The (64-row query block, key block) pairs whose mask ``forward`` (a Mosaic GPU flash-attention forward, in the
    interpreter) builds with ``block_mask``, recorded from inside the kernel: causal, ``h`` query heads, ``hkv`` kv
    heads, T = ``t``, D 64."""
    visits = []
    real = mgb.block_mask

    def counting(q_start, k_start, shape, causal, window, interpret):
        jax.debug.callback(lambda i, j: visits.append((int(i), int(j))), q_start // shape[0], k_start // shape[1])
        return real(q_start, k_start, shape, causal, window, interpret)

    monkeypatch.setattr(mgb, "block_mask", counting)
    x = jnp.ones((1, h, t, 64), jnp.bfloat16)
    kw = dict(policy=fm.default_policy(), causal=True, window=window, scale=1.0, block_k=bk, interpret=True)
    run = jax.jit(functools.partial(forward, options=FlashOptions(**kw)), compiler_options=UNOPTIMIZED)
    jax.block_until_ready(run(x, x[:, :hkv], x[:, :hkv]))
    jax.effects_barrier()
    return visits


@pytest.mark.parametrize("bk, window", [(64, 70), (128, 20), (64, 0)])
def test_kernel_visits_only_the_key_blocks_in_range(bk, window, monkeypatch):
    """Each pipeline step builds its block's mask with block_mask; a wrapper records (query block, key block) from
    inside the interpreted kernel: every (query head, query block) visits exactly the key blocks with a visible pair,
    once: O(T·w) blocks with a window (a kernel that walked every causal block and masked would record more)."""
    t, h = 256, 2
    visits = block_visits(mg.forward, monkeypatch, t=t, h=h, hkv=1, bk=bk, window=window)
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
    opts = lambda **changes: FlashOptions(**{**kw, **changes})
    seg = jnp.zeros((1, 128), jnp.int32)
    with pytest.raises(ValueError, match=r"^pass both segment ids q_seg and kv_seg, or neither"):
        mg.forward(q, kv, kv, seg, None, options=opts())
    with pytest.raises(ValueError, match=r"^need segment ids q_seg \(1, 128\) and kv_seg \(1, 128\) int32"):
        mg.forward(q, kv, kv, seg, seg.astype(jnp.int16), options=opts())  # int32 -> int16
    with pytest.raises(ValueError, match=r"must share one dtype of \['bfloat16', 'float16'\]"):
        mg.forward(q.astype(jnp.float32), kv.astype(jnp.float32), kv.astype(jnp.float32), options=opts())  # -> f32
    with pytest.raises(ValueError, match=r"^head dim D=32 is not supported .* allowed: \(64, 128, 192, 256\)"):
        mg.forward(q[..., :32], kv[..., :32], kv[..., :32], options=opts())
    with pytest.raises(ValueError, match=r"^block_q must be 64 .* got block_q=128, block_k=64"):
        mg.forward(q, kv, kv, options=opts(block_q=128))
    with pytest.raises(ValueError, match=r"pv_dtype='float32' differs from the input dtype bfloat16"):
        mg.forward(q, kv, kv, options=opts(policy=fm.default_policy(pv_dtype="float32")))
    with pytest.raises(ValueError, match=r"^interpret must be True .* got None"):
        mg.forward(q, kv, kv, options=opts(interpret=None))
    with pytest.raises(ValueError, match=r"^sliding window=8 needs causal attention"):
        mg.forward(q, kv, kv, options=opts(causal=False, window=8))
    with pytest.raises(ValueError, match=r"^need Tq % block_q == 0"):
        mg.forward(q[:, :, :96], kv[:, :, :96], kv[:, :, :96], options=opts())
    q256, kv256 = jnp.zeros((1, 2, 128, 256), jnp.bfloat16), jnp.zeros((1, 1, 128, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"^D=256 with block_k=128 needs 296984 bytes of shared memory"):
        mg.forward(q256, kv256, kv256, options=opts(block_k=128))


# -- deviceless: lowering and compiling for an H100 --------------------------------------------------------------------

B, H, HKV, T, D = 1, 8, 2, 4096, 128


def _h100_sharding():
    try:
        device = targets.devices("h100:1x1x8")[0]
    except ValueError as e:  # jax's CUDA plugin is not installed: no compile-only GPU target
        pytest.skip(f"no compile-only H100 target: {e}")
    return jax.sharding.SingleDeviceSharding(device)


def _segment_structs(t: int, sharding=None) -> tuple:
    """ShapeDtypeStructs of q_seg, kv_seg [B, T] int32."""
    return (jax.ShapeDtypeStruct((B, t), jnp.int32, sharding=sharding),) * 2


@pytest.mark.parametrize(
    "d, block_k, window, policy, dtype, segments, causal",
    [
        (D, 64, 0, "stable", jnp.bfloat16, False, True),
        (D, 128, 1024, "stable", jnp.bfloat16, False, True),
        (256, 64, 0, "standard", jnp.bfloat16, False, True),
        (64, 128, 0, "stable", jnp.float16, False, True),
        (D, 64, 0, "standard", jnp.bfloat16, True, True),
        (D, 64, 0, "stable", jnp.bfloat16, False, False),
    ],
    ids=["causal", "window-bk128", "d256-standard", "d64-bk128-f16", "segments", "full"],
)
def test_compiles_for_h100_as_one_mosaic_gpu_kernel(d, block_k, window, policy, dtype, segments, causal):
    """B=1, H=8, Hkv=2, T=4096 compiled for one H100 (sm_90a target config): the compiled program holds exactly one
    Mosaic GPU custom call (``mosaic_gpu_v2``, the kernel; Mosaic GPU checks its shared memory against the 227 KiB
    limit while lowering) and no Triton call. Full attention masks nothing (no select on a scalar predicate, which
    Mosaic GPU does not lower from jax 0.11). ~1 s per compile on 2 CPU cores."""
    sharding = _h100_sharding()
    q = jax.ShapeDtypeStruct((B, H, T, d), dtype, sharding=sharding)
    kv = jax.ShapeDtypeStruct((B, HKV, T, d), dtype, sharding=sharding)
    segs = _segment_structs(T, sharding) if segments else ()
    pol = fm.default_policy() if policy == "stable" else fm.standard_policy()
    options = FlashOptions(causal=causal, scale=d**-0.5, policy=pol, window=window, block_k=block_k, interpret=False)
    fwd = functools.partial(mg.forward, options=options)
    text = jax.jit(fwd).lower(q, kv, kv, *segs).compile().as_text()
    assert re.findall(r'custom_call_target="([^"]+)"', text) == ["mosaic_gpu_v2"]
    assert "triton" not in text


def _launches(lowered) -> list[tuple[int, ...]]:
    """(grid x, y, z, block x, y, z, dynamic shared memory bytes) of the gpu.launch inside each Mosaic GPU custom
    call of a lowered program, in program order. Reads the kernels' serialized MLIR with jax-internal modules; skips
    if they moved."""
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
    launches = []
    for call in calls:
        module = ir.StringAttr(ir.DictAttr(call.attributes["mhlo.backend_config"])["module"]).value_bytes
        with jax_mlir.make_ir_context() as ctx:
            mosaic_gpu_dialect.register_dialect(ctx)
            ctx.allow_unregistered_dialects = True
            text = str(ir.Module.parse(module))
        operands = re.search(r'gpu\.launch"\(([^)]*)\)', text).group(1).replace(" ", "").split(",")
        consts = dict(re.findall(r'(%\w+) = "[\w.]*arith\.constant"\(\) \{value = (\d+) : (?:i32|index)\}', text))
        launches.append(tuple(int(consts[x]) for x in operands[1:]))
    return launches


@pytest.mark.parametrize(
    "d, block_k, segments", [(64, 128, False), (128, 64, False), (128, 128, False), (256, 64, False), (128, 64, True)]
)
def test_shared_memory_per_block_does_not_grow_with_t(d, block_k, segments):
    """Lowered for cuda at T = 4096 and T = 32768: the same shared memory per block, equal to smem_bytes (the Q block,
    two K/V slots, the reduction scratch and three barriers; 83,992 bytes at D = 128, bk = 64; with segment ids the
    query segments, kv segment slots and one barrier more: 86,048), and a launch of B × H × T/64 blocks of one
    warpgroup (Mosaic GPU launches the grid axes reversed: x = B, y = H, z = T/64)."""
    policy = fm.default_policy()
    for t in (4096, 32768):
        q = jax.ShapeDtypeStruct((B, H, t, d), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((B, HKV, t, d), jnp.bfloat16)
        segs = _segment_structs(t) if segments else ()
        options = FlashOptions(causal=True, scale=d**-0.5, policy=policy, block_k=block_k, interpret=False)
        fwd = functools.partial(mg.forward, options=options)
        [launch] = _launches(jax.jit(fwd).trace(q, kv, kv, *segs).lower(lowering_platforms=("cuda",)))
        assert launch == (B, H, t // 64, 128, 1, 1, mg.smem_bytes(d, 2, 4, block_k, segments=segments))
    assert (mg.smem_bytes(128, 2, 4, 64), mg.smem_bytes(128, 2, 4, 64, segments=True)) == (83992, 86048)
    assert mg.smem_bytes(256, 2, 4, 64) <= mg.SMEM_LIMIT < mg.smem_bytes(256, 2, 4, 128)


# -- the backward (dQ, dK/dV) in the interpreter against the twin's backward -------------------------------------------

BWD_POLICIES = {"stable": fm.default_policy(), "standard": fm.standard_policy()}  # standard: δ from the bf16 O

# name: (B, H, Hkv, Tq, Tk, D, block_k, causal, window, dtype)
BWD_CASES = {
    "causal-gqa-d64": (1, 2, 1, 256, 256, 64, 64, True, 0, jnp.bfloat16),
    "full-cross-d128": (1, 2, 1, 128, 256, 128, 64, False, 0, jnp.bfloat16),  # Tq != Tk
    "window-d128": (1, 2, 1, 256, 256, 128, 64, True, 100, jnp.bfloat16),  # window not a multiple of the blocks
    "causal-gqa-bk128-d64": (1, 2, 1, 256, 256, 64, 128, True, 0, jnp.bfloat16),  # 128-row steps in both kernels
    "window-f16-d64": (1, 1, 1, 256, 256, 64, 64, True, 70, jnp.float16),  # G = 1
    "packed-padded-gqa-d64": (1, 2, 1, 256, 256, 64, 64, True, 0, jnp.bfloat16),  # segment ids: SEGMENTED
}


def _bwd_inputs(case: str):
    """q, k, v, dO on the grid {−3, …, 3}/4 in the case's dtype: the logits q·k and dP = dO·v are sums of at most
    D <= 128 multiples of 2^-4 below 2^7, exact in f32 in any order, so both programs see the same S and dP; with
    the same lse and δ they then compute the same round(P) and round(dS) (the same elementwise XLA:CPU functions of
    the same f32 values) and differ only in the order of the f32 sums of dQ, dK, dV."""
    b, h, hkv, tq, tk, d, _, _, _, dtype = BWD_CASES[case]
    rng = np.random.default_rng(10 + list(BWD_CASES).index(case))
    shapes = ((b, h, tq, d), (b, hkv, tk, d), (b, hkv, tk, d), (b, h, tq, d))
    return tuple(jnp.asarray(rng.integers(-3, 4, s) / 4, dtype) for s in shapes)  # int -> f64 -> dtype, exact


def _bwd_kw(case: str, **overrides) -> dict:
    _, _, _, _, _, d, bk, causal, window, _ = BWD_CASES[case]
    return {"causal": causal, "window": window, "scale": d**-0.5, "block_k": bk, **overrides}


@functools.cache
def _bwd_rows(case: str, policy: str):
    """(lse, δ) [B, H, Tq] f32 of ``policy``: lse from the twin's forward, δ = rowsum(dO ∘ O_residual) with the
    policy's residual (the f32 O for the stable policy, the bf16 O for the standard one), as the wrapper makes them.
    A query that sees no key (padding) has lse = −inf and O = 0, so δ = 0."""
    q, k, v, do = _bwd_inputs(case)
    pol = BWD_POLICIES[policy]
    options = FlashOptions(policy=pol, **_bwd_kw(case))

    def rows(q, k, v, do, q_seg, kv_seg):
        o, lse = fr.reference_forward(q, k, v, q_seg, kv_seg, options=options)
        residual = fm.residual_and_output(o, q.dtype, pol, None)[1]
        return lse, jnp.sum(do.astype(jnp.float32) * residual.astype(jnp.float32), axis=-1)  # dtype -> f32, exact

    return jax.jit(rows, compiler_options=UNOPTIMIZED)(
        q, k, v, do, *_twin_segments(q, k, _segments_of(case, BWD_CASES))
    )


@functools.cache
def _bwd_kernel(case: str, policy: str):
    """The interpreted backward's (dq, dk, dv) given the policy's lse and δ, as numpy (cached)."""
    q, k, v, do = _bwd_inputs(case)
    lse, delta = _bwd_rows(case, policy)
    bwd = functools.partial(mg.backward, options=FlashOptions(interpret=True, **_bwd_kw(case)))
    segs = _segments_of(case, BWD_CASES) or (None, None)
    return tuple(map(np.asarray, jax.jit(bwd, compiler_options=UNOPTIMIZED)(q, k, v, *segs, lse, do, delta)))


def _bwd_twin(case: str, policy: str, segs="case", **overrides):
    """The twin's backward given the policy's lse and δ (``segs`` as in :func:`_twin`)."""
    q, k, v, do = _bwd_inputs(case)
    lse, delta = _bwd_rows(case, policy)
    segs = _twin_segments(q, k, _segments_of(case, BWD_CASES) if segs == "case" else segs)
    bwd = functools.partial(fr.reference_backward, options=FlashOptions(**_bwd_kw(case, **overrides)))
    return tuple(map(np.asarray, jax.jit(bwd, compiler_options=UNOPTIMIZED)(q, k, v, *segs, lse, do, delta)))


def _bwd_bounds(case: str, policy: str):
    """Per element bounds on |dX_kernel − dX_twin| (X = Q, K, V), from f32 error analysis.

    Both programs feed the same round(P) and round(dS) (:func:`_bwd_inputs`) into f32 sums of exact products (16-bit
    times 16-bit values fit f32's 24 bits), so they differ only in the order of those sums; a sum whose terms each
    meet at most n roundings is within γ_n·Σ|terms| of the exact sum in any order (Higham §3.1), so the two are
    within (γ_{n_kernel} + γ_{n_twin})·Σ|terms|:

    * dQ = scale·Σ_j round(dS_j) K_j: both add per key block of bk keys (bk − 1 roundings in the block's matmul,
      one adding it to the running dq) and scale once: n = bk + nk + 1 for both.
    * dV = Σ round(Pᵀ) dO, dK = scale·Σ round(dSᵀ) Q over the G query heads' Tq rows: the kernel adds per query block
      of bk rows (bk − 1 in the matmul, one per block: n = bk − 1 + G·Tq/bk), the twin sums all G·Tq rows in one
      matmul (n = G·Tq − 1); dK one more each for the scale.

    The terms: |round(P)| <= 1.01·P + s_min/2 and |round(dS)| <= 1.01·P·|dP − δ| + s_min/2, with P = exp(S − lse)
    and dP in f64 (exact S, dP), s_min the dtype's smallest subnormal: the 16-bit rounding is within 2^-9 relative
    (or half a subnormal step), the f32 exp of the rounded S − lse within a few ulps."""
    b, h, hkv, tq, tk, d, bk, causal, window, dtype = BWD_CASES[case]
    g = h // hkv
    q, k, v, do = (np.asarray(x, np.float64) for x in _bwd_inputs(case))  # dtype -> f64, exact
    lse, delta = (np.asarray(x, np.float64)[..., None] for x in _bwd_rows(case, policy))  # f32 -> f64, exact
    scale = float(np.float32(d**-0.5))
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    ok = _visible(*(_segments_of(case, BWD_CASES) or (None, None)), tq, tk, causal, window)
    s = np.einsum("bhqd,bhkd->bhqk", q, kr) * scale
    p = np.where(ok, np.exp(np.minimum(s - lse, 0.0)), 0.0)  # lse = −inf only on rows that see no key (ok False)
    tiny = float(jnp.finfo(dtype).smallest_subnormal) / 2
    p_in = 1.01 * p + tiny
    ds_in = 1.01 * p * np.abs(np.einsum("bhqd,bhkd->bhqk", do, vr) - delta) + tiny

    def per_kv_head(x):  # [B, H, Tk, D] -> [B, Hkv, Tk, D]: the sum over the G query heads of each kv head
        return x.reshape(b, hkv, g, tk, d).sum(axis=2)

    n_dq = bk + tk // bk + 1
    n_kernel, n_twin = bk - 1 + g * tq // bk, g * tq - 1
    dq_bound = 2 * gamma(n_dq) * scale * np.einsum("bhqk,bhkd->bhqd", ds_in, np.abs(kr))
    dk_bound = (
        (gamma(n_kernel + 1) + gamma(n_twin + 1)) * scale * per_kv_head(np.einsum("bhqk,bhqd->bhkd", ds_in, np.abs(q)))
    )
    dv_bound = (gamma(n_kernel) + gamma(n_twin)) * per_kv_head(np.einsum("bhqk,bhqd->bhkd", p_in, np.abs(do)))
    return dq_bound, dk_bound, dv_bound


@pytest.mark.parametrize(
    "case, policy",
    [(case, "stable") for case in BWD_CASES] + [("causal-gqa-d64", "standard"), ("full-cross-d128", "standard")],
)
def test_interpreted_backward_matches_twin(case, policy):
    """dQ, dK, dV of the interpreted backward (dQ kernel, GQA-native dK/dV kernel) within the f32 bounds of
    :func:`_bwd_bounds` of the XLA twin's backward, given the same lse and δ of the policy (the kernels have no
    policy: it enters through lse and δ; the standard policy on two cases). Measured on an Intel Xeon: at most 0.5%
    of the bound, 1.6 f32 ulps of max|dX|."""
    grads = _bwd_kernel(case, policy)
    twin = _bwd_twin(case, policy)
    for name, x, x_t, bound in zip(("dq", "dk", "dv"), grads, twin, _bwd_bounds(case, policy), strict=True):
        assert x.dtype == np.float32 and x.shape == x_t.shape, name
        assert np.isfinite(x).all(), name
        assert_within(x, x_t, bound, f"{case} {policy} {name}")
        assert np.abs(x_t).max() > 0, name


@pytest.mark.parametrize("case", ["window-d128", "causal-gqa-d64", "packed-padded-gqa-d64"])
def test_backward_bound_resolves_a_wrong_policy_and_a_mask_one_key_off(case):
    """The bound is tight enough to fail a backward fed the other policy's lse and δ, or masking one key off: the
    kernel's dQ, dK, dV (stable policy) each exceed it against the twin's backward with the standard policy's lse
    and δ, and against the twin's with the window one key wider or narrower; causal, against the non-causal twin and
    the twin with a window of T − 1 keys (which hides key 0 from the last query only); with segment ids, against the
    twin without them and the twin with every kv segment boundary one key later."""
    grads = _bwd_kernel(case, "stable")
    bounds = _bwd_bounds(case, "stable")
    wrong = {"standard policy": _bwd_twin(case, "standard")}
    window = BWD_CASES[case][8]
    if case in SEGMENTED:
        wrong["no segments"] = _bwd_twin(case, "stable", segs=None)
        wrong["kv segments one key off"] = _bwd_twin(case, "stable", segs=_shifted_segments(case, BWD_CASES))
    elif window:
        wrong["window + 1"] = _bwd_twin(case, "stable", window=window + 1)
        wrong["window - 1"] = _bwd_twin(case, "stable", window=window - 1)
    else:
        wrong["non-causal"] = _bwd_twin(case, "stable", causal=False)
        wrong["window T - 1"] = _bwd_twin(case, "stable", window=BWD_CASES[case][3] - 1)
    for what, grads_wrong in wrong.items():
        for name, x, x_wrong, bound in zip(("dq", "dk", "dv"), grads, grads_wrong, bounds, strict=True):
            assert (np.abs(x - x_wrong) > bound).any(), f"{what} {name}"


@pytest.mark.parametrize("bk, window", [(64, 70), (128, 20)])
def test_backward_visits_only_the_blocks_in_range(bk, window, monkeypatch):
    """Both backward kernels build each step's mask with block_mask; a wrapper records (query block, key block) from
    inside the interpreted kernels. The dQ kernel (64-row query blocks, bk-row key steps) visits exactly the key
    blocks with a visible pair of each query block of each head; the dK/dV kernel (64-row key blocks, bk-row query
    steps) exactly the query blocks with a visible pair of each key block, once per query head of its kv head:
    O(T·w) blocks with a window."""
    visits = {False: [], True: []}  # keys_first: the dK/dV kernel's [bk, bq] tiles
    real = mgb.block_mask

    def counting(q_start, k_start, shape, causal, window, interpret, keys_first=False):
        rows_q, rows_k = shape[::-1] if keys_first else shape

        def record(i, j):
            visits[keys_first].append((int(i), int(j)))

        jax.debug.callback(record, q_start // rows_q, k_start // rows_k)
        return real(q_start, k_start, shape, causal, window, interpret, keys_first=keys_first)

    monkeypatch.setattr(mgb, "block_mask", counting)
    t, h, hkv = 256, 2, 1
    q = jnp.ones((1, h, t, 64), jnp.bfloat16)
    rows = jnp.zeros((1, h, t), jnp.float32)
    options = FlashOptions(causal=True, scale=1.0, window=window, block_k=bk, interpret=True)
    run = jax.jit(functools.partial(mg.backward, options=options), compiler_options=UNOPTIMIZED)
    jax.block_until_ready(run(q, q[:, :hkv], q[:, :hkv], None, None, rows, q, rows))
    jax.effects_barrier()
    assert sorted(visits[False]) == sorted(_visible_blocks(t, mg.BLOCK_Q, bk, True, window) * h)  # dQ
    assert sorted(visits[True]) == sorted(_visible_blocks(t, bk, mg.BLOCK_Q, True, window) * h)  # dK/dV
    assert len(visits[True]) < h * len(_visible_blocks(t, bk, mg.BLOCK_Q, True, 0))  # the window leaves blocks out


def test_backward_rejects_what_it_does_not_support():
    q = jnp.zeros((1, 2, 128, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 1, 128, 64), jnp.bfloat16)
    rows = jnp.zeros((1, 2, 128), jnp.float32)
    kw = dict(causal=True, scale=0.125, interpret=True)
    opts = lambda **changes: FlashOptions(**{**kw, **changes})
    seg = jnp.zeros((1, 128), jnp.int32)
    with pytest.raises(ValueError, match=r"^pass both segment ids q_seg and kv_seg, or neither"):
        mg.backward(q, kv, kv, None, seg, rows, q, rows, options=opts())
    with pytest.raises(ValueError, match=r"^need segment ids q_seg \(1, 128\) and kv_seg \(1, 128\) int32"):
        mg.backward(q, kv, kv, seg, seg[:, :64], rows, q, rows, options=opts())
    with pytest.raises(ValueError, match=r"^need do like q \(1, 2, 128, 64\) bfloat16"):
        mg.backward(q, kv, kv, None, None, rows, q.astype(jnp.float16), rows, options=opts())  # bf16 -> f16
    with pytest.raises(ValueError, match=r"^lse and delta must be float32, got bfloat16"):
        mg.backward(q, kv, kv, None, None, rows.astype(jnp.bfloat16), q, rows, options=opts())  # f32 -> bf16
    with pytest.raises(ValueError, match=r"^head dim D=256 is not supported by the Mosaic GPU backward"):
        q256, kv256 = jnp.zeros((1, 2, 128, 256), jnp.bfloat16), jnp.zeros((1, 1, 128, 256), jnp.bfloat16)
        mg.backward(q256, kv256, kv256, None, None, rows, q256, rows, options=opts())
    q128, kv128 = jnp.zeros((1, 2, 128, 128), jnp.bfloat16), jnp.zeros((1, 1, 128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"^D=128 with block_k=128 is not supported .* registers"):
        mg.backward(q128, kv128, kv128, None, None, rows, q128, rows, options=opts(block_k=128))
    with pytest.raises(ValueError, match=r"^need Tq % block_q == 0"):  # Tk = 64 is no multiple of block_k = 128
        mg.backward(q, kv[:, :, :64], kv[:, :, :64], None, None, rows, q, rows, options=opts(causal=False, block_k=128))
    with pytest.raises(ValueError, match=r"^interpret must be True .* got None"):
        mg.backward(q, kv, kv, None, None, rows, q, rows, options=opts(interpret=None))


@pytest.mark.parametrize(
    "d, block_k, window, dtype, segments",
    [
        (D, 64, 0, jnp.bfloat16, False),
        (D, 64, 1024, jnp.bfloat16, False),
        (64, 128, 0, jnp.float16, False),
        (D, 64, 0, jnp.bfloat16, True),
    ],
    ids=["causal", "window", "d64-bk128-f16", "segments"],
)
def test_backward_compiles_for_h100_as_two_mosaic_gpu_kernels_without_spills(
    d, block_k, window, dtype, segments, monkeypatch, tmp_path
):
    """The backward at B=1, H=8, Hkv=2, T=4096 compiled for one H100: two Mosaic GPU custom calls (dQ and dK/dV), no
    Triton call, and ptxas (its report dumped by Mosaic GPU, with the compilation cache off so that ptxas runs)
    spills no register in either kernel: the dK/dV warpgroup holds dk, dv [64, D] f32 and one step's [64, block_k]
    tiles within 255 registers per thread. ~3-5 s per compile on 2 CPU cores."""
    sharding = _h100_sharding()
    q = jax.ShapeDtypeStruct((B, H, T, d), dtype, sharding=sharding)
    kv = jax.ShapeDtypeStruct((B, HKV, T, d), dtype, sharding=sharding)
    rows = jax.ShapeDtypeStruct((B, H, T), jnp.float32, sharding=sharding)
    segs = _segment_structs(T, sharding) if segments else (None, None)
    options = FlashOptions(causal=True, scale=d**-0.5, window=window, block_k=block_k, interpret=False)
    bwd = functools.partial(mg.backward, options=options)
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")  # read by the CUDA plugin at each Mosaic GPU compile
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        text = jax.jit(bwd).lower(q, kv, kv, *segs, rows, q, rows).compile().as_text()
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    assert re.findall(r'custom_call_target="([^"]+)"', text) == ["mosaic_gpu_v2"] * 2
    assert "triton" not in text
    reports = {p.name.split("_mgpu")[0]: p.read_text() for p in tmp_path.glob("*.ptxas")}
    assert sorted(reports) == ["lpt_flash_attention_dkdv", "lpt_flash_attention_dq"]
    for name, report in reports.items():
        assert "0 bytes spill stores, 0 bytes spill loads" in report and "spilled" not in report, (name, report)


@pytest.mark.parametrize("d, block_k, segments", [(64, 64, False), (64, 128, False), (128, 64, False), (128, 64, True)])
def test_backward_shared_memory_per_block_does_not_grow_with_t(d, block_k, segments):
    """Lowered for cuda at T = 4096 and T = 32768: each backward kernel's shared memory per block is the same at both
    and equals dq_smem_bytes / dkdv_smem_bytes (100,400 and 100,384 bytes at D = 128, bk = 64; 102,456 and 102,440
    with segment ids); launches of B × H × T/64 dQ blocks and B × Hkv × T/64 dK/dV blocks of one warpgroup (grid
    axes reversed: x = B)."""
    for t in (4096, 32768):
        q = jax.ShapeDtypeStruct((B, H, t, d), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((B, HKV, t, d), jnp.bfloat16)
        rows = jax.ShapeDtypeStruct((B, H, t), jnp.float32)
        segs = _segment_structs(t) if segments else (None, None)
        options = FlashOptions(causal=True, scale=d**-0.5, block_k=block_k, interpret=False)
        bwd = functools.partial(mg.backward, options=options)
        lowered = jax.jit(bwd).trace(q, kv, kv, *segs, rows, q, rows).lower(lowering_platforms=("cuda",))
        dq, dkdv = _launches(lowered)
        assert dq == (B, H, t // 64, 128, 1, 1, mg.dq_smem_bytes(d, 2, block_k, segments=segments))
        assert dkdv == (B, HKV, t // 64, 128, 1, 1, mg.dkdv_smem_bytes(d, 2, block_k, segments=segments))
    assert (mg.dq_smem_bytes(128, 2, 64), mg.dkdv_smem_bytes(128, 2, 64)) == (100400, 100384)
    assert (mg.dq_smem_bytes(128, 2, 64, segments=True), mg.dkdv_smem_bytes(128, 2, 64, segments=True)) == (
        102456,
        102440,
    )


def test_padding_gets_zero_output_and_gradients():
    """With segment ids as lpt.attention pads (queries −2, keys −1, :func:`_segment_ids`): the padded queries get
    O = 0, lse = −inf and dq = 0, the padded keys dk = dv = 0, exactly, while the packed tokens' are not zero."""
    case, pad = "packed-padded-gqa-d64", 230
    o, lse = _kernel(case, POLICIES["stable"])
    dq, dk, dv = _bwd_kernel(case, "stable")
    assert (o[:, :, pad:] == 0).all() and (lse[:, :, pad:] == -np.inf).all() and (dq[:, :, pad:] == 0).all()
    assert (dk[:, :, pad:] == 0).all() and (dv[:, :, pad:] == 0).all()
    assert all(np.abs(x[:, :, :pad]).min(axis=-1).max() > 0 for x in (o, dq, dk, dv))
