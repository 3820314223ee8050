"""Lab section ``gemm`` (DeepSeek-V3 Technical Report): FP8 accumulation precision, promotion every N_c, blockwise vs
per-tensor scales.

1. The accumulator table: relative error of a K-long FP8 dot product summed in an FP8 register, a bf16 register, a
   ~14-bit register (what DeepSeek-V3 reports for Hopper's tensor cores), the same with promotion to f32 every 128
   products, and f32; for several K.
2. The promotion interval N_c swept for the 14-bit register at K = 4096.
3. Blockwise (1x128 / 128x128) vs one per-tensor scale when a few "massive" tokens sit over a bulk of small ones:
   mean per-token relative GEMM error as the massive tokens' magnitude grows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from tqdm import tqdm

from lpt.fp8.blockwise import blockwise_dot, dequantize_blocks, emulated_dot, quantize_blocks, quantize_tensor
from lpt.numerics import round_nearest

_emu = jax.jit(emulated_dot, static_argnames=("accumulator_bits", "promote_every", "max_abs"))

_ACCUMULATORS = {
    "FP8 register (3 bits, sat. 448)": dict(accumulator_bits=3, max_abs=448.0),
    "bf16 register (7 bits)": dict(accumulator_bits=7),
    "14-bit register": dict(accumulator_bits=14),
    "14-bit, promote every 128": dict(accumulator_bits=14, promote_every=128),
    "f32 (23 bits)": dict(accumulator_bits=23),
}


def _fp8_operands(k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = lambda v: np.asarray(round_nearest(v, jnp.float8_e4m3fn, out_dtype=jnp.float32))  # values on the e4m3 grid
    a = q((rng.standard_normal((8, k)) * 0.5).astype(np.float32))
    b = q((rng.standard_normal((k, 8)) * 0.5).astype(np.float32))
    return a, b, a.astype(np.float64) @ b.astype(np.float64)


def _rel(out, truth) -> float:
    return float(np.mean(np.abs(np.asarray(out, np.float64) - truth)) / np.mean(np.abs(truth)))


def _accumulator_table(ks):
    return {
        k: {name: _rel(_emu(*_fp8_operands(k)[:2], **kw), _fp8_operands(k)[2]) for name, kw in _ACCUMULATORS.items()}
        for k in tqdm(ks, desc="gemm: accumulators", leave=False)
    }


def _promotion_sweep(k: int, intervals):
    a, b, truth = _fp8_operands(k, seed=1)
    return {n: _rel(_emu(a, b, accumulator_bits=14, promote_every=n), truth) for n in intervals}


def _massive_activation_sweep(magnitudes, tokens: int = 128, k: int = 256, n: int = 128):
    """Mean per-token relative error of blockwise vs per-tensor FP8 GEMMs; 4 tokens at ``m``, bulk in [1e-2, 1]."""
    rng = np.random.default_rng(5)
    bulk = 10.0 ** rng.uniform(-2, 0, size=(tokens, 1))
    z = rng.standard_normal((tokens, k))
    w = (rng.standard_normal((k, n)) / 16).astype(np.float32)
    wq = np.asarray(jax.jit(lambda w: dequantize_blocks(*quantize_blocks(w)))(w), np.float64)
    out = {"blockwise": [], "per-tensor": []}
    for m in magnitudes:
        mag = bulk.copy()
        mag[:: tokens // 4] = m
        x = (z * mag).astype(np.float32)
        ref = x.astype(np.float64) @ w
        per_token = lambda y, ref=ref: float(np.mean(np.linalg.norm(y - ref, axis=1) / np.linalg.norm(ref, axis=1)))
        out["blockwise"].append(per_token(np.asarray(jax.jit(blockwise_dot)(x, w), np.float64)))
        qx, sx = jax.jit(quantize_tensor)(x)
        out["per-tensor"].append(per_token((np.asarray(qx, np.float64) * float(sx)) @ wq))
    return out


def run(report, quick: bool) -> dict:
    """Add the section to ``report``; return the headline numbers (used by the tests)."""
    ks = [512, 4096] if quick else [512, 1024, 4096, 16384]
    table = _accumulator_table(ks)
    report.section(
        "FP8 GEMM accumulation and promotion (DeepSeek-V3 Technical Report)",
        "with FP8 inputs and K = 4096, limited (~14-bit) tensor-core accumulation gives ~2-3e-4 relative error; "
        "promoting the partial sum to an FP32 accumulator every N_c = 128 products fixes it; FP8 accumulation is "
        "unusable.",
        "DeepSeek-V3 technical report, FP8 training, section 3.3",
    )
    report.text("FP8 (e4m3) operands, 8x8 outputs; mean |error| / mean |truth| against an f64 sum.")
    report.table(
        ["accumulator"] + [f"K={k}" for k in ks], [[name] + [table[k][name] for k in ks] for name in _ACCUMULATORS]
    )
    intervals = [16, 32, 64, 128, 256, 512, 1024, None]
    sweep = _promotion_sweep(4096, intervals)
    report.table(
        ["14-bit register, promote every"] + [str(n) if n else "never" for n in intervals],
        [["rel. error"] + list(sweep.values())],
    )
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.loglog([n for n in intervals if n], [sweep[n] for n in intervals if n], marker="o", label="promote every N_c")
    ax.axhline(sweep[None], color="red", ls="--", label="never promoted")
    ax.set_xlabel("N_c (products between promotions)")
    ax.set_ylabel("relative error (K=4096)")
    ax.legend()
    report.figure(fig, "gemm_promotion", "14-bit accumulation at K = 4096: error vs promotion interval.")

    mags = [1e0, 1e2, 1e4] if quick else [1e0, 1e1, 1e2, 1e3, 1e4, 1e5]
    massive = _massive_activation_sweep(mags)
    report.section(
        "Blockwise vs per-tensor scaling on massive activations (DeepSeek-V3 Technical Report)",
        "fine-grained 1x128 activation tiles and 128x128 weight blocks keep outliers from destroying the precision "
        "of the other tokens, where one per-tensor scale cannot.",
        "DeepSeek-V3 technical report, fine-grained quantization",
    )
    report.text(
        "128 tokens x K=256, 4 massive tokens at magnitude m over a bulk log-uniform in [1e-2, 1]; weights in "
        "128x128 blocks for both; mean per-token relative error of the GEMM output vs f64."
    )
    report.table(["scaling"] + [f"m={m:.0e}" for m in mags], [[k] + v for k, v in massive.items()])
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name, v in massive.items():
        ax.loglog(mags, v, marker="o", label=name)
    ax.set_xlabel("magnitude of the massive tokens")
    ax.set_ylabel("mean per-token rel. error")
    ax.legend()
    report.figure(fig, "gemm_massive_activations", "Per-tensor scaling degrades as the activation range grows.")
    out = {f"acc/K={k}/{name}": v for k, row in table.items() for name, v in row.items()}
    out.update({f"promote/{n}": v for n, v in sweep.items()})
    out.update({f"massive/{name}": v for name, v in massive.items()})
    return out
