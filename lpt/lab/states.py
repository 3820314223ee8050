"""Section ``states``: Adam's moments in 8 bits (:mod:`lpt.optim.moments8`) against float32 and 16-bit moments.

1. Least squares ``0.5·mean((A w − b)²)``, A 512 × 64 with column scales spanning four decades (one 64-element block
   holds gradients four decades apart, their squares eight), AdamW lr 3e-3, 1,500 steps, bf16 params: every moment
   variant × requantization (stochastic, nearest) × weight update (Kahan, stochastic rounding, nearest), three
   problem seeds; the final loss over float32 AdamW's (mean and spread over seeds), the share of nonzero moments whose
   8-bit code underflowed to 0 at the end, and the per-step quantization error of ν (the stored second moment against
   the f32 EMA of the stored one).
2. The tiny LM (``tiny_cpu``) trained by the trainer at lr 1e-3 and 3e-3, three seeds: f32, Kahan and stochastic-
   rounding bf16 weights with bf16 or 8-bit moments; validation loss vs f32 (mean ± spread), bytes/param counted from
   the abstract train state (scales included), and the XLA:CPU step time of 8-bit against bf16 moments timed in the
   same interleaved rounds. Runs resume from ``DIR/states_runs/<run>``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from tqdm import tqdm

import lpt.optim as O
from lpt.lab import runs
from lpt.lab.recipes import QUICK
from lpt.optim import moments8 as M8
from lpt.train import config as config_lib
from lpt.train.machine import describe

_MOMENTS = ("float32", "bfloat16", *M8.MOMENT8)
_WEIGHTS = ("kahan", "stochastic", "nearest")
ROUNDINGS = ("stochastic", "nearest")
# the LM runs: name -> (config file, overrides)
_LM_RUNS = {
    "fp32": ("tiny_cpu", {}),
    "kahan_bf16": ("tiny_cpu_bf16_kahan", {}),
    "kahan_e4m3": ("tiny_cpu_bf16_kahan", {"precision.moment_dtype": "float8_e4m3fn"}),
    "kahan_e4m3_nearest": (
        "tiny_cpu_bf16_kahan",
        {"precision.moment_dtype": "float8_e4m3fn", "precision.moment_rounding": "nearest"},
    ),
    "kahan_e5m2": ("tiny_cpu_bf16_kahan", {"precision.moment_dtype": "float8_e5m2"}),
    "sr_bf16": ("tiny_cpu_bf16_sr", {}),
    "sr_e4m3": ("tiny_cpu_bf16_sr", {"precision.moment_dtype": "float8_e4m3fn"}),
}
_QUICK_LM = ("fp32", "kahan_bf16", "kahan_e4m3")


def least_squares(moments: str, weights: str, rounding: str, seed: int, steps: int = 1500, lr: float = 3e-3):
    """One run of the least-squares problem; returns ``{"loss": final, "curve", "v_err", "underflow"}``.

    Args:
      moments: the moment dtype: ``"float32"`` (with ``weights="f32"``: optax's adamw), ``"bfloat16"`` or an 8-bit
        moment format (keys of ``lpt.optim.moments8.MOMENT8``); see :data:`_MOMENTS`.
      weights: ``"f32"`` (only with float32 moments), ``"kahan"`` (:func:`lpt.optim.kahan_adamw`) or an update rule of
        :func:`lpt.optim.adamw` (``"stochastic"``, ``"nearest"``) on bf16 weights.
      rounding: ``moment_rounding`` of the moments (``"stochastic"`` or ``"nearest"``); unused for optax's adamw.
      seed: seed of the problem.
      steps: optimizer steps.
      lr: learning rate.
    """
    rng = np.random.default_rng(seed)
    A = jnp.asarray(rng.standard_normal((512, 64)) * np.logspace(-2, 2, 64)[None, :], jnp.float32)
    b = A @ jnp.asarray(rng.standard_normal(64), jnp.float32) + 0.01 * jnp.asarray(rng.standard_normal(512))

    def loss(w):
        r = A @ w.astype(jnp.float32) - b  # param dtype -> f32
        return 0.5 * jnp.mean(r * r)

    if moments == "float32" and weights == "f32":
        tx, dtype = optax.adamw(lr, weight_decay=0.0), jnp.float32
    else:
        kw = dict(weight_decay=0.0, moment_dtype=moments, moment_rounding=rounding)
        tx = O.kahan_adamw(lr, **kw) if weights == "kahan" else O.adamw(lr, update=weights, **kw)
        dtype = jnp.bfloat16
    spec = M8.MOMENT8.get(moments)

    def codes(st):
        """``(m_codes, v_codes, scales)`` of the state of an 8-bit run (kahan_adamw's, or adamw's scale_by_adam)."""
        if weights == "kahan":
            return (*M8.unpack_codes(st.moments), st.scales)
        return st[0].mu, st[0].nu, st[0].scales

    def v_underflow(st):
        return jnp.float32(0.0) if spec is None else M8.block_health(spec, *codes(st))["v_underflow"]

    def v_of(st):
        return M8.load(spec, *codes(st))[1]

    @jax.jit
    def go(w):
        def step(c, _):
            w, st = c
            g = jax.grad(loss)(w)
            u, st2 = tx.update(g, st, w)
            err = jnp.float32(0.0)
            if spec is not None:  # ν's requantization error this step: stored vs the f32 EMA of the stored ν
                v_old, v_new = v_of(st), v_of(st2)
                g32 = g.astype(jnp.float32)  # bf16 -> f32
                v_f32 = 0.999 * v_old + 0.001 * g32 * g32
                nz = v_f32 > 0
                err = jnp.sum(jnp.where(nz, jnp.abs(v_new - v_f32) / jnp.where(nz, v_f32, 1.0), 0.0)) / jnp.maximum(
                    jnp.sum(nz), 1
                )
            return (optax.apply_updates(w, u), st2), (loss(w), err)

        st = tx.init(w)
        (w, st), (curve, v_err) = jax.lax.scan(step, (w, st), None, length=steps)
        return loss(w), curve, v_err, v_underflow(st)

    final, curve, v_err, under = go(jnp.zeros(64, dtype))
    return {"loss": float(final), "curve": np.asarray(curve), "v_err": np.asarray(v_err), "underflow": float(under)}


def _lm_config(name: str, lr: str, seed: int, quick: bool):
    file, extra = _LM_RUNS[name]
    cfg = config_lib.load_config_file(file)
    budget = {**(QUICK if quick else {"train.diagnostics_every": "0"}), "optim.lr": lr, "train.seed": str(seed)}
    return config_lib.apply_overrides(cfg, {**budget, **extra})


def lm_runs(names, lrs, seeds, workdir: Path, quick: bool) -> dict:
    """Train (or re-read) every ``name × lr × seed``; ``{(name, lr, seed): {"eval_loss", "train", "eval"}}``.

    Args:
      names: LM runs (keys of :data:`_LM_RUNS`).
      lrs: learning rates as config strings (``"1e-3"``).
      seeds: training seeds.
      workdir: the directory holding one run directory per ``name × lr × seed``.
      quick: the short budget of ``--quick``.
    """
    logging.getLogger("lpt.train").setLevel(logging.WARNING)
    out = {}
    for name in tqdm([(n, lr, s) for n in names for lr in lrs for s in seeds], desc="states: LM runs", leave=False):
        n, lr, s = name
        run_dir = workdir / f"{n}_lr{lr}_s{s}"
        out[name] = runs.trained(_lm_config(n, lr, s, quick), run_dir)
    return out


def _step_times(names, quick: bool) -> dict[str, float]:
    """Seconds per trainer step of each LM run's config (lr 1e-3, seed 0), timed in the same interleaved rounds."""
    fns = {n: runs.train_step_runner(_lm_config(n, "1e-3", 0, quick))[0] for n in names}
    batches = runs.train_batches(_lm_config(names[0], "1e-3", 0, quick), 3 if quick else 6)
    return runs.time_interleaved(fns, batches, rounds=2 if quick else 5)


def _mean_spread(xs) -> str:
    xs = np.asarray(xs, float)
    return f"{100 * xs.mean():+.2f}% ± {100 * (xs.max() - xs.min()) / 2:.2f}"


def run(report, quick: bool) -> dict:
    """Add the section to ``report``; return the headline numbers (used by the tests)."""
    out: dict = {}
    seeds = (0,) if quick else (0, 1, 2)
    steps = 500 if quick else 1500
    moments = ("bfloat16", "float8_e4m3fn", "e4m3_v_direct") if quick else _MOMENTS
    weights = ("kahan",) if quick else _WEIGHTS
    f32 = {s: least_squares("float32", "f32", "", s, steps) for s in seeds}
    ls = {}
    for m in tqdm(moments, desc="states: least squares", leave=False):
        for wt in weights:
            for r in ROUNDINGS if m in M8.MOMENT8 else ("stochastic",):
                ls[(m, wt, r)] = [least_squares(m, wt, r, s, steps) for s in seeds]
    report.section(
        "states: Adam moments in 8 bits with a block scale",
        "8-bit Adam states (bitsandbytes' block-wise dynamic quantization, torchao's AdamW8bit/AdamWFp8, FP8 moments "
        "in MS-AMP, COAT and Fishman et al.) train like float32 states; here they are combined with Kahan or "
        "stochastically rounded bf16 weights: about 6 and 4 bytes/param.",
        "Dettmers et al., 8-bit Optimizers via Block-wise Quantization; Peng et al., FP8-LM (MS-AMP); Xi et al., COAT; "
        "Fishman et al., Scaling FP8 training to trillion-token LLMs",
    )
    f32_losses = ", ".join(f"{f32[s]['loss']:.4g}" for s in seeds)
    report.text(
        f"Least squares, A 512 × 64 with column scales logspace(-2, 2), AdamW lr 3e-3, no decay, {steps} steps, bf16 "
        f"params; final loss over float32 AdamW's ({f32_losses} for seeds "
        f"{seeds}): mean (min..max) over seeds. *v underflow*: share of nonzero-block ν elements whose 8-bit code is 0 "
        "at the end; *ν error*: mean relative requantization error of ν over the last 100 steps."
    )
    rows = []
    for (m, wt, r), res in ls.items():
        ratios = [res[i]["loss"] / f32[s]["loss"] for i, s in enumerate(seeds)]
        out[f"least_squares/{m}/{wt}/{r}"] = float(np.mean(ratios))
        under = np.mean([x["underflow"] for x in res])
        v_err = np.mean([np.mean(x["v_err"][-100:]) for x in res])
        rows.append(
            [
                m,
                wt,
                r if m in M8.MOMENT8 else "-",
                f"{np.mean(ratios):.3g} ({np.min(ratios):.3g}..{np.max(ratios):.3g})",
                f"{100 * under:.1f}%" if m in M8.MOMENT8 else "-",
                f"{v_err:.3g}" if m in M8.MOMENT8 else "-",
            ]
        )
    report.table(["moments", "weights", "requantization", "loss / f32", "v underflow", "ν error"], rows)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax.semilogy(f32[seeds[0]]["curve"], color="k", lw=1, label="f32 AdamW")
    for (m, wt, r), res in ls.items():
        if wt == "kahan":
            ax.semilogy(res[0]["curve"], lw=1, alpha=0.8, label=f"{m} {r}")
            if m in M8.MOMENT8:
                ax2.semilogy(res[0]["v_err"], lw=1, alpha=0.8, label=f"{m} {r}")
    ax.set(xlabel="step", ylabel="loss", title="least squares, Kahan weights, seed 0")
    ax.legend(fontsize=6)
    ax2.set(xlabel="step", ylabel="mean |ν' − ν| / ν", title="ν's requantization error per step")
    ax2.legend(fontsize=6)
    report.figure(fig, "states_least_squares", "Least squares: loss and ν's 8-bit quantization error per step.")

    names = _QUICK_LM if quick else tuple(_LM_RUNS)
    lrs = ("1e-3",) if quick else ("1e-3", "3e-3")
    lm = lm_runs(names, lrs, seeds, Path(report.out_dir) / "states_runs", quick)
    times = _step_times([n for n in names if n != "fp32"], quick)
    rows = []
    for n in names:
        row = [n]
        for lr in lrs:
            vs = [lm[(n, lr, s)]["eval_loss"] / lm[("fp32", lr, s)]["eval_loss"] - 1.0 for s in seeds]
            out[f"lm/{n}/lr{lr}"] = float(np.mean(vs))
            row.append(_mean_spread(vs))
        st = runs.state_bytes(_lm_config(n, "1e-3", 0, quick))
        out[f"lm/{n}/bytes_per_param"] = st["bytes_per_param"]
        base = "kahan_bf16" if n.startswith("kahan") else "sr_bf16"
        ratio = times[n] / times[base] if n in times and base in times else float("nan")
        out[f"lm/{n}/step_time_vs_bf16_moments"] = ratio
        rows.append([*row, f"{st['bytes_per_param']:.3f}", "-" if np.isnan(ratio) else f"{ratio:.2f}"])
    cfg = _lm_config("fp32", "1e-3", 0, quick)
    report.text(
        f"tiny LM ({cfg.model.n_layers} layers, d_model {cfg.model.d_model}, {cfg.train.steps} steps of "
        f"{cfg.train.global_batch} × {cfg.data.seq_len} tokens), seeds {seeds}: validation loss vs the f32 run of the "
        "same lr and seed, mean ± half the range. Bytes/param: params + optimizer state of the abstract train state. "
        "Step time: the trainer's jitted step (XLA:CPU) over the same recipe with bf16 moments, interleaved rounds. "
        f"Machine: {describe()}."
    )
    headers = ["run", *[f"val loss vs f32, lr {lr}" for lr in lrs], "bytes/param", "step time vs bf16 moments"]
    report.table(headers, rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names:
        ev = lm[(n, lrs[0], seeds[0])]["eval"]
        ax.plot(ev["step"], ev["eval_loss"], "o-", ms=3, lw=1, label=n)
    ax.set(xlabel="step", ylabel="validation loss", title=f"tiny LM, lr {lrs[0]}, seed {seeds[0]}")
    ax.legend(fontsize=7)
    report.figure(fig, "states_lm", "Tiny LM: validation loss with 8-bit and 16-bit moments.")
    return out
