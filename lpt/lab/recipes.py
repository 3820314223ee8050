"""Section ``recipes``: every precision recipe trained on ``tiny_cpu`` for the same budget, in one run.

Each recipe of :data:`lpt.lab.runs.RECIPES` is trained by the trainer itself (``lpt.train``'s ``train``) from the
same init, data order and schedule; the table gives its validation loss relative to the f32 run, the fraction of
update elements that rounding cancelled (the cancellation of Zamirai et al.'s Theorem 1, from the optimizer
diagnostics), and from
:func:`lpt.lab.cost.measure` the step time relative to the f32 step (interleaved timing after training, so machine
load during the runs does not enter) and the persistent bytes per parameter (params + optimizer state).
The learning rate is 1e-3 for every recipe: there, late in the cosine schedule, most bf16 updates fall below half
an ulp of their weight (the regime of Zamirai et al.'s Theorem 1; at tiny_cpu's default 3e-3 the bf16 runs differ by
bf16
compute noise more than by the update rule). Runs resume from ``DIR/recipes_runs/<recipe>``: rerunning with the
same ``--out`` only re-evaluates finished runs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from lpt.lab import cost, runs
from lpt.train.machine import describe

LR = "1e-3"
FULL = {"optim.lr": LR, "train.diagnostics_every": "0"}  # tiny_cpu's own budget: 600 steps of 32 x 64 tokens
QUICK = {  # ~15 s per recipe on 2 quiet cores (mostly compiling): a one-layer model, 100 steps of 16 x 64 tokens
    **FULL,
    "model.d_model": "64",
    "model.n_layers": "1",
    "model.d_ff": "192",
    "train.steps": "100",
    "train.global_batch": "16",
    "optim.warmup_steps": "10",
    "train.eval_every": "50",
    "train.eval_batches": "1",
    "train.checkpoint_every": "100",
    "train.keep_checkpoints": "1",
}
_QUICK_RECIPES = ("fp32", "bf16_nearest", "bf16_kahan", "bf16_sr")


def _train_recipes(names, overrides: dict[str, str], workdir: Path) -> dict[str, dict]:
    """Train each recipe in ``workdir/<name>``; return ``{name: runs.trained(...)}``."""
    logging.getLogger("lpt.train").setLevel(logging.WARNING)
    out = {}
    for name in names:
        out[name] = runs.trained(runs.recipe_config(name, overrides), workdir / name)
    return out


def plan(quick: bool, recipes=None, overrides=None) -> tuple[list[str], dict[str, str]]:
    """The recipes :func:`run` trains (``recipes``, default: all; ``--quick``: four; the f32 baseline first) and
    the overrides of every run: the section's budget, then ``overrides``."""
    names = list(recipes or (_QUICK_RECIPES if quick else runs.RECIPES))
    if runs.BASELINE not in names:
        names.insert(0, runs.BASELINE)
    return names, {**(QUICK if quick else FULL), **(overrides or {})}


def configs(quick: bool, recipes=None, overrides=None) -> dict:
    """``{recipe: config}`` of every run of :func:`run`; ValueError naming the key for a bad override (checked by
    ``python -m lpt.lab`` before anything is written)."""
    names, overrides = plan(quick, recipes, overrides)
    return {n: runs.recipe_config(n, overrides) for n in names}


def run(report, quick: bool, recipes=None, overrides=None) -> dict:
    """Train ``recipes`` (default: all; ``--quick``: a smaller budget and four recipes) plus the f32 baseline, with
    the section's budget and then ``overrides`` (e.g. ``{"train.seed": "1"}``) applied to every run."""
    names, overrides = plan(quick, recipes, overrides)
    cfgs = {n: runs.recipe_config(n, overrides) for n in names}
    workdir = Path(report.out_dir) / "recipes_runs"
    results = _train_recipes(names, overrides, workdir)

    cost_of = cost.measure(names, overrides, rounds=2 if quick else 5, batches=3 if quick else 6)

    base = results[runs.BASELINE]["eval_loss"]
    out: dict = {"baseline_eval_loss": base, "unigram": results[runs.BASELINE]["unigram"]}
    rows = []
    for n in names:
        r = results[n]
        cancelled = r["train"].get("update/cancelled_fraction")
        late = float(np.nanmean(cancelled[-max(1, len(cancelled) // 5) :])) if cancelled is not None else float("nan")
        out[n] = {
            "eval_loss": r["eval_loss"],
            "vs_f32": r["eval_loss"] / base - 1.0,
            "cancelled_late": late,
            "step_time_ratio": cost_of[n]["time_ratio"],
            "bytes_per_param": cost_of[n]["bytes_per_param"],
        }
        o = out[n]
        rows.append(
            [
                n,
                runs.RECIPES[n][2],
                round(o["eval_loss"], 4),
                f"{100 * o['vs_f32']:+.2f}%",
                "-" if np.isnan(late) else f"{100 * late:.0f}%",
                round(o["step_time_ratio"], 2),
                round(o["bytes_per_param"], 1),
            ]
        )

    steps = cfgs[runs.BASELINE].train.steps
    report.section(
        "recipes: every precision recipe on tiny_cpu, same budget",
        "bf16 weights with nearest rounding lose the updates that fall below half an ulp and end measurably worse; "
        "Kahan-compensated or stochastically rounded bf16 updates match f32 training (within ~1%) at about half the "
        "bytes per parameter; blockwise FP8 matmuls and GaussWS train to a comparable loss.",
        "Zamirai et al.; DeepSeek-V3; Ahn & Yoo. The bar: bf16+Kahan within 1% of f32, bf16+nearest measurably worse",
    )
    report.text(
        f"Budget: {steps} steps of {cfgs[runs.BASELINE].train.global_batch} x {cfgs[runs.BASELINE].data.seq_len} "
        f"tokens, lr {cfgs[runs.BASELINE].optim.lr:g} (cosine), same init and data order; overrides {overrides}. "
        f"Unigram baseline "
        f"{out['unigram']:.4f}. *cancelled* = fraction of update elements that left their weight unchanged, mean over "
        f"the last fifth of the run. Step time: the trainer's jitted step timed in interleaved rounds after training "
        "(XLA:CPU, where bf16 is not faster than f32 and FP8 is emulated: overheads, not GPU speed-ups; see `cost`). "
        f"Bytes/param = params + optimizer state. Machine: {describe()}."
    )
    report.table(["recipe", "what", "val loss", "vs fp32", "cancelled", "step time vs fp32", "bytes/param"], rows)

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    base_ev = results[runs.BASELINE]["eval"]
    for n in names:
        tr, ev = results[n]["train"], results[n]["eval"]
        (line,) = ax.plot(tr["step"], tr["loss"], lw=1, alpha=0.7, label=n)
        common = np.intersect1d(ev["step"], base_ev["step"])
        ratio = [ev["eval_loss"][ev["step"] == s][0] / base_ev["eval_loss"][base_ev["step"] == s][0] for s in common]
        ax2.plot(common, 100 * (np.array(ratio) - 1), "o-", color=line.get_color(), ms=3, label=n)
    ax.axhline(out["unigram"], color="grey", ls=":", lw=1, label="unigram")
    ax.set(xlabel="step", ylabel="training loss (nats/byte)", title=f"lr {cfgs[runs.BASELINE].optim.lr:g}, cosine")
    ax.set_ylim(top=out["unigram"] + 0.3)
    ax.legend(fontsize=7)
    ax2.axhline(0, color="grey", lw=1)
    ax2.axhspan(-1, 1, color="grey", alpha=0.1)
    ax2.set(xlabel="step", ylabel="validation loss vs fp32 (%)", title="validation loss relative to the f32 run")
    report.figure(
        fig, "recipes_loss", "Training loss of every recipe (left); validation loss relative to fp32, ±1% shaded."
    )
    return out
