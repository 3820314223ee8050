"""Section ``finetune``: fine-tuning a pretrained model at a small learning rate in f32 and in bf16 with each update
rule: the bf16 failure of Zamirai et al. in its most practical form.

One pretrained start: a ``tiny_cpu`` f32 run trained by the trainer in ``DIR/finetune_runs/<size>/pretrain`` (reused
when it is already there). From it, ``configs/finetune_cpu.py`` (held-out Python source, constant small learning
rate, ``init_from.workdir`` = the start) is run with each recipe of :data:`RECIPES` on the same data, schedule and
budget: f32 params and compute (``f32_master``), and bf16 params and compute with round-to-nearest, Kahan-compensated
(the compensation starts with the f32 start's low bits, :mod:`lpt.train.init_from`) and stochastically rounded
updates. Per recipe the table gives the validation loss before and after, its gap to the f32 fine-tune, the share of
the f32 run's improvement it achieved, and the share of cancelled update elements (``update/cancelled_fraction`` of
:func:`lpt.optim.get_diagnostics`, the trainer's own metric, averaged over the logged steps). Runs resume from
their workdirs: rerunning with the same ``--out`` only re-reads finished runs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import matplotlib.pyplot as plt
import numpy as np

from lpt import data as data_lib
from lpt.lab import runs
from lpt.train import config as config_lib
from lpt.train import init_from, loop
from lpt.train import mesh as mesh_lib
from lpt.train.machine import describe

# recipe -> (overrides of configs/finetune_cpu.py, description)
RECIPES: dict[str, tuple[dict[str, str], str]] = {
    "f32": (
        {
            "precision.param_dtype": "float32",
            "precision.compute_dtype": "float32",
            "precision.update_rule": "f32_master",
        },
        "f32 params and compute",
    ),
    "bf16_nearest": ({"precision.update_rule": "nearest"}, "bf16, round-to-nearest update"),
    "bf16_kahan": ({"precision.update_rule": "kahan"}, "bf16, Kahan update (f32 low bits in the compensation)"),
    "bf16_sr": ({"precision.update_rule": "stochastic"}, "bf16, stochastically rounded update"),
}
BASELINE = "f32"
LR = "1e-4"
_COMMON = {"train.diagnostics_every": "0"}
_FULL_PRETRAIN: dict[str, str] = {**_COMMON}  # configs/tiny_cpu.py as shipped: 600 steps of 32 x 64 tokens
FULL = {**_COMMON, "optim.lr": LR}  # configs/finetune_cpu.py: 300 steps of 32 x 64 tokens
_SMALL_MODEL = {"model.d_model": "64", "model.n_layers": "1", "model.d_ff": "192"}
_QUICK_PRETRAIN = {
    **_COMMON,
    **_SMALL_MODEL,
    "train.steps": "150",
    "train.global_batch": "16",
    "optim.warmup_steps": "10",
    "train.eval_every": "150",
    "train.eval_batches": "1",
    "train.checkpoint_every": "150",
    "train.keep_checkpoints": "1",
}
QUICK = {
    **FULL,
    **_SMALL_MODEL,
    "train.steps": "100",
    "train.global_batch": "16",
    "train.eval_every": "50",
    "train.eval_batches": "2",
    "train.checkpoint_every": "100",
    "train.keep_checkpoints": "1",
}


def recipe_config(name: str, overrides: dict[str, str], start: Path):
    """configs/finetune_cpu.py with recipe ``name``'s overrides, ``overrides`` and ``init_from.workdir=start``."""
    cfg = config_lib.load_config_file("finetune_cpu")
    return config_lib.apply_overrides(cfg, {**RECIPES[name][0], **overrides, "init_from.workdir": str(start)})


def _start_loss(cfg: config_lib.Config) -> float:
    """Validation loss of ``cfg``'s step-0 state (its ``init_from`` params in its storage and compute dtypes) on the
    validation batches the trainer evaluates."""
    cfg = config_lib.resolve(cfg)
    mesh = loop.make_mesh(cfg)
    prog = loop.program(cfg, mesh)
    state, _ = init_from.initial_state(cfg, prog)
    batches = data_lib.make_eval_batches(
        cfg.data, seq_len=cfg.data.seq_len, batch=cfg.train.global_batch, num_batches=cfg.train.eval_batches
    )
    put = lambda b: {k: jax.device_put(v, mesh_lib.batch_sharding(mesh)) for k, v in b.items()}
    return float(np.mean([float(prog.eval_step(state.params, state.rest, put(b))) for b in batches]))


def run(report, quick: bool) -> dict:
    """Pretrain (or reuse) the start, fine-tune it with every recipe, add the table and plot to ``report``, write
    ``DIR/finetune.json``; return the numbers (``{recipe: {...}}`` plus the start's)."""
    logging.getLogger("lpt.train").setLevel(logging.WARNING)
    size = "quick" if quick else "full"
    root = Path(report.out_dir) / "finetune_runs" / size
    pre_cfg = config_lib.apply_overrides(
        config_lib.load_config_file("tiny_cpu"), _QUICK_PRETRAIN if quick else _FULL_PRETRAIN
    )
    pre = loop.train(pre_cfg, root / "pretrain")
    overrides = QUICK if quick else FULL
    cfgs = {n: recipe_config(n, overrides, root / "pretrain") for n in RECIPES}
    starts: dict[tuple, float] = {}  # the bf16 recipes share their start (same params, same compute)
    out: dict = {"pretrain_eval_loss": pre["eval_loss"]}
    results = {}
    for n, cfg in cfgs.items():
        key = (cfg.precision.param_dtype, cfg.precision.compute_dtype)
        if key not in starts:
            starts[key] = _start_loss(cfg)
        run = runs.trained(cfg, root / n)
        results[n] = {"start": starts[key], "final": run["eval_loss"], "unigram": run["unigram"]}
        results[n]["train"], results[n]["eval"] = run["train"], run["eval"]
        cancelled = run["train"].get("update/cancelled_fraction")
        results[n]["cancelled"] = float(np.nanmean(cancelled)) if cancelled is not None else float("nan")
    base = results[BASELINE]
    base_gain = base["start"] - base["final"]
    rows = []
    for n, r in results.items():
        o = {
            "start_eval_loss": r["start"],
            "eval_loss": r["final"],
            "vs_f32": r["final"] / base["final"] - 1.0,
            "improvement": r["start"] - r["final"],
            "progress_vs_f32": (r["start"] - r["final"]) / base_gain,
            "cancelled": None if np.isnan(r["cancelled"]) else r["cancelled"],  # None: f32 rounds nothing
        }
        out[n] = o
        rows.append(
            [
                n,
                RECIPES[n][1],
                f"{o['start_eval_loss']:.4f}",
                f"{o['eval_loss']:.4f}",
                f"{100 * o['vs_f32']:+.2f}%",
                f"{100 * o['progress_vs_f32']:.0f}%",
                "-" if o["cancelled"] is None else f"{100 * o['cancelled']:.0f}%",
            ]
        )
    c = cfgs[BASELINE]
    out["unigram"] = base["unigram"]
    out["budget"] = {"steps": c.train.steps, "global_batch": c.train.global_batch, "seq_len": c.data.seq_len}
    out["lr"] = c.optim.lr
    report.section(
        "finetune: a pretrained model fine-tuned at a small learning rate, f32 vs bf16 update rules",
        "with bf16 weights, updates smaller than half an ulp of their weight are cancelled by round-to-nearest, so a "
        "fine-tune at a small learning rate stalls; Kahan summation and stochastic rounding keep the f32 trajectory.",
        "Zamirai et al., Revisiting BFloat16 Training, Theorem 1 and Alg. 1",
    )
    report.text(
        f"Start: `tiny_cpu` (f32, embedded English prose) trained in `{root / 'pretrain'}`, validation loss "
        f"{pre['eval_loss']:.4f} on its own corpus. Fine-tune: `configs/finetune_cpu.py` (the `.py` files of the "
        f"`email` package of this Python's standard library: code instead of prose), {c.train.steps} steps of "
        f"{c.train.global_batch} x {c.data.seq_len} tokens, constant lr {c.optim.lr:g} after "
        f"{c.optim.warmup_steps} warmup steps, same data order for every recipe; overrides {overrides}. Unigram "
        f"baseline {out['unigram']:.4f}. *start* = validation loss of the step-0 params (the bf16 recipes round the "
        "f32 start to nearest and compute in bf16); *progress* = the recipe's loss decrease over the f32 run's; "
        "*cancelled* = share of update elements whose nonzero intended update left the stored weight unchanged, mean "
        "over the logged steps (for Kahan the change is deferred into the compensation and for stochastic rounding "
        f"it is kept in expectation; for nearest it is lost). Machine: {describe()}."
    )
    report.table(["recipe", "what", "start", "val loss", "vs f32", "progress", "cancelled"], rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    for n, r in results.items():
        ev = r["eval"]
        ax.plot(np.r_[0, ev["step"]], np.r_[r["start"], ev["eval_loss"]], "o-", ms=3, label=n)
    ax.set(xlabel="fine-tuning step", ylabel="validation loss (nats/byte)", title=f"fine-tune, lr {c.optim.lr:g}")
    ax.legend(fontsize=8)
    report.figure(fig, "finetune_loss", "Validation loss during the fine-tune, per recipe (step 0: the start).")
    (Path(report.out_dir) / "finetune.json").write_text(json.dumps(out, indent=2) + "\n")
    return out
