"""The diagnostics pass (lpt.models.probes / activation_diagnostics): FP8 underflow and subnormal fractions, tile-scale
range and GEMM SNR on crafted operands; the attention repeated-max rate on tied vs random logits; no trace when off."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lpt.models as M
from lpt.models import layers, probes


def _tile(amax: float) -> np.ndarray:
    """One 1x128 tile: amax at entry 0, 16 entries flushed to 0 by e4m3 (|x/s| = 4.5e-5 < 2^-10), 32 subnormal
    (|x/s| = 9.0e-3 in [2^-9, 2^-6)), 8 exact zeros, 71 normal (|x/s| = 224)."""
    t = np.full(128, 0.5 * amax, np.float32)
    t[0] = amax
    t[1:17] = 1e-7 * amax
    t[17:49] = 2e-5 * amax
    t[49:57] = 0.0
    return t


def test_fp8_probe_counts_crafted_underflow_subnormals_scale_range_and_snr():
    x = np.stack([np.concatenate([_tile(1.0), _tile(2.0**-6)])] * 2)  # [2, 256]: tile amaxes 1 and 1/64
    w = np.full((256, 128), 0.5, np.float32)
    w[0, :8] = 1e-7  # |w/s| = 9e-5: flushed to 0 (and subnormal)
    w[1, :4] = 1e-5  # |w/s| = 9e-3: subnormal
    rng = np.random.default_rng(0)
    x_plain = rng.normal(size=(2, 256)).astype(np.float32)  # no underflow at all
    w_rand = rng.normal(size=(256, 128)).astype(np.float32)

    @jax.jit
    def run(x, w, x_plain, w_rand):
        with probes.collecting() as c:
            layers.matmul(x, w, "fp8", jnp.float32, name="up")
            layers.matmul(x_plain, w, "fp8", jnp.float32, name="up")  # same kind: counts add up
            layers.matmul(x, w, "fp8", jnp.float32, name="down")
            y = layers.matmul(x_plain, w_rand, "fp8", jnp.float32, name="lm_head")
        return c.summary(), y

    stats, y = run(x, w, x_plain, w_rand)
    s = {k: float(v) for k, v in stats.items()}
    assert s["fp8/down/x_underflow_frac"] == 16 / 128
    assert s["fp8/down/x_subnormal_frac"] == 48 / 128
    assert s["fp8/up/x_underflow_frac"] == 16 / 256  # pooled over the two "up" matmuls (x_plain adds 0 of 512)
    assert s["fp8/down/w_underflow_frac"] == 8 / w.size
    assert s["fp8/down/w_subnormal_frac"] == 12 / w.size
    assert s["fp8/down/x_scale_range_log2"] == pytest.approx(6.0, abs=1e-6)  # tiles scaled by 1 and 2^-6
    assert s["fp8/up/x_scale_range_log2"] >= 6.0  # MAX over the two "up" matmuls
    ref = x_plain.astype(np.float64) @ w_rand.astype(np.float64)
    snr = 10 * np.log10(np.sum(ref**2) / np.sum((np.asarray(y, np.float64) - ref) ** 2))
    assert s["fp8/lm_head/snr_db"] == pytest.approx(snr, abs=0.01)
    assert 20 < snr < 40, snr  # e4m3 keeps 3 mantissa bits: ~30 dB
    assert s["fp8/down/snr_db"] > 60  # the crafted operands are nearly exact in e4m3
    assert not probes.active()


def test_repeated_max_probe_on_copied_keys_and_random_logits():
    """GQA shapes (4 query heads share 2 kv heads); causal rows t >= 1 see t + 1 keys."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.float32)
    k_rand = jnp.asarray(4 * rng.normal(size=(2, 16, 2, 8)), jnp.float32)  # O(10) logits: ties within 2^-9 are rare
    k_copied = jnp.broadcast_to(k_rand[:, :1], k_rand.shape)  # every key equal to the first: every row ties

    @jax.jit
    def rates(q, k):
        with probes.collecting() as c:
            probes.record_attention(q, k)
        return c.summary()["attn/repeated_max_frac"]

    assert float(rates(q, k_copied)) == 15 / 16  # row 0 sees one key only
    assert float(rates(q, k_rand)) < 0.02


def test_repeated_max_rate_through_scanned_gpt2_layers():
    """Identical tokens, zero position embeddings: every position holds the same vector in every layer, so all
    visible logits of a row tie (rate 15/16 per layer); the scan path reduces the per-layer entries (mean, max)."""
    cfg = dict(kind="gpt2", d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=16, scan_layers=True)
    model = M.build_model(cfg, {}, rngs=nnx.Rngs(0))
    model.pos_embed.embedding[...] = jnp.zeros_like(model.pos_embed.embedding[...])
    g, st = nnx.split(model)
    out = jax.jit(lambda s, t: M.activation_diagnostics(nnx.merge(g, s), t))(st, np.full((2, 16), 7, np.int32))
    assert sorted(out) == ["attn/repeated_max_frac", "attn/repeated_max_frac_max"]  # no fp8 matmul: no fp8 stats
    assert float(out["attn/repeated_max_frac"]) == 15 / 16
    assert float(out["attn/repeated_max_frac_max"]) == 15 / 16
