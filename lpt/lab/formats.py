"""Section ``formats``: the block formats of NVIDIA's Blackwell GPUs, MXFP8 and NVFP4
(:func:`lpt.fp8.block_scaled_dot`), against bf16 and DeepSeek's blockwise FP8 matmuls, with NVFP4's two training
switches on and off.

1. The tiny LM (``tiny_cpu``) trained by the trainer with its q/k/v, output, up/gate and down projections in bf16
   (the baseline: ``tiny_cpu`` with bf16 compute), blockwise FP8 (``tiny_cpu_fp8``: 4 KV heads, since FP8 blocks
   need N = 128), MXFP8 (``tiny_cpu_mxfp8``) and NVFP4 (``tiny_cpu_nvfp4``) with both the random Hadamard transform
   of dW's inputs and stochastic rounding of the gradients, with neither, and with each alone; three seeds. The
   table gives each run's validation loss and its gap to the bf16 run of the same seed, mean ± half the range.
   Runs resume from ``DIR/formats_runs/<run>_s<seed>``.
2. Per GEMM, on the first validation batch through the final checkpoint of the bf16 run of seed 0: every q/k/v,
   out, up/gate and down matmul's x, w and output gradient dY (``dL/dy`` of the mean cross-entropy, from a zero
   added to y), quantized as each format's GEMMs quantize them. SNR in dB (``10 log10(Σ ref² / Σ (q − ref)²)``,
   energies pooled over the matmuls of a layer kind) of the quantized x, w and dY (the dX GEMM's operand, blocked
   along N) and of the three GEMM results y, dX and dW of the formats' own differentiable matmuls, against the same
   GEMMs on the bf16 operands with f32 accumulation; and the share of blocks whose scale saturates or underflows, or
   whose maximum clips (:func:`lpt.fp8.microscaling.block_scale_health`), for x, w and dY.
3. Which of NVIDIA's findings reproduce at this scale, written from the numbers.

The GEMMs are captured by wrapping :func:`lpt.models.layers.matmul` for the duration of one traced forward and
backward pass (:func:`_capture_gemms`); the model and its matmuls are the trainer's.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from tqdm import tqdm

from lpt import data as data_lib
from lpt.inference import load_model
from lpt.lab import runs
from lpt.lab.recipes import QUICK
from lpt.models import layers, matmul_formats
from lpt.models.config import Precision
from lpt.train import config as config_lib
from lpt.train.machine import describe
from lpt.train.step import cross_entropy

# the trained runs: name -> (config file, overrides, label)
RUNS = {
    "bf16": ("tiny_cpu", {"precision.compute_dtype": "bfloat16"}, "bf16 matmuls (baseline)"),
    "fp8": ("tiny_cpu_fp8", {}, "blockwise FP8 (DeepSeek-V3; 4 KV heads)"),
    "mxfp8": ("tiny_cpu_mxfp8", {}, "MXFP8"),
    "nvfp4": ("tiny_cpu_nvfp4", {}, "NVFP4, Hadamard + SR"),
    "nvfp4_neither": (
        "tiny_cpu_nvfp4",
        {"precision.nvfp4_hadamard": "false", "precision.nvfp4_stochastic_grads": "false"},
        "NVFP4, neither",
    ),
    "nvfp4_hadamard": ("tiny_cpu_nvfp4", {"precision.nvfp4_stochastic_grads": "false"}, "NVFP4, Hadamard only"),
    "nvfp4_sr": ("tiny_cpu_nvfp4", {"precision.nvfp4_hadamard": "false"}, "NVFP4, SR only"),
}
FULL = {"train.diagnostics_every": "0"}  # tiny_cpu's own budget: 600 steps of 32 x 64 tokens, lr 3e-3
# --quick: lpt.lab.recipes' one-layer model (d_model 64, where FP8's 128-blocks do not fit) with 4 KV heads, so that
# q, k, v and out share one shape (fewer GEMMs to compile); two runs
_QUICK_BUDGET = {**QUICK, "model.n_kv_heads": "4"}
_QUICK_RUNS = ("bf16", "nvfp4")
# the per-GEMM formats: name -> (registered matmul format, its precision switches: lpt.models.config.Precision keys)
GEMM_FORMATS = {
    "fp8": ("fp8", {}),
    "mxfp8": ("mxfp8", {}),
    "nvfp4": ("nvfp4", {}),  # Hadamard transform of dW's inputs and SR of dY: NVFP4's defaults
    "nvfp4_hadamard": ("nvfp4", {"nvfp4_stochastic_grads": False}),
    "nvfp4_sr": ("nvfp4", {"nvfp4_hadamard": False}),
    "nvfp4_neither": ("nvfp4", {"nvfp4_hadamard": False, "nvfp4_stochastic_grads": False}),
}
_QUICK_GEMM_FORMATS = ("mxfp8", "nvfp4", "nvfp4_neither")
KINDS = ("qkv", "out", "up", "down")
_QUANTITIES = ("x", "w", "dy", "y", "dx", "dw")
_HEALTH = ("saturated", "underflow", "clipped")


def run_config(name: str, seed: int, quick: bool):
    """The trainer config of run ``name`` for ``seed`` with the section's budget."""
    if name not in RUNS:
        raise ValueError(f"unknown run {name!r}; available: {', '.join(RUNS)}")
    file, extra, _ = RUNS[name]
    cfg = config_lib.load_config_file(file)
    return config_lib.apply_overrides(cfg, {**(_QUICK_BUDGET if quick else FULL), **extra, "train.seed": str(seed)})


def lm_runs(names, seeds, workdir: Path, quick: bool) -> dict:
    """Train (or re-read) every ``name × seed``; ``{(name, seed): {"eval_loss", "train", "eval", "dir"}}``."""
    logging.getLogger("lpt.train").setLevel(logging.WARNING)
    out = {}
    for n, s in tqdm([(n, s) for n in names for s in seeds], desc="formats: LM runs", leave=False):
        run_dir = workdir / f"{n}_s{s}"
        out[(n, s)] = runs.trained(run_config(n, s, quick), run_dir)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Per-GEMM quantization error
# ---------------------------------------------------------------------------------------------------------------


def _capture_gemms(run_dir: Path) -> tuple[list[tuple[str, jax.Array, jax.Array, jax.Array]], object]:
    """``([(kind, x [M, K], w [K, N], g [M, N])], cfg)``: every matmul of the run's final checkpoint on its first
    validation batch, as f32 arrays of the compute-dtype values (x and w as the layer hands them to its matmul; g =
    ``dL/dy`` of the mean cross-entropy, the cotangent of a zero added to y), and the run's config."""
    model, _, cfg = load_model(workdir=run_dir)
    one = dict(num_batches=1, process_index=0, process_count=1)
    batch = data_lib.make_eval_batches(cfg.data, seq_len=cfg.data.seq_len, batch=cfg.train.global_batch, **one)[0]
    inputs, targets = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
    original = layers.matmul
    seen: list = []
    taps: list = [None]

    def tapped(x, w, kind, out_dtype, *, name="matmul", **kw):
        y = original(x, w, kind, out_dtype, name=name, **kw)
        i = len(seen)
        seen.append((name, x, w, jax.ShapeDtypeStruct(y.shape, y.dtype)))
        return y if taps[0] is None else y + taps[0][i]  # + a zero of y's dtype: exact

    def loss(zeros):
        seen.clear()
        taps[0] = zeros
        ce = cross_entropy(model(inputs, key=None), targets)
        return ce, [(x, w) for _, x, w, _ in seen]

    layers.matmul = tapped  # the layers look matmul up in lpt.models.layers at call time
    try:
        jax.eval_shape(lambda: model(inputs, key=None))
        zeros = [jnp.zeros(s.shape, s.dtype) for *_, s in seen]
        names = [n for n, *_ in seen]
        (_, xw), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(zeros)
    finally:
        layers.matmul = original
        taps[0] = None
    out = []
    for n, (x, w), g in zip(names, xw, grads, strict=True):
        k, m = w.shape
        x2 = x.reshape(-1, k).astype(jnp.float32)  # compute dtype -> f32 (exact)
        g2 = g.reshape(-1, m).astype(jnp.float32)  # compute dtype -> f32 (exact)
        out.append((n, x2, w.astype(jnp.float32), g2))  # w: compute dtype -> f32 (exact)
    return out, cfg


def _pad_to(a: jax.Array, multiples: tuple[int, ...]) -> jax.Array:
    """``a`` zero-padded at the end of each axis to a multiple (zeros raise no block amax: exact for the blocks)."""
    return jnp.pad(a, [(0, (-n) % m) for n, m in zip(a.shape, multiples, strict=True)])


def _energies(ref, approx) -> jax.Array:
    """f32 ``[Σ ref², Σ (approx − ref)²]``."""
    return jnp.stack([jnp.sum(ref * ref), jnp.sum(jnp.square(approx - ref))])


@functools.partial(jax.jit, static_argnames="fmt")
def _gemm_errors(x, w, g, key, fmt: str) -> dict[str, jax.Array]:
    """One matmul ``y = x w`` (f32 operands holding compute-dtype values; g = dL/dy) in the GEMM format ``fmt``
    (:data:`GEMM_FORMATS`): ``{quantity: [signal, noise]}`` energies for the operands x, w, dy and the GEMM results
    y, dx, dw against the f32-accumulated GEMMs of the unquantized operands, and for a format with block scales
    ``{"health/<operand>": [saturated, underflow, clipped, blocks]}`` (int32) of x, w and dy. The matmul format
    (:mod:`lpt.models.matmul_formats`) quantizes and multiplies, with K and N zero-padded to its block (zeros raise
    no block amax: exact for the blocks; a no-op where they are multiples already).

    Args:
      x: f32 ``[M, K]`` activations holding compute-dtype values.
      w: f32 ``[K, N]`` weight holding compute-dtype values.
      g: f32 ``[M, N]``, dL/dy.
      key: PRNG key of the format's stochastic rounding and Hadamard signs.
      fmt: a key of :data:`GEMM_FORMATS` (static).
    """
    format_name, switches = GEMM_FORMATS[fmt]
    f, prec = matmul_formats.get(format_name), Precision(**switches)
    b, n = f.block(prec), w.shape[1]
    xq, wq, gq = f.quantized_operands(_pad_to(x, (1, b)), _pad_to(w, (b, b)), _pad_to(g, (1, b)), key=key, prec=prec)
    xq, wq, gq = xq[:, : x.shape[1]], wq[: w.shape[0], :n], gq[:, :n]
    out = {}
    health = f.block_health(x, w, g)
    if health is not None:
        for op, h in zip(("x", "w", "dy"), health, strict=True):
            out[f"health/{op}"] = jnp.stack([h.saturated, h.underflow, h.clipped, jnp.int32(h.blocks)])
    dot = lambda x, w: f.emulated_gemm(_pad_to(x, (1, b)), _pad_to(w, (b, b)), key=key, prec=prec)[:, :n]
    y, pullback = jax.vjp(dot, x, w)
    dx, dw = pullback(g)
    hi = jax.lax.Precision.HIGHEST
    refs = {"y": jnp.dot(x, w, precision=hi), "dx": jnp.dot(g, w.T, precision=hi), "dw": jnp.dot(x.T, g, precision=hi)}
    for name, ref, q in (("x", x, xq), ("w", w, wq), ("dy", g, gq), ("y", refs["y"], y), ("dx", refs["dx"], dx)):
        out[name] = _energies(ref, q)
    out["dw"] = _energies(refs["dw"], dw)
    return out


def _gemm_table(gemms, formats, seed: int = 0) -> dict:
    """``{(kind, fmt): {quantity: [signal, noise], "health/<operand>": counts}}`` pooled over the matmuls of each
    layer kind (and ``"all"`` over the four kinds); keys for the SR bits and Hadamard signs from ``seed``."""
    key = jax.random.key(seed)
    pooled: dict = {}
    work = [(i, kind, x, w, g) for i, (kind, x, w, g) in enumerate(gemms) if kind in KINDS]
    for fmt in tqdm(formats, desc="formats: GEMM errors", leave=False):
        for i, kind, x, w, g in work:
            res = jax.device_get(_gemm_errors(x, w, g, jax.random.fold_in(key, i), fmt))
            for group in (kind, "all"):
                acc = pooled.setdefault((group, fmt), {})
                for q, v in res.items():
                    acc[q] = acc.get(q, 0) + np.asarray(v, np.float64)
    return pooled


def snr_db(energies) -> float:
    """``10 log10(signal / noise)`` of pooled ``[signal, noise]`` (inf for no noise)."""
    s, n = (float(v) for v in energies)
    return float("inf") if n == 0 else 10.0 * np.log10(s / n)


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def _gaps(lm, a: str, b: str, seeds) -> list[float]:
    """Per seed: validation loss of run ``a`` over run ``b``'s, minus 1."""
    return [lm[(a, s)]["eval_loss"] / lm[(b, s)]["eval_loss"] - 1.0 for s in seeds]


def _spread(xs) -> tuple[float, float]:
    """(mean, half the range)."""
    xs = np.asarray(xs, float)
    return float(xs.mean()), float((xs.max() - xs.min()) / 2)


def _pct(xs) -> str:
    m, h = _spread(xs)
    return f"{100 * m:+.2f}%" if len(xs) == 1 else f"{100 * m:+.2f}% ± {100 * h:.2f}"


def _compare(xs, lower: str, higher: str, same: str) -> str:
    """The verdict on per-seed differences ``xs``: resolved (|mean| above half their range, two seeds or more)
    in either direction, or inside the seed scatter."""
    m, h = _spread(xs)
    if len(xs) < 2:
        return f"{_pct(xs)} (one seed: no scatter to judge it against)"
    return f"{_pct(xs)}: {(lower if m < 0 else higher) if abs(m) > h else same}"


def findings(lm, names, seeds, table, formats, n_params: int, tokens: int) -> list[str]:
    """Bullet points: which of NVIDIA's findings the numbers reproduce, and what this scale cannot test.

    Args:
      lm: ``{(run, seed): {"eval_loss", ...}}`` of :func:`lm_runs`.
      names: the LM runs trained (keys of :data:`RUNS`).
      seeds: the seeds trained.
      table: ``{(kind, fmt): {quantity: [signal, noise]}}`` of :func:`_gemm_table`.
      formats: the GEMM formats in ``table`` (keys of :data:`GEMM_FORMATS`).
      n_params: parameters of the LM.
      tokens: training tokens per run.
    """
    out = []
    if len(seeds) < 2:
        out.append("**One seed**: no seed-to-seed scatter, so no loss difference below can be told from noise.")
    if "mxfp8" in names:
        m, h = _spread(_gaps(lm, "mxfp8", "bf16", seeds))
        same = abs(m) <= max(h, 0.005)
        out.append(
            f"**MXFP8 vs bf16**: {_pct(_gaps(lm, 'mxfp8', 'bf16', seeds))}; "
            + ("reproduces MXFP8 ≈ bf16." if same else "MXFP8 does not match bf16 here.")
        )
    if "nvfp4" in names:
        gaps = _gaps(lm, "nvfp4", "bf16", seeds)
        text = "**NVFP4 (Hadamard + SR) vs bf16**: " + _compare(gaps, "below bf16", "above bf16", "inside the scatter")
        if "fp8" in names:
            text += "; vs the FP8 run " + _compare(
                _gaps(lm, "nvfp4", "fp8", seeds), "below FP8", "above FP8 (NVIDIA: comparable)", "inside the scatter"
            )
        out.append(text + ".")
    for run, label in (("nvfp4", "both"), ("nvfp4_hadamard", "Hadamard only"), ("nvfp4_sr", "SR only")):
        if run in names and "nvfp4_neither" in names:
            verdict = _compare(
                _gaps(lm, run, "nvfp4_neither", seeds),
                "lower, as in NVIDIA's ablations",
                "higher, against NVIDIA's ablations",
                "inside the seed scatter: neither reproduced nor contradicted",
            )
            out.append(f"**NVFP4 with {label} vs neither** (validation loss): {verdict}.")
    if {"nvfp4_neither", "nvfp4_hadamard"} <= set(formats):
        d = snr_db(table[("all", "nvfp4_hadamard")]["dw"]) - snr_db(table[("all", "nvfp4_neither")]["dw"])
        out.append(f"**The Hadamard transform at the GEMM level**: dW's SNR {d:+.2f} dB with it (all kinds pooled).")
    if {"nvfp4_neither", "nvfp4_sr"} <= set(formats) or {"nvfp4_neither", "nvfp4"} <= set(formats):
        sr = "nvfp4_sr" if "nvfp4_sr" in formats else "nvfp4"
        d = snr_db(table[("all", sr)]["dy"]) - snr_db(table[("all", "nvfp4_neither")]["dy"])
        out.append(
            f"**Stochastic rounding at the GEMM level**: dY's SNR {d:+.2f} dB with it: unbiased, and noisier than "
            "nearest rounding, as it must be."
        )
    out.append(
        f"**Not testable here** ({n_params / 1e6:.2f}M parameters, {tokens / 1e6:.2f}M tokens per run): NVIDIA's "
        "scale (12B parameters, 10T tokens) and whatever only shows over long horizons or in the outliers of large "
        "models; NVFP4 against MXFP4 (lpt trains no MXFP4); keeping the last blocks in bf16 (lpt picks the format "
        "per layer kind, and every projection here is in the format); switching to higher precision late in "
        "training; speed (everything is emulated on the CPU)."
    )
    return out


def run(report, quick: bool) -> dict:
    """Add the section to ``report``; return the headline numbers (used by the tests)."""
    names = _QUICK_RUNS if quick else tuple(RUNS)
    seeds = (0,) if quick else (0, 1, 2)
    formats = _QUICK_GEMM_FORMATS if quick else tuple(GEMM_FORMATS)
    lm = lm_runs(names, seeds, Path(report.out_dir) / "formats_runs", quick)
    gemms, cfg = _capture_gemms(lm[("bf16", seeds[0])]["dir"])
    table = _gemm_table(gemms, formats)

    out: dict = {}
    report.section(
        "formats: MXFP8 and NVFP4 matmuls (Blackwell block formats) against bf16 and FP8",
        "NVFP4 (e2m1 in 16-element blocks with e4m3 scales and an f32 tensor scale) with a random Hadamard transform "
        "of the weight-gradient GEMM's inputs, stochastic rounding of the gradients, 16x16 weight blocks and a few "
        "layers in higher precision trains a 12B model over 10T tokens to a loss and downstream accuracy comparable "
        "to an FP8 baseline; leaving out one of these raises the loss. MXFP8 (e4m3 in 32-element blocks with "
        "power-of-two scales) is the 8-bit block format of the same hardware.",
        'NVIDIA, "Pretraining Large Language Models with NVFP4" (arXiv 2509.25149); OCP "Microscaling Formats (MX) '
        'v1.0 Specification"',
    )
    rows = []
    for n in names:
        gaps = _gaps(lm, n, "bf16", seeds)
        out[f"lm/{n}/vs_bf16"], out[f"lm/{n}/spread"] = _spread(gaps)
        out[f"lm/{n}/eval_loss"] = [float(lm[(n, s)]["eval_loss"]) for s in seeds]
        cells = [f"{lm[(n, s)]['eval_loss']:.4f} ({100 * gap:+.2f}%)" for s, gap in zip(seeds, gaps, strict=True)]
        rows.append([n, RUNS[n][2], *cells, "" if n == "bf16" else _pct(gaps)])
    n_params = runs.state_bytes(run_config("bf16", seeds[0], quick))["params"]
    tokens = cfg.train.steps * cfg.train.global_batch * cfg.data.seq_len
    report.text(
        f"tiny LM (n_layers {cfg.model.n_layers}, d_model {cfg.model.d_model}, {cfg.train.steps} steps of "
        f"{cfg.train.global_batch} × {cfg.data.seq_len} tokens, lr {cfg.optim.lr:g} cosine), seeds {seeds}: the "
        "validation loss at the end and its gap to the bf16 run of the same seed; the last column is the mean ± half "
        "the range over seeds. The projections q/k/v, out, up/gate and down are in the format (forward, dX and dW "
        "GEMMs, emulated on the CPU); the LM head stays bf16. Runs resume from `formats_runs/`. "
        f"Machine: {describe()}."
    )
    report.table(["run", "what", *[f"seed {s} (vs bf16)" for s in seeds], "mean vs bf16"], rows)

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    base = lm[("bf16", seeds[0])]["eval"]
    for n in names:
        tr, ev = lm[(n, seeds[0])]["train"], lm[(n, seeds[0])]["eval"]
        (line,) = ax.plot(tr["step"], tr["loss"], lw=1, alpha=0.7, label=n)
        common = np.intersect1d(ev["step"], base["step"])
        rel = [ev["eval_loss"][ev["step"] == s][0] / base["eval_loss"][base["step"] == s][0] - 1 for s in common]
        ax2.plot(common, 100 * np.asarray(rel), "o-", color=line.get_color(), ms=3, label=n)
    ax.set(xlabel="step", ylabel="training loss", title=f"tiny LM, seed {seeds[0]}")
    ax.legend(fontsize=7)
    ax2.axhline(0, color="grey", lw=1)
    ax2.set(xlabel="step", ylabel="validation loss vs bf16 (%)", title="validation loss relative to the bf16 run")
    report.figure(fig, "formats_loss", f"Training loss per format (seed {seeds[0]}); validation loss vs bf16.")

    report.text(
        f"Per GEMM: the {len(gemms)} matmuls of the bf16 run (seed {seeds[0]}, final checkpoint) on its first "
        f"validation batch ({cfg.train.global_batch} × {cfg.data.seq_len} tokens), pooled per layer kind. SNR in dB "
        "against the same GEMM on the bf16 operands with f32 accumulation: *x*, *w*, *dY* the quantized operands "
        "(dY blocked along N, as the dX GEMM takes it), *y*, *dX*, *dW* the format's three GEMM results. Hadamard "
        "and SR change only dY, dX and dW."
        + (
            " fp8 is `blockwise_dot` (e4m3 1×128 / 128×128 f32 scales, dY in e5m2) with K and N zero-padded to its "
            "blocks."
            if "fp8" in formats
            else ""
        )
    )
    rows = []
    for kind in (*KINDS, "all"):
        for fmt in formats:
            snrs = {q: snr_db(table[(kind, fmt)][q]) for q in _QUANTITIES}
            out.update({f"gemm/{kind}/{fmt}/{q}_snr_db": v for q, v in snrs.items()})
            rows.append([kind, fmt, *[f"{snrs[q]:.1f}" for q in _QUANTITIES]])
    report.table(["kind", "format", "x", "w", "dY", "y", "dX", "dW"], rows)

    report.text(
        "Block-scale health (share of blocks): *saturated* (scale above the scale format's largest), *underflow* "
        "(non-zero block, scale below the scale format's smallest normal: clamped at 2^-127 for MX's e8m0, an e4m3 "
        "subnormal or zero for NVFP4) and *clipped* (the block maximum saturates at the element max: MX's floor rule "
        "puts amax / scale in [256, 512) and clips above 464). Each cell: saturated / underflow / clipped."
    )
    rows = []
    for kind in (*KINDS, "all"):
        for fmt in (f for f in ("mxfp8", "nvfp4") if f in formats):
            cells = []
            for op in ("x", "w", "dy"):
                c = table[(kind, fmt)][f"health/{op}"]
                shares = {h: float(c[i] / c[3]) for i, h in enumerate(_HEALTH)}
                out.update({f"health/{kind}/{fmt}/{op}_{h}": v for h, v in shares.items()})
                cells.append(" / ".join(f"{100 * shares[h]:.2f}%" for h in _HEALTH))
            rows.append([kind, fmt, *cells])
    report.table(["kind", "format", "x", "w", "dY"], rows)

    report.text(
        "Which of NVIDIA's findings reproduce at this scale. A loss difference counts only where its mean exceeds "
        "half its range over the seeds (the seeds roughly agree on its sign); with three seeds that is weak "
        "evidence, and differences of a few 0.1% are within what single runs scatter."
    )
    report.text("\n".join(f"* {b}" for b in findings(lm, names, seeds, table, formats, n_params, tokens)))
    return out
