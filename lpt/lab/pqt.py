"""Lab section ``pqt`` (Ahn & Yoo, Gaussian Weight Sampling): the rounded-normal noise from random bits, and GaussWS /
DiffQ on a toy.

1. Distribution of ``lpt.pqt.rounded_normal`` against Ahn & Yoo's Eq. 10 (and against round(N(0,1)/2), which the
   bit trick approximates), with a chi-square statistic.
2. A student-teacher linear layer (64x64) trained with Adam, plain bf16 vs GaussWS vs DiffQ (learnable bitwidth,
   b_init 6, b_target 4), without and with Eq. 12's bitwidth term: the loss without noise, the loss after rounding
   the weights to FP6 (e2m3, one absmax scale per 32x32 block), and the mean bitwidth b_t over training.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from lpt.numerics import round_nearest
from lpt.pqt import ROUNDED_NORMAL_PMF, GaussWSLinear, bitwidth_loss, bitwidth_of, rounded_normal

_LAMBDA = 1e-2  # Eq. 12 weight of the toy's bitwidth term (pulls b_t from 6 to ~5.4 in 1000 steps)


def _noise_table(n: int):
    counts = np.zeros(5, np.int64)
    chunk = 1 << 22
    for i in range(max(1, n // chunk)):
        r = np.asarray(jax.jit(lambda k: rounded_normal(k, (chunk,)))(jax.random.key(i)), np.float32)
        counts += np.array([(r == v).sum() for v in (-2, -1, 0, 1, 2)])
    total = counts.sum()
    pmf = np.array([ROUNDED_NORMAL_PMF[v] for v in (-2, -1, 0, 1, 2)])
    chi2 = float(np.sum((counts - total * pmf) ** 2 / (total * pmf)))
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))
    gauss = [phi(-3) - phi(-5), phi(-1) - phi(-3), phi(1) - phi(-1), phi(3) - phi(1), phi(5) - phi(3)]
    return counts / total, pmf, np.array(gauss), chi2, int(total)


def _fp6_blocks(w: np.ndarray, block: int = 32) -> np.ndarray:
    """Round w to float6_e2m3fn with one absmax scale per block x block tile (the paper's FP6 deployment)."""
    m, n = w.shape
    t = w.reshape(m // block, block, n // block, block)
    scale = np.abs(t).max(axis=(1, 3), keepdims=True) / 7.5  # e2m3 max = 7.5
    q = np.asarray(round_nearest(jnp.asarray(t / scale, jnp.float32), "float6_e2m3fn"), np.float64)  # f32 grid
    return (q * scale).reshape(m, n)


def _train_toy(method: str | None, steps: int, lam: float = 0.0, d: int = 64, seed: int = 0):
    """Returns (MSE curve, b_t curve, clean MSE, FP6 MSE) for plain (None), "gaussws" or "diffq", trained on
    MSE + Eq. 12's ``lam · mean_tiles |b_t − b_target|``.

    Args:
      method: None (no weight noise), ``"gaussws"`` or ``"diffq"``.
      steps: Adam steps.
      lam: λ of Eq. 12's bitwidth term.
      d: width of the square linear layer.
      seed: seed of the teacher, the layer and the batches.
    """
    rng = np.random.default_rng(seed)
    w_star = jnp.asarray(rng.standard_normal((d, d)) / np.sqrt(d), jnp.float32)
    layer = GaussWSLinear(d, d, method=method or "gaussws", rngs=nnx.Rngs(seed), pqt_path="toy")
    opt = nnx.Optimizer(layer, optax.adam(3e-3), wrt=nnx.Param)
    root = jax.random.key(seed + 1)

    @nnx.jit
    def step(layer, opt, i):
        x = jax.random.normal(jax.random.fold_in(root, i), (256, d), jnp.float32)
        key = None if method is None else jax.random.fold_in(root, i + 1_000_000)

        def loss_fn(layer):
            y = layer(x, key).astype(jnp.float32)  # bf16 -> f32
            mse = jnp.mean((y - x @ w_star) ** 2)
            return mse + bitwidth_loss(layer, lam), mse

        (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(layer)
        opt.update(layer, grads)
        return loss, jnp.mean(bitwidth_of(layer.bitwidth))

    losses, bts = [], []
    for i in range(steps):
        loss, bt = step(layer, opt, i)
        losses.append(float(loss))
        bts.append(float(bt))
    x = jax.random.normal(jax.random.key(99), (1024, d), jnp.float32)
    y = np.asarray(x @ w_star, np.float64)
    w = np.asarray(layer.kernel[...], np.float64)
    x64 = np.asarray(x, np.float64)
    clean = float(np.mean((x64 @ w - y) ** 2))
    fp6 = float(np.mean((x64 @ _fp6_blocks(w) - y) ** 2))
    return np.array(losses), np.array(bts), clean, fp6


def run(report, quick: bool) -> dict:
    """Add the section to ``report``; return the headline numbers (used by the tests)."""
    emp, pmf, gauss, chi2, total = _noise_table(1 << (22 if quick else 24))
    report.section(
        "Rounded-normal noise from random bits (Ahn & Yoo, Eq. 10)",
        "R ≈ round(N(0,1)/2) built from random bits with AND/OR: Pr(±2) = 3/4·2⁻⁹, "
        "Pr(±1) = (3/4)²·2⁻²·(1 − Pr(±2)), Pr(0) ≈ 0.717.",
        "Ahn & Yoo, Eq. 10",
    )
    report.text(f"{total:,} samples of lpt.pqt.rounded_normal; chi-square vs Eq. 10 = {chi2:.2f} (4 dof).")
    report.table(
        ["R", "Eq. 10", "measured", "round(N(0,1)/2)"],
        [[v, float(p), float(e), float(g)] for v, p, e, g in zip((-2, -1, 0, 1, 2), pmf, emp, gauss, strict=True)],
    )
    steps = 200 if quick else 1000
    configs = {
        "bf16 (no noise)": (None, 0.0),
        "GaussWS": ("gaussws", 0.0),
        "DiffQ": ("diffq", 0.0),
        f"GaussWS, λ={_LAMBDA:g}": ("gaussws", _LAMBDA),
        f"DiffQ, λ={_LAMBDA:g}": ("diffq", _LAMBDA),
    }
    runs = {name: _train_toy(m, steps, lam) for name, (m, lam) in tqdm(configs.items(), desc="pqt: toy", leave=False)}
    report.section(
        "Pseudo-quantization training on a toy (Ahn & Yoo, Gaussian Weight Sampling)",
        "the bitwidth b_t is learned per 32x32 tile; Eq. 12's term λ·|b_t − b_target| trades noise (loss) for fewer "
        "bits, and the noise keeps small weights robust to low-precision (down to FP6) representation.",
        "Ahn & Yoo, Eq. 11-12",
    )
    report.text(
        f"Student-teacher linear 64x64, Adam lr 3e-3, {steps} steps, batches of 256, b_init 6, b_target 4; FP6 = "
        "e2m3 with one absmax scale per 32x32 block. Without the Eq. 12 term the loss alone pushes b_t *up* (more "
        "bits = less noise); with λ it moves towards b_target at the price of a higher training MSE. A linear "
        "student has one optimum (the teacher), so noise training cannot make it more FP6-robust here: FP6/clean "
        "is set by rounding the teacher's weights. The paper's claim that PQT training follows the baseline's loss "
        "is measured on the transformer in the `recipes` section (recipe `gaussws`)."
    )
    report.table(
        ["training", "MSE (f64 weights)", "MSE after FP6", "FP6 / clean", "mean b_t at end"],
        [[k, c, f, f / c, float(b[-1]) if k != "bf16 (no noise)" else "-"] for k, (_, b, c, f) in runs.items()],
    )
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.2))
    for k, (losses, bts, _, _) in runs.items():
        a1.semilogy(losses, label=k)
        if k != "bf16 (no noise)":
            a2.plot(bts, label=k)
    a1.set_xlabel("step")
    a1.set_ylabel("train MSE")
    a1.legend()
    a2.set_xlabel("step")
    a2.set_ylabel("mean b_t")
    a2.legend()
    report.figure(fig, "pqt_toy", "Toy training loss and learned bitwidth.")
    out = {"noise/chi2": chi2, **{f"noise/p{v}": float(e) for v, e in zip((-2, -1, 0, 1, 2), emp, strict=True)}}
    out.update({f"toy/{k}/clean": c for k, (_, _, c, _) in runs.items()})
    out.update({f"toy/{k}/fp6": f for k, (_, _, _, f) in runs.items()})
    out.update({f"toy/{k}/bt_end": float(b[-1]) for k, (_, b, _, _) in runs.items()})
    return out
