"""Section ``cost``: what each precision recipe costs in step time and memory, against the f32 recipe, in one run.

For every recipe of :data:`lpt.lab.runs.RECIPES` and one or two model sizes: the trainer's jitted train step on one
device (timed in interleaved rounds, best round counts), the persistent bytes per parameter (params + optimizer
state, from the abstract train state) and XLA's compiled scratch memory of the step (activations, gradients and
temporaries: ``compiled.memory_analysis().temp_size_in_bytes``). Nothing is trained; the numbers are ratios against
the f32 recipe measured in the same run. On CPU, FP8 matmuls are emulated and bf16 arithmetic is not faster than
f32, so the time column shows overheads, not the speed-ups a GPU/TPU gives; the memory columns carry over.
"""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

from lpt.lab import runs
from lpt.train.machine import describe

# model size name -> overrides; "tiny" is tiny_cpu itself, "small" a wider/deeper model with longer sequences
_SIZES = {
    "tiny": {},
    "small": {
        "model.d_model": "384",
        "model.n_layers": "4",
        "model.n_heads": "6",
        "model.n_kv_heads": "2",
        "model.d_ff": "1024",
        "model.max_seq_len": "128",
        "data.seq_len": "128",
        "train.global_batch": "16",
    },
}


def measure(names, overrides: dict[str, str], rounds: int, batches: int) -> dict[str, dict]:
    """``{recipe: {"step_ms", "time_ratio", "bytes_per_param", "param_bytes", "opt_bytes", "temp_mib",
    "temp_ratio", "params"}}`` for ``names`` with ``overrides`` applied; ratios against :data:`runs.BASELINE`."""
    names = list(names)
    if runs.BASELINE not in names:
        names.insert(0, runs.BASELINE)
    cfgs = {n: runs.recipe_config(n, overrides) for n in names}
    fns, temps = {}, {}
    for n in tqdm(names, desc="cost: compile steps", leave=False):
        fns[n], temps[n] = runs.train_step_runner(cfgs[n])
    data = runs.train_batches(cfgs[runs.BASELINE], batches)
    with tqdm(total=rounds * len(names), desc="cost: timing", leave=False) as bar:
        secs = runs.time_interleaved(fns, data, rounds, progress=bar)
    out = {}
    for n in names:
        size = runs.state_bytes(cfgs[n])
        out[n] = {
            **size,
            "step_ms": 1e3 * secs[n],
            "time_ratio": secs[n] / secs[runs.BASELINE],
            "temp_mib": temps[n] / 2**20,
            "temp_ratio": temps[n] / max(temps[runs.BASELINE], 1),
        }
    return out


def plan(quick: bool, recipes=None) -> tuple[list[str], list[str]]:
    """The recipes (default: all; :func:`measure` adds the f32 baseline) and the model sizes (``--quick``: tiny)
    :func:`run` measures."""
    return list(recipes or runs.RECIPES), ["tiny"] if quick else list(_SIZES)


def configs(quick: bool, recipes=None, overrides=None) -> dict:
    """``{(size, recipe): config}`` of every step :func:`run` measures; ValueError naming the key for a bad override
    (checked by ``python -m lpt.lab`` before anything is written)."""
    names, sizes = plan(quick, recipes)
    names = names if runs.BASELINE in names else [runs.BASELINE, *names]
    return {(s, n): runs.recipe_config(n, {**_SIZES[s], **(overrides or {})}) for s in sizes for n in names}


def run(report, quick: bool, recipes=None, overrides=None) -> dict:
    """Measure ``recipes`` (default: all) plus the f32 baseline at the tiny size (``--quick``) or both sizes, with
    ``overrides`` applied after each size's own."""
    names, sizes = plan(quick, recipes)
    extra = overrides or {}
    rounds, batches = (2, 3) if quick else (5, 6)
    report.section(
        "cost: step time and memory of each recipe",
        "16-bit weights with Kahan compensation or stochastic rounding need ~8 bytes per parameter for AdamW "
        "(bf16 weights, compensation and moments) instead of ~14-16 with f32 master weights; FP8 matmuls and "
        "attention fixes should cost little time next to the matmuls they modify.",
        "Zamirai et al.; Qiu & Yao; DeepSeek-V3 (~8 vs ~14+ bytes/param)",
    )
    out = {}
    for size in sizes:
        res = measure(names, {**_SIZES[size], **extra}, rounds, batches)
        out[size] = res
        cfg = runs.recipe_config(runs.BASELINE, {**_SIZES[size], **extra})
        m = cfg.model
        report.text(
            f"**{size}** model: d_model {m.d_model}, {m.n_layers} layers, {res[runs.BASELINE]['params']:,} params, "
            f"batch {cfg.train.global_batch} x {cfg.data.seq_len} tokens; best of {rounds} interleaved rounds of "
            f"{batches} steps (XLA:CPU, one device). Machine: {describe()}."
        )
        rows = [
            [
                n,
                round(r["step_ms"], 1),
                round(r["time_ratio"], 2),
                round(r["param_bytes"], 1),
                round(r["opt_bytes"], 1),
                round(r["bytes_per_param"], 1),
                round(r["temp_mib"], 1),
                round(r["temp_ratio"], 2),
            ]
            for n, r in res.items()
        ]
        report.table(
            [
                "recipe",
                "ms/step",
                "time vs fp32",
                "param B/param",
                "optim B/param",
                "total B/param",
                "XLA temp MiB",
                "temp vs fp32",
            ],
            rows,
        )
    kahan = out[sizes[-1]].get("bf16_kahan")
    if kahan is not None:
        base = out[sizes[-1]][runs.BASELINE]
        report.text(
            f"bf16 + Kahan holds {kahan['bytes_per_param']:.1f} bytes/param against the f32 recipe's "
            f"{base['bytes_per_param']:.1f} ({kahan['bytes_per_param'] / base['bytes_per_param']:.2f}x). The "
            "optimizer step alone at ~50M parameters is benchmarked by `benchmarks/optim_step.py` (see "
            "docs/results.md)."
        )
    out["headline"] = {n: float(np.round(r["bytes_per_param"], 2)) for n, r in out[sizes[-1]].items()}
    return out
