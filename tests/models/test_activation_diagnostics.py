"""The probes of the diagnostics pass (lpt.models.probes): FP8 underflow and subnormal fractions, tile-scale range
and GEMM SNR on crafted operands; the attention repeated-max rate on copied vs random keys; pooling over layers
(scanned or not). The model/trainer wiring (keys, scan path, no trace when off) is in
tests/train/test_train_diagnostics.py."""

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
    # tiles scaled by 1 and 2^-6 (the scale ratio is exactly 64); jnp.log2 is log(x) / log(2) in f32: with <= 2
    # ulps in each log and the division's rounding, within 6·(2·2^-21/log 64 + 2·2^-24/log 2 + 2^-24) = 2.8e-6 of 6
    assert s["fp8/down/x_scale_range_log2"] == pytest.approx(6.0, abs=2.0**-18)
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


def test_collector_pools_layers_and_reduces_scanned_entries():
    """Per-layer entries of a scan (leading layer axis) pool like the same entries added layer by layer."""
    rates = jnp.asarray([0.25, 0.75], jnp.float32)  # two layers' repeated-max fractions
    counts = (jnp.asarray([3.0, 5.0]), jnp.asarray([100.0, 100.0]))  # underflow count / entries per layer
    energies = (jnp.asarray([50.0, 150.0]), jnp.asarray([0.5, 1.5]))  # signal / noise energy per layer
    hows = {"r": probes.RATIO, "m": probes.MAX, "u": probes.RATIO, "s": probes.DB}
    stacked = {"r": (rates, jnp.ones(2)), "m": (rates, jnp.ones(2)), "u": counts, "s": energies}
    scanned, unrolled = probes.Collector(), probes.Collector()
    scanned.add_stacked(hows, stacked)
    for i in range(2):
        for name, (a, b) in stacked.items():
            unrolled.add(name, hows[name], a[i], b[i])
    for c in (scanned, unrolled):
        s = {k: float(v) for k, v in c.summary().items()}
        assert s == pytest.approx({"r": 0.5, "m": 0.75, "u": 0.04, "s": 20.0}), s
    with pytest.raises(ValueError, match="recorded as"):
        unrolled.add("m", probes.RATIO, 1.0)


def test_scanned_layers_trace_their_statistics_out_of_the_scan():
    """With scan_layers each layer collects inside nnx.scan and returns its entries as scan outputs (a tracer leaking
    out of the scan would raise here); traced only, the reduction's values are checked above."""
    cfg = dict(
        kind="llama", vocab_size=256, d_model=128, n_layers=2, n_heads=1, d_ff=128, max_seq_len=8, scan_layers=True
    )
    model = M.build_model(cfg, {"matmul": {"up": "fp8"}}, rngs=nnx.Rngs(0))
    g, st = nnx.split(model)
    out = jax.eval_shape(lambda s: M.activation_diagnostics(nnx.merge(g, s), jnp.zeros((1, 8), jnp.int32)), st)
    assert {k for k in out if not k.startswith("fp8/up/")} == {"attn/repeated_max_frac", "attn/repeated_max_frac_max"}
    assert len([k for k in out if k.startswith("fp8/up/")]) == 6
    assert all(v.shape == () for v in out.values())  # reduced over the layer axis
