"""The transformer against a straightforward numpy reference, GQA == repeated heads, causality, axes, errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED
from flax import nnx
from float_bounds import assert_within, attention_f32_bound, transformer_logits_sigma
from numpy_models import numpy_init

import lpt.models as M
from lpt.models.attention_block import attend
from lpt.sharding import LOGICAL_AXES

LLAMA = dict(kind="llama", vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=16)
GPT2 = dict(kind="gpt2", vocab_size=256, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=16)
QWEN2 = {**LLAMA, "qkv_bias": True}
QWEN3 = {**LLAMA, "qk_norm": True, "head_dim": 24}  # heads 24 wide: H * head_dim = 96 != d_model
TOKENS = np.array([[3, 17, 200, 5, 9, 9, 1, 0], [255, 4, 8, 15, 16, 23, 42, 7]], np.int32)


def _jit_forward(model):
    """The forward on TOKENS-shaped batches as one executable, compiled with LLVM's optimizations off: its checks
    hold under any compile (bounds far above f32 round-off, runs of this one executable compared with each other)."""
    graphdef, state = nnx.split(model)
    f = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t)).lower(state, TOKENS).compile(UNOPTIMIZED)
    return f, state


def _np(p):
    return np.asarray(p[...], np.float64)


def _ref_forward(model, cfg, tokens):
    """float64 numpy transformer written from the equations (no code shared with lpt.models)."""
    D, H, K = cfg["d_model"], cfg["n_heads"], cfg.get("n_kv_heads", cfg["n_heads"])
    Dh = D // H
    B, T = tokens.shape
    gpt2 = cfg["kind"] == "gpt2"
    eps = 1e-5

    def norm(x, n):
        if gpt2:
            mu = x.mean(-1, keepdims=True)
            var = ((x - mu) ** 2).mean(-1, keepdims=True)
            return (x - mu) / np.sqrt(var + eps) * _np(n.scale) + _np(n.bias)
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * _np(n.scale)

    def lin(x, layer):
        y = x @ _np(layer.kernel)
        return y + _np(layer.bias) if layer.bias is not None else y

    def rope(x):  # x[B, T, h, Dh]
        i = np.arange(Dh // 2)
        ang = np.arange(T)[:, None] * 10000.0 ** (-2.0 * i / Dh)
        c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
        a, b = x[..., : Dh // 2], x[..., Dh // 2 :]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    x = _np(model.embed.embedding)[tokens]
    if gpt2:
        x = x + _np(model.pos_embed.embedding)[:T]
    for blk in model.blocks:
        h = norm(x, blk.norm1)
        q = lin(h, blk.attn.q).reshape(B, T, H, Dh)
        k = lin(h, blk.attn.k).reshape(B, T, K, Dh)
        v = lin(h, blk.attn.v).reshape(B, T, K, Dh)
        if not gpt2:
            q, k = rope(q), rope(k)
        o = np.zeros((B, T, H, Dh))
        for hh in range(H):
            kk = hh // (H // K)
            s = np.einsum("btd,bsd->bts", q[:, :, hh], k[:, :, kk]) / math.sqrt(Dh)
            s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            o[:, :, hh] = np.einsum("bts,bsd->btd", p, v[:, :, kk])
        x = x + lin(o.reshape(B, T, D), blk.attn.o)
        h = norm(x, blk.norm2)
        if gpt2:
            u = lin(h, blk.mlp.up)
            a = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
        else:
            g = lin(h, blk.mlp.gate)
            a = g / (1 + np.exp(-g)) * lin(h, blk.mlp.up)
        x = x + lin(a, blk.mlp.down)
    x = norm(x, model.final_norm)
    w = _np(model.lm_head.kernel) if model.lm_head is not None else _np(model.embed.embedding).T
    return x @ w


GPT2_TIED = {**GPT2, "tie_embeddings": True}


def _built(cfg):
    model = numpy_init(cfg, {})
    f, state = _jit_forward(model)
    return cfg, model, f, state


@pytest.fixture(scope="module")
def llama_built():
    return _built(LLAMA)


@pytest.fixture(scope="module")
def gpt2_tied_built():
    return _built(GPT2_TIED)


@pytest.fixture(params=["llama", "gpt2_tied"])
def built(request):
    """(cfg, model, jitted forward, state), built once per module for each architecture."""
    return request.getfixturevalue(f"{request.param}_built")


def test_f32_forward_matches_numpy_reference(built):
    cfg, model, f, state = built
    got = np.asarray(f(state, TOKENS))
    assert got.dtype == np.float32 and got.shape == (2, 8, 256)
    ref = _ref_forward(model, cfg, TOKENS)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5 * np.abs(ref).max())
    assert np.abs(ref).max() > 0.05  # the check is not trivially about zeros


def test_future_tokens_do_not_change_past_logits(built):
    _, _, f, state = built
    other = TOKENS.copy()
    other[:, 5:] = (other[:, 5:] + 101) % 256
    a, b = np.asarray(f(state, TOKENS)), np.asarray(f(state, other))
    np.testing.assert_array_equal(a[:, :5], b[:, :5])
    assert np.abs(a[:, 5:] - b[:, 5:]).max() > 1e-3


def test_gqa_equals_repeated_kv_heads():
    """Attention with K kv heads equals multi-head attention whose k/v repeat each kv head H/K times (jitted)."""
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    B, T, H, K, Dh = 2, 8, 6, 2, 8
    q = jax.random.normal(kq, (B, T, H, Dh), jnp.float32)
    k = jax.random.normal(kk, (B, T, K, Dh), jnp.float32)
    v = jax.random.normal(kv, (B, T, K, Dh), jnp.float32)
    prec = M.Precision()
    f = jax.jit(lambda q, k, v: attend(q, k, v, prec))
    gqa = np.asarray(f(q, k, v))
    mha = np.asarray(f(q, jnp.repeat(k, H // K, axis=2), jnp.repeat(v, H // K, axis=2)))
    # two XLA programs of the same f32 attention (β shift, offset <= 64): first-order bound of tests/float_bounds.py
    assert_within(gqa, mha, attention_f32_bound(q, k, v, causal=True), "attention")
    # tiling instead of repeating pairs the heads wrongly: the test can tell the two apart
    wrong = np.asarray(f(q, jnp.tile(k, (1, 1, H // K, 1)), jnp.tile(v, (1, 1, H // K, 1))))
    assert np.abs(gqa - wrong).max() > 0.1


def test_llama_options_under_every_attention_impl():
    """q, k, v biases, q / k norms and heads 24 wide (H · head_dim = 96 != d_model = 32) run under the softmax, XLA
    and Pallas attention (interpreted on CPU): the same f32 logits and finite gradients, which reach the biases and
    the norm scales."""
    cfg = {**QWEN3, "qkv_bias": True, "init_std": 0.3}
    logits = {}
    for impl in ("softmax", "xla", "pallas"):
        model = numpy_init(cfg, {"attention": {"impl": impl}}, seed=0)
        state = nnx.state(model, nnx.Param)  # biases and norm scales away from their 0 / 1 init
        nnx.update(model, jax.tree.map(lambda x: x + 0.1 * jnp.cos(jnp.arange(x.size) * 0.7).reshape(x.shape), state))

        def loss(m):
            out = m(TOKENS)
            return jnp.mean(jnp.square(out)), out

        grads, out = nnx.jit(nnx.grad(loss, has_aux=True))(model)  # one program: the logits and their gradients
        logits[impl], grads = np.asarray(out), nnx.to_pure_dict(grads)
        assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
        attn = grads["blocks"][1]["attn"]
        assert attn["q_norm"]["scale"].shape == (24,) and attn["k"]["bias"].shape == (2 * 24,)
        assert min(np.abs(attn[n][p]).max() for n, p in (("q_norm", "scale"), ("k_norm", "scale"), ("v", "bias"))) > 0
    assert np.abs(logits["softmax"]).max() > 1.0
    for impl in ("xla", "pallas"):
        np.testing.assert_allclose(logits[impl], logits["softmax"], atol=1e-4, rtol=0)


def test_every_param_has_logical_axes_matching_its_rank():
    for cfg in (LLAMA, GPT2, QWEN2, QWEN3):
        model = nnx.eval_shape(lambda c=cfg: M.build_model(c, {}, rngs=nnx.Rngs(0)))
        params = nnx.state(model, nnx.Param)
        leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        assert len(leaves) > 10
        allowed = set(LOGICAL_AXES) | {None}
        for v in leaves:
            axes = M.partitioning.logical_axes_of(v)
            assert axes is not None and len(axes) == len(v.shape), v
            assert set(axes) <= allowed


def test_param_count_matches_built_model():
    for cfg in (LLAMA, GPT2, {**LLAMA, "tie_embeddings": True}, QWEN2, QWEN3, {**QWEN3, "scan_layers": True}):
        model = nnx.eval_shape(lambda c=cfg: M.build_model(c, {}, rngs=nnx.Rngs(0)))
        n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert M.param_count(cfg) == n


def test_flops_per_token_formula():
    cfg = dict(kind="llama", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=32)
    n = 2 * (64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 96) + 64 * 256
    assert M.matmul_params(cfg) == n
    assert M.flops_per_token(cfg, 32) == 6 * n + 12 * 2 * 4 * 16 * 32
    wide = {**cfg, "head_dim": 24}  # the attention projections and QKᵀ, PV follow the heads' width
    n = 2 * (64 * 24 * (2 * 4 + 2 * 2) + 3 * 64 * 96) + 64 * 256
    assert M.matmul_params(wide) == n
    assert M.flops_per_token(wide, 32) == 6 * n + 12 * 2 * 4 * 24 * 32


def test_bad_configs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['model.d_modle'\]; did you mean 'model.d_model'"):
        M.build_model({**LLAMA, "d_modle": 3}, {}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="kind='bert'.*allowed"):
        M.build_model({**LLAMA, "kind": "bert"}, {}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="n_heads=4 is not divisible by n_kv_heads=3"):
        M.build_model({**LLAMA, "n_kv_heads": 3}, {}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"d_model=32 is not divisible by n_heads=3 \(or set model.head_dim\)$"):
        M.build_model({**LLAMA, "n_heads": 3, "n_kv_heads": 3}, {}, rngs=nnx.Rngs(0))
    fine = {**LLAMA, "n_heads": 3, "n_kv_heads": 3, "head_dim": 8}
    nnx.eval_shape(lambda: M.build_model(fine, {}, rngs=nnx.Rngs(0)))  # fine with it
    with pytest.raises(ValueError, match="RoPE needs an even head_dim, got 7"):
        M.build_model({**LLAMA, "head_dim": 7}, {}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"model.head_dim=-8 must be >= 0 \(0 = d_model / n_heads\)"):
        M.build_model({**LLAMA, "head_dim": -8}, {}, rngs=nnx.Rngs(0))
    for key, value in (("qkv_bias", True), ("qk_norm", True), ("head_dim", 8)):
        with pytest.raises(ValueError, match=rf"model.{key}={value!r} is a llama option; gpt2 allows"):
            M.build_model({**GPT2, key: value}, {}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="param_dtype='int8'"):
        M.build_model(LLAMA, {"param_dtype": "int8"}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"matmul.qkv='int4'"):
        M.build_model(LLAMA, {"matmul": {"qkv": "int4"}}, rngs=nnx.Rngs(0))
    model = numpy_init(LLAMA, {})
    with pytest.raises(ValueError, match="exceeds config.model.max_seq_len=16"):
        model(jnp.zeros((1, 17), jnp.int32))


def _reference_forward(model, tokens, key):
    """The training forward spelled out per layout: a Python loop over the blocks with the step key (each layer folds
    in its own path), or ``nnx.scan`` over the stacked block with ``fold_in(key, i)``; ``nnx.remat`` per layer."""
    spec = model.spec
    x = model.embed(tokens)
    if model.pos_embed is not None:
        x = x + model.pos_embed(jnp.arange(tokens.shape[1]))[None]
    x = M.transformer.constrain(x, ("batch", "length", "embed"))
    if spec.scan_layers:

        def body(x, block, i):
            return block(x, key=jax.random.fold_in(key, i))

        body = nnx.remat(body) if spec.remat else body
        meta = {nnx.PARTITION_NAME: "layers", "kernel_shape": spec.n_layers}
        scan = nnx.scan(body, in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry, transform_metadata=meta)
        x = scan(x, model.blocks, jnp.arange(spec.n_layers, dtype=jnp.int32))
    else:
        for block in model.blocks:
            x = nnx.remat(lambda b, x, k: b(x, key=k))(block, x, key) if spec.remat else block(x, key=key)
    return model._logits(model.final_norm(x), key)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("remat", [False, True])
def test_the_block_runner_traces_the_reference_training_forward(scan, remat):
    """Model.__call__ runs its blocks through one runner (lpt.models.transformer.run_blocks); the gradient of its
    training forward (GaussWS weight noise, so the per-layer keys matter) is the same jaxpr, equation for equation,
    as the layout written out directly, and remat puts one checkpoint around each layer (n_layers unrolled, one
    inside the scan)."""
    cfg = {**LLAMA, "scan_layers": scan, "remat": remat}
    prec = {"pqt": {"method": "gaussws", "layers": ("qkv", "up", "down")}}
    g, st = nnx.split(nnx.eval_shape(lambda: M.build_model(cfg, prec, rngs=nnx.Rngs(0))))
    key = jax.random.key(3)
    got = str(jax.make_jaxpr(jax.grad(lambda s: nnx.merge(g, s)(TOKENS, key=key).sum()))(st))
    want = str(jax.make_jaxpr(jax.grad(lambda s: _reference_forward(nnx.merge(g, s), TOKENS, key).sum()))(st))
    assert got == want
    assert got.count("remat2[") == (0 if not remat else 1 if scan else LLAMA["n_layers"])  # jax.checkpoint's primitive


def test_scanned_layers_equal_the_unrolled_model(llama_built):
    """scan_layers=True stacks each block parameter on a leading "layers" axis; with the unrolled model's weights
    stacked in, the f32 logits are those of the unrolled model. The two are different XLA programs (a loop body and
    unrolled layers) whose f32 sums XLA:CPU may order or contract differently per program and ISA: each within 6σ of
    the exact logits, σ from first-order rounding error propagation (tests/float_bounds.py)."""
    cfg, model, f, state = llama_built
    scanned = nnx.eval_shape(lambda: M.build_model({**cfg, "scan_layers": True}, {}, rngs=nnx.Rngs(1)))
    g_scan, s_scan = nnx.split(scanned)
    unrolled = {p: v for p, v in nnx.to_flat_state(state)}
    n = cfg["n_layers"]
    for path, var in nnx.to_flat_state(s_scan):
        if path[0] == "blocks":
            assert M.partitioning.logical_axes_of(var)[0] == "layers" and var.shape[0] == n
            var.set_value(jnp.stack([unrolled[("blocks", i, *path[1:])][...] for i in range(n)]))
        else:
            var.set_value(unrolled[path][...])
    assert sum(x.size for x in jax.tree.leaves(s_scan)) == M.param_count(cfg)
    scanned = jax.jit(lambda st, t: nnx.merge(g_scan, st)(t)).lower(s_scan, TOKENS).compile(UNOPTIMIZED)  # 6σ bounds
    out = np.asarray(scanned(s_scan, TOKENS))
    _, sigma = transformer_logits_sigma(model, TOKENS)
    assert_within(out, f(state, TOKENS), 12 * sigma, "logits")
