"""Lab section ``updates`` (Zamirai et al.; the norm-preserving update note): where low-precision weight updates lose,
and what fixes it.

1. Least squares trained with SGD in f32 and in bf16 with each update rule: the nearest-rounding floor of Zamirai et
al.'s
   Theorem 1, and Kahan / stochastic rounding matching f32.
2. The norm-preserving update note's sweep: norm of the applied change over the intended one, ``‖Q(p + lr·u) − p‖ /
‖lr·u‖``, across learning
   rates for float8_e4m3fn, float16 and bfloat16 params, for nearest rounding, stochastic rounding and the
   norm-preserving update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from tqdm import tqdm

import lpt.optim as O

RULES = O.UPDATE_RULES


def _least_squares_curves(steps: int, d: int = 64, n: int = 256, sigma: float = 0.05, lr: float = 0.01):
    """Loss per step of SGD on 0.5‖Aw − b‖² for f32 and bf16 + each update rule.

    Args:
      steps: SGD steps.
      d: parameters.
      n: rows of A.
      sigma: standard deviation of the noise in b.
      lr: learning rate.
    """
    rng = np.random.default_rng(0)
    A = jnp.asarray(rng.standard_normal((n, d)) / np.sqrt(n), jnp.float32)
    b = A @ jnp.asarray(rng.uniform(0.5, 2.0, d), jnp.float32) + sigma * jnp.asarray(
        rng.standard_normal(n), jnp.float32
    )

    def loss(w):
        r = A @ w.astype(jnp.float32) - b  # param dtype -> f32
        return 0.5 * jnp.sum(r * r)

    def run(tx, dtype):
        @jax.jit
        def go(w):
            def step(c, _):
                w, st = c
                u, st = tx.update(-lr * jax.grad(loss)(w), st, w)
                return (optax.apply_updates(w, u), st), loss(w)

            return jax.lax.scan(step, (w, tx.init(w)), None, length=steps)[1]

        return np.asarray(go(jnp.zeros(d, dtype)))

    runs = {"f32": (optax.identity(), jnp.float32)}
    runs.update({f"bf16 {r}": (O.update_rule(r, seed=1), jnp.bfloat16) for r in RULES})
    return {name: run(tx, dt) for name, (tx, dt) in tqdm(runs.items(), desc="updates: least squares", leave=False)}


def _applied_over_intended(dtype, lrs, size: int, rules=("nearest", "stochastic", "norm_preserving")):
    """‖applied change‖ / ‖lr·u‖ for params ~ N(0,1) in ``dtype`` and u ~ N(0,1), per rule and learning rate."""
    p = {"w": jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dtype)}
    u = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
    out = {}
    for rule in rules:
        tx = O.update_rule(rule, seed=2)
        upd = jax.jit(lambda g, tx=tx: tx.update({"w": g}, tx.init(p), p)[0]["w"])
        out[rule] = np.array([float(jnp.linalg.norm(upd(lr * u)) / jnp.linalg.norm(lr * u)) for lr in lrs])
    return out


def run(report, quick: bool) -> dict:
    """Add the section to ``report``; return the headline numbers (used by the tests)."""
    steps = 2000 if quick else 6000
    curves = _least_squares_curves(steps)
    f32 = float(curves["f32"][-1])
    report.section(
        "Weight updates: the nearest-rounding floor (Zamirai et al., Revisiting BFloat16 Training)",
        "with nearest rounding, updates below half an ulp are cancelled and the loss stalls on an O(ε) floor; Kahan "
        "summation and stochastic rounding in 16 bits match 32-bit training.",
        "Zamirai et al., Revisiting BFloat16 Training, Theorem 1 and Alg. 1",
    )
    report.text(f"Least squares, 64 params, 256 samples, σ = 0.05, SGD lr = 0.01, {steps} steps, bf16 params.")
    report.table(
        ["run", "final loss", "/ f32"],
        [[name, float(c[-1]), float(c[-1]) / f32] for name, c in curves.items()],
    )
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, c in curves.items():
        ax.semilogy(c, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    report.figure(fig, "updates_least_squares", "Loss vs step: bf16 + nearest stalls, Kahan and SR follow f32.")

    lrs = np.logspace(-7, -1, 7 if quick else 13)
    size = 256 if quick else 1024
    dtypes = [jnp.float8_e4m3fn, jnp.float16, jnp.bfloat16]
    sweeps = {
        jnp.dtype(dt).name: _applied_over_intended(dt, lrs, size)
        for dt in tqdm(dtypes, desc="updates: sweep", leave=False)
    }
    report.section(
        "Applied vs intended update norm across learning rates (the norm-preserving update note)",
        "naive addition zeroes out as the update falls below the minimum step; stochastic rounding works longer; the "
        "norm-preserving binary search keeps the update magnitude for much smaller learning rates.",
        "the norm-preserving update note, 'precision-aware update'",
    )
    report.text(
        f"Params ~ N(0,1) of shape {size}x{size} in each dtype, update lr·N(0,1); ratio ‖applied‖/‖lr·u‖. "
        "Stochastic rounding is unbiased (E[applied] = intended) but each element moves by a whole ulp with small "
        "probability, so the norm of its change grows like sqrt(|u|·ulp) and the ratio exceeds 1 at small lr; "
        "the norm-preserving search stops helping once max_scale·lr·|u| stays below half an ulp (fp8, lr ≤ 1e-6)."
    )
    rows = []
    for name, res in sweeps.items():
        for rule, ratios in res.items():
            rows.append([name, rule] + [float(r) for r in ratios[:: max(1, len(lrs) // 7)]])
    report.table(["dtype", "rule"] + [f"lr={lr:.0e}" for lr in lrs[:: max(1, len(lrs) // 7)]], rows)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5), sharey=True)
    for ax, (name, res) in zip(axes, sweeps.items(), strict=True):
        for rule, ratios in res.items():
            ax.semilogx(lrs, ratios, marker="o", label=rule)
        ax.set_title(name)
        ax.set_xlabel("learning rate")
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.set_yscale("symlog", linthresh=0.01)
    axes[0].set_ylabel("‖applied‖ / ‖intended‖")
    axes[0].legend()
    report.figure(fig, "updates_norm_sweep", "Applied/intended update norm vs learning rate, per param dtype.")
    out = {f"least_squares/{name}_over_f32": float(c[-1]) / f32 for name, c in curves.items()}
    out.update({f"sweep/{d}/{r}": v for d, res in sweeps.items() for r, v in res.items()})
    return out
