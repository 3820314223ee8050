"""Tolerances from f32 error analysis, for tests that compare two different XLA programs (or XLA with numpy).

XLA:CPU picks FMA contraction, vector widths and dot kernels per program and per ISA, so two programs computing the
same sums may add their terms in different orders. A sum of terms t_i evaluated in f32 with at most n roundings on
each term's path (additions, and products that scale it) is within γ_n·Σ|t_i| of the exact sum, whatever the order
(Higham, Accuracy and Stability of Numerical Algorithms, §3.1 and §4.2): two such evaluations are within
2γ_n·Σ|t_i| of each other.
"""

import numpy as np

U32 = 2.0**-24  # unit roundoff of f32 (round to nearest)


def gamma(n: int, u: float = U32) -> float:
    """γ_n = n·u / (1 − n·u)."""
    assert n * u < 1
    return n * u / (1 - n * u)


def assert_within(x, ref, bound, what: str = "") -> None:
    """|x − ref| <= bound elementwise (``bound`` broadcasts: a scalar or an array from the error analysis)."""
    err = np.abs(np.asarray(x, np.float64) - np.asarray(ref, np.float64))
    bound = np.broadcast_to(np.asarray(bound, np.float64), err.shape)
    bad = ~(err <= bound)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {err.size} beyond the bound; worst |x - ref| = {err[bad].max():.3g} "
        f"where the bound is {bound[bad][np.argmax(err[bad])]:.3g}"
    )


def attention_f32_bound(q, k, v, *, causal=False, kv_mask=None, segment_ids=None, max_offset=64.0, block=16):
    """Per element, a first-order bound on |O_1 − O_2| for two f32 evaluations of softmax attention of f32
    ``q[B, T, H, D]``, ``k, v[B, T, K, D]`` (GQA: head h uses kv head h // (H / K)) in any order: plain softmax, or
    blockwise (``block`` keys) with the max or the β shift (offset <= ``max_offset``); scale 1/sqrt(D).

    Each program's logit sums D rounded products and is scaled: the two differ by e_j <= 2γ_{D+1}·scale·Σ_d|q_d k_jd|.
    The shifts round s − c, by u·|s_j − m| for the max and u·(|s_j − m| + max_offset) for the β rule, and exp errs
    by <= 2 ulps in each program. A relative change ε_j of the weight P_j moves O by ε_j·P_j·|v_j − O|. The sums: a
    product P_j v_j meets at most n = max(T + 1, block + 2·⌈T/block⌉ + 1) roundings on its way into O (plain: the
    product, T − 1 additions, the normalization; blockwise: a block's dot, a rescale and an addition per block, the
    division), and so does ℓ: 4γ_n·Σ_j P_j|v_j| for the two programs."""
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731 - f32 -> f64, exact
    B, T, H, D = np.shape(q)
    g = H // np.shape(k)[2]
    q, k, v = f64(q), np.repeat(f64(k), g, axis=2), np.repeat(f64(v), g, axis=2)
    scale = D**-0.5
    s = scale * np.einsum("bqhd,bkhd->bhqk", q, k)
    ok = np.ones((B, 1, T, T), bool)
    if causal:
        ok &= np.tril(np.ones((T, T), bool))
    if kv_mask is not None:
        ok &= np.asarray(kv_mask)[:, None, None, :]
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        ok &= (seg[:, :, None] == seg[:, None, :])[:, None]
    m = np.where(ok, s, -np.inf).max(-1, keepdims=True)
    p = np.where(ok, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    ell = p.sum(-1, keepdims=True)
    p = np.where(ell > 0, p / np.where(ell > 0, ell, 1.0), 0.0)  # rows without keys: O = 0 in both
    e = 2 * gamma(D + 1) * scale * np.einsum("bqhd,bkhd->bhqk", np.abs(q), np.abs(k))
    eps = e + U32 * (2 * np.abs(np.where(ok, s - m, 0.0)) + max_offset) + 8 * U32  # relative change of P_j
    o = np.einsum("bhqk,bkhd->bqhd", p, v)
    w = p * eps
    first_order = np.einsum("bhqk,bkhd->bqhd", w, np.abs(v)) + w.sum(-1).transpose(0, 2, 1)[..., None] * np.abs(o)
    n = max(T + 1, block + 2 * -(-T // block) + 1)
    return first_order + 4 * gamma(n) * np.einsum("bhqk,bkhd->bqhd", p, np.abs(v))


def transformer_logits_sigma(model, tokens, max_offset: float = 64.0):
    """``(logits, sigma)`` in f64 for an ``lpt.models`` Transformer (llama: RMSNorm, RoPE without scaling, SwiGLU,
    GQA; gpt2: LayerNorm, learned positions, tanh GELU; causal, no weight noise) with params on the f32 grid and f32
    compute: the logits of the model's equations (as tests/models/test_transformer_forward.py's numpy reference,
    unrolled or scanned layers) and the standard deviation of
    an f32 evaluation's error under the model of independent rounding errors (Higham & Mary, A new approach to
    probabilistic rounding error analysis, 2019), to first order, for any order of the f32 sums, any FMA
    contraction and either attention (the flash twin's β shift, offset <= ``max_offset``, or the KV cache's plain
    softmax).

    Worst-case bounds (γ_n with |W| at every layer) exceed the logits themselves after two layers; this propagates
    variances instead: a rounding of x errs by at most u·|x| (uniform: variance (u·x)²/3), a dot of n terms adds n
    such roundings of at most Σ|terms|, the approximated functions (rsqrt, exp, tanh, sin, cos, pow: <= 2 ulps)
    4 such roundings; errors carried in from the inputs go through the linearized operation (W² for a matmul).
    Errors from one upstream value that meet again (q and k, the two MLP branches, a residual) add in standard
    deviation, not variance (worst correlation). Each evaluation is within 6·sigma of the exact logits except with
    probability 2e-9 per element (normal error; a bounded one: less), so two evaluations within 12·sigma."""
    u = U32
    spec = model.spec  # the resolved ``model`` config
    D, H, K = spec.d_model, spec.n_heads, spec.n_kv_heads
    Dh = D // H
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    gpt2 = spec.kind == "gpt2"
    eps = spec.norm_eps
    assert gpt2 or spec.rope_scaling.type == "none", "RoPE scaling is not modelled"
    rnd = lambda n, mag: n * (u * mag) ** 2 / 3  # noqa: E731 - variance of n roundings of values <= mag
    layer_index = None

    def f64(p):  # f32 params -> f64, exact; layer ``layer_index`` of a scanned model's stacked block parameters
        a = np.asarray(p[...], np.float64)
        return a if layer_index is None else a[layer_index]

    def lin(x, v, layer):  # v: variance of x's error
        w = f64(layer.kernel)
        y, mag, n = x @ w, np.abs(x) @ np.abs(w), w.shape[0]
        if layer.bias is not None:
            y, mag, n = y + f64(layer.bias), mag + np.abs(f64(layer.bias)), n + 1
        return y, v @ w**2 + rnd(n, mag)

    def norm(x, v, n):  # y = s·(x − μ)/σ: the error's component along x − μ is scaled out (first order)
        s = f64(n.scale)
        bias = f64(n.bias) if gpt2 else 0.0
        xc = x - x.mean(-1, keepdims=True) if gpt2 else x
        vc = v + rnd(D + 1, np.abs(x).mean(-1, keepdims=True) + np.abs(xc)) if gpt2 else v
        ms = (xc**2).mean(-1, keepdims=True) + eps
        r = 1 / np.sqrt(ms)
        y = xc * r * s + bias
        # Δy = s·r·(Δxc − xc·mean(xc·Δxc)/ms): the second term's variance is xc²·mean(xc²·vc)/(D·ms²)
        sd = np.abs(s) * r * (np.sqrt(vc) + np.abs(xc) * np.sqrt((xc**2 * vc).mean(-1, keepdims=True) / D) / ms)
        return y, sd**2 + rnd(D + 10, np.abs(xc * r * s) + np.abs(bias))

    def rope(x, v):  # angles t·θ^(−2i/Dh): pow and the product err by <= 5u·|angle|, cos and sin by <= 4u more
        i = np.arange(Dh // 2)
        ang = np.arange(T)[:, None] * spec.rope_theta ** (-2.0 * i / Dh)
        c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
        vcs = rnd(1, (5 * np.abs(ang) + 4))[None, :, None] * 3  # that worst case w counted as ±w: variance w²
        a, b, va, vb = x[..., : Dh // 2], x[..., Dh // 2 :], v[..., : Dh // 2], v[..., Dh // 2 :]
        y = np.concatenate([a * c - b * s, b * c + a * s], -1)
        v1 = c**2 * va + s**2 * vb + (a**2 + b**2) * vcs + rnd(3, np.abs(a * c) + np.abs(b * s))
        v2 = c**2 * vb + s**2 * va + (a**2 + b**2) * vcs + rnd(3, np.abs(b * c) + np.abs(a * s))
        return y, np.concatenate([v1, v2], -1)

    def attention(q, vq, k, vk, v, vv):  # [B, T, Dh] each; a relative change ε_j of P_j moves O by ε_j·P_j·(v_j − O)
        scale = 1 / np.sqrt(Dh)
        s = scale * q @ k.swapaxes(-1, -2)
        sd_s = scale * (np.sqrt(vq @ (k**2).swapaxes(-1, -2)) + np.sqrt(q**2 @ vk.swapaxes(-1, -2)))
        var_s = sd_s**2 + rnd(Dh + 1, scale * np.abs(q) @ np.abs(k).swapaxes(-1, -2))
        ok = np.tril(np.ones((T, T), bool))
        m = np.where(ok, s, -np.inf).max(-1, keepdims=True)
        p = np.where(ok, np.exp(np.where(ok, s - m, 0.0)), 0.0)
        p /= p.sum(-1, keepdims=True)
        o = p @ v
        var_eps = var_s + rnd(1, np.where(ok, np.abs(s - m), 0.0) + max_offset) + rnd(4, 1.0)  # s − c, exp
        dev = (v[:, None, :, :] - o[:, :, None, :]) ** 2  # [B, Tq, Tk, Dh]
        var_o = np.einsum("bqk,bqk,bqkd->bqd", p**2, var_eps, dev) + (p**2) @ vv
        return o, var_o + 2 * rnd(T + 8, p @ np.abs(v))  # the sums of acc and of ℓ

    def add(x, vx, a, va):  # a residual: both carry errors of the same upstream values
        return x + a, (np.sqrt(vx) + np.sqrt(va)) ** 2 + rnd(1, np.abs(x + a))

    x = f64(model.embed.embedding)[tokens]
    var = np.zeros_like(x)
    if gpt2:
        x = x + f64(model.pos_embed.embedding)[:T]
        var = rnd(1, np.abs(x))
    scanned = spec.scan_layers
    for i in range(spec.n_layers):
        blk, layer_index = (model.blocks, i) if scanned else (model.blocks[i], None)
        h, vh = norm(x, var, blk.norm1)
        q, vq = lin(h, vh, blk.attn.q)
        k, vk = lin(h, vh, blk.attn.k)
        v, vv = lin(h, vh, blk.attn.v)
        q, vq, k, vk, v, vv = (a.reshape(B, T, -1, Dh) for a in (q, vq, k, vk, v, vv))
        if not gpt2:
            (q, vq), (k, vk) = rope(q, vq), rope(k, vk)
        o, vo = np.zeros((B, T, H, Dh)), np.zeros((B, T, H, Dh))
        for hh in range(H):
            kk = hh // (H // K)
            o[:, :, hh], vo[:, :, hh] = attention(
                q[:, :, hh], vq[:, :, hh], k[:, :, kk], vk[:, :, kk], v[:, :, kk], vv[:, :, kk]
            )
        a, va = lin(o.reshape(B, T, D), vo.reshape(B, T, D), blk.attn.o)
        x, var = add(x, var, a, va)
        h, vh = norm(x, var, blk.norm2)
        if gpt2:  # gelu_tanh: |gelu'| <= 1.13; its inner argument 5 roundings, tanh 4, then 1 + t and the product
            g, vg = lin(h, vh, blk.mlp.up)
            c = np.sqrt(2 / np.pi)
            a = 0.5 * g * (1 + np.tanh(c * (g + 0.044715 * g**3)))
            va = 1.13**2 * vg + (0.5 * g) ** 2 * (rnd(5, c * (np.abs(g) + 0.044715 * np.abs(g) ** 3)) + rnd(4, 1.0))
            va = va + rnd(2, np.abs(a))
        else:  # silu(g)·up: |silu'| <= 1.1; sigmoid's exp 4 roundings, 1 + exp, the division, two products
            g, vg = lin(h, vh, blk.mlp.gate)
            up, vup = lin(h, vh, blk.mlp.up)
            sg = g / (1 + np.exp(-g))
            a = sg * up
            va = (np.sqrt(1.1**2 * vg * up**2) + np.sqrt(sg**2 * vup)) ** 2 + rnd(8, np.abs(a))
        d, vd = lin(a, va, blk.mlp.down)
        x, var = add(x, var, d, vd)
    layer_index = None
    h, vh = norm(x, var, model.final_norm)
    if model.lm_head is not None:
        logits, vl = lin(h, vh, model.lm_head)
    else:
        w = f64(model.embed.embedding).T
        logits, vl = h @ w, vh @ w**2 + rnd(D, np.abs(h) @ np.abs(w))
    return logits, np.sqrt(vl)
