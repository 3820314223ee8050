"""f32 agreement of every numerics policy with plain softmax attention (forward and gradients), masks, GQA,
fully masked rows and extreme logits, input validation, and the trainer's bf16 call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED
from float_bounds import assert_within, attention_f32_bound

from lpt.attention import (
    AttentionPolicy,
    delta_error,
    dot_product_attention,
    repeated_max_fraction,
    residual_output,
)

B, T, H, HKV, D = 2, 40, 4, 2, 16


def _inputs(dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, HKV, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, HKV, D), jnp.float32) - 0.5
    k = k.at[:, 7].set(k[:, 3]).at[:, 20].set(k[:, 3])  # exact repeats of a logit in every row that sees them
    q = q.at[:, :, :, 0].add(2.0)
    k = k.at[:, 3, :, 0].set(4.0).at[:, 7, :, 0].set(4.0).at[:, 20, :, 0].set(4.0)  # ... and make them the max
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


# Covers every value of every policy field (f32 inputs: the P̃V dtype and the accumulator are f32 as well).
POLICIES = [
    AttentionPolicy(shift="max", denominator="f32", accumulator="f32", residual="input"),
    AttentionPolicy(shift="beta", denominator="rounded", accumulator="f32", residual="f32"),
    AttentionPolicy(shift="beta", beta=2.0, denominator="f32", accumulator="pv", residual="stochastic"),
    AttentionPolicy(shift="max", denominator="rounded", accumulator="pv", residual="f32", tie_tol=0.0),
    AttentionPolicy(shift="beta", beta=7.0, max_offset=1.0, denominator="rounded", residual="input"),
]
MASKS = {
    "causal_padded": dict(causal=True, kv_mask=jnp.arange(T)[None, :] >= jnp.array([[0], [3]])),
    "segments": dict(causal=True, segment_ids=jnp.repeat(jnp.array([[0, 1, 2, 3], [5, 5, 6, 6]]), 10, axis=1)),
    "full_padded": dict(causal=False, kv_mask=jnp.arange(T)[None, :] < jnp.array([[33], [T]])),
}
CASE_MASKS = ["causal_padded", "segments", "full_padded", "causal_padded", "segments"]
CASES = list(zip(POLICIES, CASE_MASKS, strict=True))


def _out_and_grads(fn, q, k, v, w):
    """(O, (dq, dk, dv)) of sum(O * w), one compile (LLVM's optimizations off: the checks are error bounds)."""

    def both(q, k, v):
        o, vjp = jax.vjp(fn, q, k, v)
        return o, vjp(w.astype(o.dtype))

    return jax.jit(both).lower(q, k, v).compile(UNOPTIMIZED)(q, k, v)


_TRUTH = {}


def _truth(mask, q, k, v, w):
    if mask not in _TRUTH:
        f = lambda q, k, v: dot_product_attention(q, k, v, impl="softmax", **MASKS[mask])
        _TRUTH[mask] = _out_and_grads(f, q, k, v, w)
    return _TRUTH[mask]


@pytest.mark.parametrize(
    "policy, mask", CASES, ids=[f"{p.shift}-{p.denominator}-{p.accumulator}-{p.residual}-{m}" for p, m in CASES]
)
def test_f32_policy_matches_softmax(policy, mask):
    q, k, v = _inputs()
    w = jax.random.normal(jax.random.PRNGKey(9), (B, T, H, D))
    kw = dict(MASKS[mask], block_q=16, block_k=16)
    flash = lambda q, k, v: dot_product_attention(q, k, v, policy=policy, key=jax.random.PRNGKey(1), **kw)
    o, grads = _out_and_grads(flash, q, k, v, w)
    o_t, grads_t = _truth(mask, q, k, v, w)
    # two f32 programs (blockwise with the policy's shift, plain softmax): first-order bound of tests/float_bounds.py
    offset = policy.max_offset if policy.shift == "beta" else 0.0
    assert_within(o, o_t, attention_f32_bound(q, k, v, **MASKS[mask], max_offset=offset), "O")
    for g, g_t in zip(grads, grads_t, strict=True):
        np.testing.assert_allclose(g, g_t, atol=2e-5 * float(jnp.max(jnp.abs(g_t))), rtol=0)
    assert float(jnp.max(jnp.abs(grads_t[1]))) > 0.1  # gradients are not trivially zero


def test_repeats_diagnostic_and_default_residual_closer_to_truth():
    """Causal GQA bf16 with repeated maxima in 35% of rows: the O kept for δ is far closer to f32 attention with
    the default policy (f32 residual; only the bf16 P̃ weights err) than with the standard kernel (bf16 O)."""
    q, k, v = _inputs(jnp.bfloat16)
    frac = float(jax.jit(repeated_max_fraction)(q, k))
    one_head = lambda h: repeated_max_fraction(q[:, :, h : h + 1], k[:, :, h // (H // HKV)][:, :, None])
    per_head = [float(one_head(h)) for h in range(H)]
    # a fraction over all query heads' rows (measured 0.347; it was H = 4 times that before heads were counted)
    assert 0.3 < frac < 0.4 and abs(frac - np.mean(per_head)) < 1e-6
    truth = dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), impl="softmax")
    rms = {}
    for stable in (False, True):
        res = jax.jit(lambda q, k, v, s=stable: residual_output(q, k, v, stable=s, block_k=16))(q, k, v)
        rms[stable] = float(jnp.sqrt(jnp.mean((res - truth) ** 2)))
    assert rms[True] < 0.5 * rms[False], rms  # measured 3.8e-4 vs 1.2e-3


@pytest.mark.parametrize("policy", POLICIES[:3], ids=["standard", "default", "beta2-pv-stochastic"])
def test_fully_masked_rows_and_extreme_logits_are_finite(policy):
    q, k, v = _inputs(jnp.bfloat16)
    kv_mask = jnp.arange(T)[None, :] >= jnp.array([[0], [5]])  # batch 1: queries 0..4 see no key at all
    w = jnp.ones((B, T, H, D), jnp.float32)

    def run(q, k, v, mult):
        qs = (q.astype(jnp.float32) * mult).astype(jnp.bfloat16)  # f32 -> bf16: logits up to ~|mult| * 40
        f = lambda k, v: dot_product_attention(qs, k, v, policy=policy, kv_mask=kv_mask, key=jax.random.PRNGKey(0))
        o, vjp = jax.vjp(f, k, v)
        return o, vjp(w.astype(o.dtype))

    run = jax.jit(run).lower(q, k, v, jnp.float32(1.0)).compile(UNOPTIMIZED)  # the checks hold under any compile
    vmax = float(jnp.max(v.astype(jnp.float32)))
    for mult in (1e4, -1e4, 1e-30):
        out, grads = run(q, k, v, jnp.float32(mult))
        out = out.astype(jnp.float32)
        assert bool(jnp.all(jnp.isfinite(out))), mult
        assert all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in grads), mult
        np.testing.assert_array_equal(out[1, :5], 0.0)  # rows without keys give 0
        assert float(jnp.max(out)) <= vmax + 1e-2  # a convex combination of visible V rows


def test_bf16_trainer_call_close_to_truth():
    q, k, v = _inputs(jnp.bfloat16)
    for stable in (True, False):
        f = jax.jit(
            lambda q, k, v, s=stable: dot_product_attention(q, k, v, causal=True, stable=s, beta=7.0, impl="xla")
        )
        o = f(q, k, v)
        assert o.dtype == jnp.bfloat16 and o.shape == (B, T, H, D)
        o_t = dot_product_attention(q, k, v, impl="softmax").astype(jnp.float32)
        assert float(jnp.max(jnp.abs(o.astype(jnp.float32) - o_t))) < 0.05


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(impl="cuda"), "impl"),
        (dict(causal=True, k_len=T - 8), "Tq == Tk"),
        (dict(hkv=3), "multiple of kv heads"),
        (dict(policy=AttentionPolicy(residual="stochastic")), "key"),
        (dict(kv_mask=jnp.ones((B, T), jnp.int32)), "kv_mask"),
    ],
)
def test_bad_input_raises(kwargs, match):
    q, k, v = _inputs()
    kwargs = dict(kwargs)
    if "k_len" in kwargs:
        n = kwargs.pop("k_len")
        k, v = k[:, :n], v[:, :n]
    if "hkv" in kwargs:
        n = kwargs.pop("hkv")
        k, v = jnp.concatenate([k, k[:, :, :1]], 2)[:, :, :n], jnp.concatenate([v, v[:, :, :1]], 2)[:, :, :n]
    with pytest.raises(ValueError, match=match):
        dot_product_attention(q, k, v, **kwargs)


def test_bad_policy_raises():
    with pytest.raises(ValueError, match="shift"):
        AttentionPolicy(shift="min")
    with pytest.raises(ValueError, match="beta"):
        AttentionPolicy(beta=1.0)


def test_delta_error_diagnostic():
    """δ_policy − δ_f32 per row: the default's f32 residual makes it several times smaller than the standard's."""
    q, k, v = _inputs(jnp.bfloat16)
    do = -0.5 + 0.5 * jax.random.normal(jax.random.PRNGKey(5), (B, T, H, D))
    errs = {s: jax.jit(lambda q, k, v, s=s: delta_error(q, k, v, do, stable=s))(q, k, v) for s in (False, True)}
    assert errs[True].shape == (B, T, H)
    rms = {s: float(jnp.sqrt(jnp.mean(e**2))) for s, e in errs.items()}
    assert 0 < rms[True] < 0.5 * rms[False], rms
