"""The precision recipe: storage vs view dtypes, straight-through casts, fp8 matmul switch, attention switches, PQT."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from float_bounds import assert_within, transformer_logits_sigma
from numpy_models import numpy_init

import lpt.models as M
from lpt.models import layers
from lpt.models.attention_block import attend
from lpt.options import build

CFG = dict(kind="llama", vocab_size=256, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16)
TOKENS = np.array([[1, 50, 99, 200, 3, 7, 11, 13]], np.int32)


def _forward(cfg, prec, seed=0):
    model = M.build_model(cfg, prec, rngs=nnx.Rngs(seed))
    g, st = nnx.split(model)
    return np.asarray(jax.jit(lambda s, t: nnx.merge(g, s)(t))(st, TOKENS)), st


def _forward_and_grad(cfg, prec, seed=0):
    """Logits and d(sum of logits · fixed weights)/d(params), jitted together."""
    model = M.build_model(cfg, prec, rngs=nnx.Rngs(seed))
    g, st = nnx.split(model)
    w = jnp.asarray(np.random.RandomState(0).randn(1, 8, 256), jnp.float32)

    def f(s):
        logits = nnx.merge(g, s)(TOKENS)
        return jnp.sum(logits * w), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(st)
    return np.asarray(logits), st, grads


def test_bf16_storage_equals_f32_master_viewed_in_bf16():
    """Storing bf16 (kahan) and storing f32 viewed through bf16 (f32_master) compute the same f32 function of the same
    bf16 weights, in two XLA programs (whose f32 sums XLA:CPU may order and contract differently per program and
    ISA): the logits agree within 12σ of tests/float_bounds.py's rounding error model and, through the
    straight-through view, the gradients up to the bf16 rounding of the stored-bf16 gradient; the view rounding is
    real: an f32-viewed model differs by more than that."""
    view, st_view, g_view = _forward_and_grad(CFG, {"param_dtype": "bfloat16", "update_rule": "f32_master"})
    stored, st_stored, g_stored = _forward_and_grad(CFG, {"param_dtype": "bfloat16", "update_rule": "nearest"})
    plain, _ = _forward(CFG, {"param_dtype": "float32"})
    assert {x.dtype for x in jax.tree.leaves(st_stored)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(st_view)} == {jnp.dtype(jnp.float32)}
    model = M.build_model(CFG, {"param_dtype": "bfloat16", "update_rule": "nearest"}, rngs=nnx.Rngs(0))
    _, sigma = transformer_logits_sigma(model, TOKENS)
    assert_within(view, stored, 12 * sigma, "logits")
    assert np.abs(view - plain).max() > 1e-5 and np.any(np.abs(view - plain) > 12 * sigma)  # bf16 weights show
    for gv, gs in zip(jax.tree.leaves(g_view), jax.tree.leaves(g_stored), strict=True):
        assert gv.dtype == jnp.float32 and gs.dtype == jnp.bfloat16
        # gs rounds its program's f32 gradient to bf16 (<= 2^-8 relative); the two programs' f32 gradients differ
        # in their sums' order: allowed 2^-15·max|g| (512·2^-24 of the leaf's largest gradient; measured: 5·2^-24
        # between this program's AVX2 and SSE4.2 code)
        g = np.abs(np.asarray(gv, np.float64))
        assert_within(gs, gv, 2.0**-8 * g + 2.0**-15 * g.max(), "gradient")
    assert float(jnp.abs(g_view["blocks"][0]["attn"]["q"]["kernel"][...]).max()) > 0  # gradients reach the master


def test_fp8_storage_dtypes_and_saturation_diagnostics():
    prec = {"param_dtype": "float8_e4m3fn", "update_rule": "nearest", "compute_dtype": "bfloat16"}
    model = M.build_model(CFG, prec, rngs=nnx.Rngs(0))
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.float8_e4m3fn)}
    g, st = nnx.split(model)
    diag = jax.jit(lambda s: M.diagnostics(nnx.merge(g, s)))(st)
    # N(0, 0.02²) weights in e4m3 round to 0 iff |w| <= 2^-10 (half the smallest subnormal, ties to even):
    # P(|z| <= 2^-10 / 0.02) = erf(0.04883 / sqrt 2) = 0.0389 over ~14k matmul weights (std. error 0.002)
    assert abs(float(diag["params/fp8_zero_frac"]) - 0.0389) < 0.008
    assert float(diag["params/fp8_saturated_frac"]) == 0.0


def test_round_ste_is_rne_with_identity_gradient_under_jit():
    x = jnp.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -3.14159, 1e-3], jnp.float32)
    f = jax.jit(lambda x: layers.round_ste(x, jnp.bfloat16))
    y = f(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x.astype(jnp.bfloat16), np.float32))
    assert float(y[0]) == 1.0 and float(y[1]) == 1.0 + 2.0**-6  # ties to even: down, then up
    g = jax.jit(jax.grad(lambda x: jnp.sum(layers.round_ste(x, jnp.bfloat16).astype(jnp.float32) * x)))(x)
    # d/dx [r(x)·x] with straight-through r: x + r(x), where the cotangent x reaching r's bf16 output is itself
    # rounded to bf16 by the transpose of the bf16 -> f32 cast
    expect = np.asarray(y.astype(jnp.float32)) * 2  # r(x) + bf16(x) = 2 r(x)
    np.testing.assert_array_equal(np.asarray(g), expect)


def test_fp8_matmul_switch_uses_blockwise_fp8():
    prec_fp8 = build(M.Precision, {"matmul": {"up": "fp8"}})
    prec_bf16 = build(M.Precision, {})
    rngs = nnx.Rngs(0)
    lin = layers.Linear(128, 128, axes=("embed", "mlp"), projection="up", std=0.05, prec=prec_fp8, path="t", rngs=rngs)
    x = jax.random.normal(jax.random.key(1), (4, 128), jnp.float32)
    g, st = nnx.split(lin)
    y = np.asarray(jax.jit(lambda s, x: nnx.merge(g, s)(x))(st, x))
    ref = np.asarray(x) @ np.asarray(lin.kernel[...])
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert 1e-3 < rel < 0.1  # e4m3 operands: a few percent, not bf16's 0.4% and not f32's 1e-7
    assert prec_bf16.matmul_for("up") == "bf16" and prec_fp8.matmul_for("down") == "bf16"


def test_attention_switches_reach_lpt_attention(monkeypatch):
    import lpt.attention

    seen = {}

    def spy(q, k, v, **kw):
        seen.update(kw)
        return q

    monkeypatch.setattr(lpt.attention, "dot_product_attention", spy)
    prec = build(M.Precision, {"attention": {"impl": "pallas", "stable": False, "beta": 2.0}})
    q = jnp.ones((1, 4, 2, 8), jnp.float32)
    attend(q, q[:, :, :1], q[:, :, :1], prec, sliding_window=3)
    assert seen == {"causal": True, "stable": False, "beta": 2.0, "impl": "pallas", "sliding_window": 3}


PQT = {"compute_dtype": "bfloat16", "pqt": {"method": "gaussws", "layers": ("out", "down"), "loss_weight": 0.1}}


def test_pqt_linear_noise_only_with_a_key():
    prec = build(M.Precision, PQT)
    lin = layers.Linear(
        64, 32, axes=("mlp", "embed"), projection="down", std=0.05, prec=prec, path="t", rngs=nnx.Rngs(0)
    )
    x = jax.random.normal(jax.random.key(1), (4, 64), jnp.float32).astype(jnp.bfloat16)
    g, st = nnx.split(lin)
    f = jax.jit(lambda s, x, k: nnx.merge(g, s)(x, key=k))
    k1, k2 = jax.random.key(1), jax.random.key(2)
    a, a2, b = np.asarray(f(st, x, k1), np.float32), np.asarray(f(st, x, k1), np.float32), np.asarray(f(st, x, k2))
    e = np.asarray(jax.jit(lambda s, x: nnx.merge(g, s)(x))(st, x), np.float32)
    ref = np.asarray(x, np.float32) @ np.asarray(lin.kernel[...].astype(jnp.bfloat16), np.float32)
    np.testing.assert_allclose(e, ref, rtol=2e-2, atol=2e-3)  # eval: the plain bf16 matmul
    np.testing.assert_array_equal(a, a2)  # R is a function of the key
    assert np.abs(a - b.astype(np.float32)).max() > 1e-3 and np.abs(a - e).max() > 1e-3
    # noise scale: max|w| per 32x32 tile · 2^(1-6) · R, R in {0, ±1, ±2} -> |ŵ - w| <= 2 · max|w| / 32
    grad_b = jax.jit(jax.grad(lambda s: jnp.sum(nnx.merge(g, s)(x, key=k1).astype(jnp.float32))))(st)
    assert float(jnp.abs(grad_b["bitwidth"][...]).sum()) > 0  # b_t is learnable through Eq. 4


def test_pqt_model_key_changes_logits_and_bitwidth_loss():
    model = numpy_init(CFG, PQT, seed=0)  # build_model's init recipe, drawn by numpy: bitwidths 6 and f32 weights
    g, st = nnx.split(model)
    f = jax.jit(lambda s, t, k: nnx.merge(g, s)(t, key=k))
    a, b = np.asarray(f(st, TOKENS, jax.random.key(1))), np.asarray(f(st, TOKENS, jax.random.key(2)))
    assert np.abs(a - b).max() > 1e-3
    aux, diag = jax.jit(lambda s: (nnx.merge(g, s).aux_loss(), M.diagnostics(nnx.merge(g, s))))(st)
    # Eq. 12 at init: λ · Σ_layers |6 − 4| over 1 block × (out, down) = 0.1 · 2 · 2
    assert float(aux) == pytest.approx(0.4, rel=1e-6)
    assert float(diag["pqt/bt_mean/out"]) == 6.0 and float(diag["pqt/all/frac_le9"]) == 1.0
    assert "pqt/bt_mean/qkv" not in diag
    kinds = {p[-2] for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)) if p[-1] == "bitwidth"}
    assert kinds == {"o", "down"}
