"""Section ``headline``: the low-precision recipes against float32 on a GPT-2-small model, one GPU, one table.

Every recipe trains ``configs/gpt2_124m.py`` (12 layers, d 768, 12 heads: 85.8M parameters plus the tied embedding
of a BPE of :data:`VOCAB` ids, 104.7M in all) from the same init on the same batches in the same order for the same
number of tokens, with only ``precision`` changed (:data:`RECIPES`); the table gives each one's final validation loss
against the float32 reference, its goal, the bytes of training state per parameter and its speed. The data needs no
download (:func:`_build_corpus`): the Python sources and documentation of this interpreter's standard library and
installed packages (one document per file, sorted by path), with whole documents held out for validation (the
``jsonl`` source's ``"docs"`` split), tokenized with a byte-level BPE trained by :mod:`lpt.data.train_tokenizer` on
the training documents only.

``python -m lpt.lab headline --out DIR`` is the GPU run (``benchmarks/gpu_quality.sh``): :data:`FULL`'s budget,
sized to finish within about 8 minutes on one H100 with the data preparation and six compiles. ``--quick`` runs the
same recipes end to end on a CPU at a tiny size (a one-layer model of width 128, 100 steps of 16 x 64 tokens, a BPE
of 512 ids on about 1.5 MB): what the tests run. Runs resume from ``DIR/headline_runs/<recipe>``; the corpus and
tokenizer in ``DIR/headline_data`` are built once.
"""

from __future__ import annotations

import json
import logging
import os
import sysconfig
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from lpt.data import documents
from lpt.data.train_tokenizer import train_tokenizer
from lpt.lab import runs
from lpt.train import config as config_lib
from lpt.train.machine import describe

BASELINE = "f32"
_BF16 = {"precision.param_dtype": "bfloat16", "precision.compute_dtype": "bfloat16"}
_FP8 = {f"precision.matmul.{m}": "fp8" for m in ("qkv", "out", "up", "down")}
# name -> (precision overrides, what it is, the goal: largest relative excess of the validation loss over f32, or
# None for the reference and for nearest rounding, whose gap is the point)
RECIPES: dict[str, tuple[dict[str, str], str, float | None]] = {
    "f32": (
        {
            "precision.param_dtype": "float32",
            "precision.compute_dtype": "bfloat16",
            "precision.update_rule": "f32_master",
        },
        "f32 master weights + AdamW, bf16 compute (the reference)",
        None,
    ),
    "bf16_nearest": ({**_BF16, "precision.update_rule": "nearest"}, "bf16 weights, round-to-nearest update", None),
    "bf16_kahan": ({**_BF16, "precision.update_rule": "kahan"}, "bf16 weights + Kahan (kahan_adamw)", 0.005),
    "bf16_sr": ({**_BF16, "precision.update_rule": "stochastic"}, "bf16 weights, stochastic rounding", 0.01),
    "bf16_kahan8": (
        {**_BF16, "precision.update_rule": "kahan", "precision.moment_dtype": "float8_e4m3fn"},
        "bf16 weights + Kahan, 8-bit Adam moments",
        0.005,
    ),
    "fp8": ({**_BF16, **_FP8, "precision.update_rule": "kahan"}, "blockwise FP8 matmuls, bf16 + Kahan", 0.01),
}

VOCAB = 24576  # BPE ids of the GPU run: 18.9M embedding parameters, >= 100M in all
FULL = {  # one H100: 16 x 1024 tokens per step, 360 steps = 5.9M tokens per recipe
    "train.steps": "360",
    "train.global_batch": "16",
    "optim.lr": "6e-4",
    "optim.warmup_steps": "36",
    "train.eval_every": "60",
    "train.eval_batches": "8",
    "train.checkpoint_every": "360",
    "train.keep_checkpoints": "1",
    "train.diagnostics_every": "0",
    "train.log_every": "10",
}
QUICK = {  # 2 CPU cores: about 10 s per recipe, most of it compiling
    **FULL,
    "model.d_model": "128",  # FP8 blocks need K and N multiples of 128
    "model.n_layers": "1",
    "model.n_heads": "4",
    "model.n_kv_heads": "4",
    "model.d_ff": "384",
    "model.max_seq_len": "64",
    "model.remat": "false",
    "data.seq_len": "64",
    "data.worker_count": "0",
    "train.steps": "100",
    "optim.lr": "1e-3",  # as the recipes section: late updates fall below half an ulp of the bf16 weights
    "optim.warmup_steps": "10",
    "train.eval_every": "50",
    "train.eval_batches": "2",
    "train.checkpoint_every": "100",
    "train.log_every": "5",
}
CORPUS_BYTES = {False: 32_000_000, True: 1_500_000}  # text gathered for the GPU run / --quick
_VALIDATION_FRACTION = 0.03  # of the documents (by content hash)
_SUFFIXES = (".py", ".rst", ".txt", ".md")
_MAX_DOC = 200_000  # bytes; larger files (generated tables, data) are skipped


def _build_corpus(directory: Path, max_bytes: int, vocab: int) -> dict:
    """Write ``directory/docs.jsonl`` (one ``{"text": ...}`` per UTF-8 source or documentation file of the standard
    library, then of the installed packages, sorted by path, up to ``max_bytes``) and ``directory/tokenizer.json``
    (a byte-level BPE of ``vocab`` ids trained on the documents the ``"docs"`` split does not hold out); returns the
    corpus's ``meta.json``. Built once: a directory whose ``meta.json`` records the same request is reused."""
    meta_path = directory / "meta.json"
    want = {"max_bytes": max_bytes, "vocab": vocab, "validation_fraction": _VALIDATION_FRACTION}
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if {k: meta.get(k) for k in want} == want:
            return meta
    directory.mkdir(parents=True, exist_ok=True)
    docs, train_text, total = 0, [], 0
    with open(directory / "docs.jsonl", "w", encoding="utf-8") as out:
        for path in _source_files():
            if total >= max_bytes:
                break
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            out.write(json.dumps({"text": text}) + "\n")
            docs, total = docs + 1, total + len(text.encode("utf-8"))
            if not documents.holds_out(text.encode("utf-8"), _VALIDATION_FRACTION):  # str -> UTF-8, as the reader does
                train_text.append(text)
    tok_input = directory / "tokenizer_train.txt"  # the training documents only: validation text is never seen
    tok_input.write_text("\n\n".join(train_text), encoding="utf-8")
    fit = train_tokenizer(
        vocab, str(directory / "tokenizer.json"), str(tok_input), validation_fraction=1e-6, progress=False
    )
    tok_input.unlink()
    meta = {**want, "documents": docs, "bytes": total, "tokenizer_seconds": fit["seconds"]}
    meta_path.write_text(json.dumps(meta, indent=2))
    return meta


def _source_files():
    """The text files of the standard library, then of the installed packages, each group sorted by path."""
    seen = set()
    for key in ("stdlib", "purelib"):
        root = Path(sysconfig.get_paths()[key])
        if root in seen or not root.is_dir():
            continue
        seen.add(root)
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
            for name in filenames:
                p = Path(dirpath) / name
                if p.suffix in _SUFFIXES and p.is_file() and p.stat().st_size <= _MAX_DOC:
                    files.append(p)
        yield from sorted(files)


def configs(quick: bool, recipes=None, overrides=None, data_dir: Path | None = None) -> dict:
    """``{recipe: config}``: configs/gpt2_124m.py with the corpus in ``data_dir``, the budget, the recipe's precision
    and then ``overrides`` (ValueError naming the key for a bad one); attention and the FP8 GEMMs run what
    ``impl="auto"`` picks (on a Hopper GPU the Mosaic GPU kernels). ``data_dir=None``: the same configs on byte
    tokens, which ``python -m lpt.lab`` checks before it writes anything (the corpus and its tokenizer do not exist
    yet)."""
    where = data_dir or Path("headline_data")
    data = {
        "data.source": "jsonl",
        "data.paths": str(where / "docs.jsonl"),
        "data.tokenizer": "bytes" if data_dir is None else str(where / "tokenizer.json"),
        "data.validation_fraction": str(_VALIDATION_FRACTION),
        "data.cache_dir": str(where / "cache"),
        "model.vocab_size": "0",
    }
    budget = QUICK if quick else FULL
    out = {}
    for name in recipes or RECIPES:
        cfg = config_lib.load_config_file("gpt2_124m")
        out[name] = config_lib.apply_overrides(cfg, {**data, **budget, **RECIPES[name][0], **(overrides or {})})
    return out


def run(report, quick: bool, recipes=None, overrides=None) -> dict:
    """Build the corpus, train every recipe of :data:`RECIPES`, write the table and the plot; returns ``{recipe:
    {eval_loss, vs_f32, goal, met, bytes_per_param, tokens_per_sec, speed_vs_f32}, "tokens": ..., ...}``."""
    out_dir = Path(report.out_dir)
    corpus = _build_corpus(out_dir / "headline_data", CORPUS_BYTES[quick], 512 if quick else VOCAB)
    cfgs = configs(quick, overrides=overrides, data_dir=out_dir / "headline_data")
    logging.getLogger("lpt.train").setLevel(logging.WARNING)
    results = {name: runs.trained(cfg, out_dir / "headline_runs" / name) for name, cfg in cfgs.items()}
    base = results[BASELINE]
    tokens_per_step = cfgs[BASELINE].train.global_batch * cfgs[BASELINE].data.seq_len
    speed = {n: float(np.nanmedian(r["train"]["tokens_per_sec"])) for n, r in results.items()}
    out: dict = {"tokens": tokens_per_step * cfgs[BASELINE].train.steps, "unigram": base["unigram"], "corpus": corpus}
    rows = []
    for name, r in results.items():
        vs = r["eval_loss"] / base["eval_loss"] - 1.0
        goal = RECIPES[name][2]
        out[name] = {
            "eval_loss": r["eval_loss"],
            "vs_f32": vs,
            "goal": goal,
            "met": None if goal is None else bool(vs <= goal),
            "bytes_per_param": runs.state_bytes(cfgs[name])["bytes_per_param"],
            "tokens_per_sec": speed[name],
            "speed_vs_f32": speed[name] / speed[BASELINE],
        }
        o = out[name]
        rows.append(
            [
                name,
                RECIPES[name][1],
                round(o["bytes_per_param"], 2),
                round(o["eval_loss"], 4),
                "-" if name == BASELINE else f"{100 * vs:+.2f}%",
                "-" if goal is None else f"<= +{100 * goal:g}%: {'met' if o['met'] else 'missed'}",
                f"{speed[name]:,.0f}",
                f"{o['speed_vs_f32']:.2f}x",
            ]
        )
    report.section(
        "headline: low-precision recipes against float32 on a GPT-2-small model",
        "bf16 weights with Kahan-compensated updates (also with 8-bit moments) end within 0.5% of f32-master "
        "training, stochastic rounding and blockwise FP8 matmuls within 1%, while nearest rounding ends visibly "
        "worse; the low-precision recipes hold fewer bytes per parameter and train faster.",
        "Zamirai et al.; DeepSeek-V3 (blockwise FP8); the goals of this repository",
    )
    c0 = cfgs[BASELINE]
    report.text(
        f"Model: {c0.model.kind} d{c0.model.d_model} L{c0.model.n_layers}, BPE of {corpus['vocab']} ids. Data: "
        f"{corpus['documents']} documents ({corpus['bytes'] / 1e6:.1f} MB of this Python's sources and docs), "
        f"{100 * _VALIDATION_FRACTION:g}% held out by document. Budget: {c0.train.steps} steps of "
        f"{c0.train.global_batch} x {c0.data.seq_len} tokens ({out['tokens'] / 1e6:.2f}M tokens) per recipe, lr "
        f"{c0.optim.lr:g} (cosine, {c0.optim.warmup_steps} warmup steps), same init and batches. Unigram baseline "
        f"{out['unigram']:.4f}. Speed: the median tokens/s of the logged intervals. Machine: {describe()}."
    )
    report.table(["recipe", "what", "bytes/param", "val loss", "vs f32", "goal", "tokens/s", "speed vs f32"], rows)
    fig = plot({n: (r["train"], r["eval"]) for n, r in results.items()}, tokens_per_step, out["unigram"])
    report.figure(
        fig, "headline_loss", "Train loss, validation loss, and validation loss relative to f32 against tokens"
    )
    return out


def plot(series: dict, tokens_per_step: int, unigram: float):
    """The headline figure from ``{recipe: (train series, eval series)}`` (:func:`lpt.lab.runs.read_metrics`): train
    loss, validation loss (the unigram baseline dotted) and each recipe's validation loss relative to the
    :data:`BASELINE`'s at the same step, in percent, against tokens (millions)."""
    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    base = series[BASELINE][1]
    for name, (tr, ev) in series.items():
        ax.plot(tr["step"] * tokens_per_step / 1e6, tr["loss"], lw=1, alpha=0.8, label=name)
        tokens = ev["step"] * tokens_per_step / 1e6
        ax2.plot(tokens, ev["eval_loss"], marker="o", ms=3, label=name)
        at = {s: v for s, v in zip(base["step"], base["eval_loss"], strict=True)}
        rel = [100 * (v / at[s] - 1) if s in at else np.nan for s, v in zip(ev["step"], ev["eval_loss"], strict=True)]
        ax3.plot(tokens, rel, marker="o", ms=3, label=name)
    labels = ("train loss (nats/token)", "validation loss (nats/token)", "validation vs f32 (%)")
    for a, what in zip((ax, ax2, ax3), labels, strict=True):
        a.set_xlabel("tokens (M)")
        a.set_ylabel(what)
        a.legend(fontsize=7)
    ax2.axhline(unigram, color="gray", ls=":", lw=1)
    ax3.axhline(0, color="gray", ls=":", lw=1)
    fig.tight_layout()
    return fig
