"""The precision recipes the ``recipes`` and ``cost`` lab sections compare, and how they are built, timed and sized.

A recipe is a ``configs/tiny_cpu*.py`` file plus ``--config.key=value`` overrides: exactly what a user would run with
``python -m lpt.train``. Everything here goes through the trainer's own code (``lpt.train``), so the lab measures the
product, not a re-implementation of it.

* :func:`recipe_config` loads one recipe with extra overrides (strings, as on the command line).
* :func:`state_bytes` counts the persistent bytes per parameter: parameters plus optimizer state, from the abstract
  train state (no allocation).
* :func:`train_step_runner` builds the jitted, donated train step ``python -m lpt.train`` runs, on one device.
* :func:`time_interleaved` times several step functions on the same batches in interleaved rounds and keeps each one's
  best round (the least noisy estimate on a shared machine), so every ratio is against a baseline from the same run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from lpt import data as data_lib
from lpt.train import config as config_lib
from lpt.train import loop, optimizer
from lpt.train import mesh as mesh_lib
from lpt.train import state as state_lib
from lpt.train import step as step_lib

# name -> (config file in configs/, overrides, description). "fp32" is the baseline every ratio is taken against.
RECIPES: dict[str, tuple[str, dict[str, str], str]] = {
    "fp32": ("tiny_cpu.py", {}, "f32 params, f32 compute (baseline)"),
    "f32_master_bf16": ("tiny_cpu.py", {"precision.compute_dtype": "bfloat16"}, "f32 master weights, bf16 compute"),
    "bf16_nearest": ("tiny_cpu_bf16_nearest.py", {}, "bf16 params, round-to-nearest update"),
    "bf16_kahan": ("tiny_cpu_bf16_kahan.py", {}, "bf16 params, Kahan-compensated update"),
    "bf16_sr": ("tiny_cpu_bf16_sr.py", {}, "bf16 params, stochastically rounded update"),
    "bf16_norm_preserving": (
        "tiny_cpu_bf16_nearest.py",
        {"precision.update_rule": "norm_preserving"},
        "bf16 params, norm-preserving update",
    ),
    "fp8": ("tiny_cpu_fp8.py", {}, "blockwise FP8 matmuls"),
    "mxfp8": ("tiny_cpu_mxfp8.py", {}, "MXFP8 matmuls (1x32 e4m3, e8m0 scales)"),
    "nvfp4": ("tiny_cpu_nvfp4.py", {}, "NVFP4 matmuls (Hadamard transform of dW's inputs, SR of gradients)"),
    "gaussws": ("tiny_cpu_gaussws.py", {}, "GaussWS pseudo-quantization training"),
}
BASELINE = "fp32"


def read_metrics(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(train series, eval series) of a run's metrics.jsonl, each ``{key: values}`` with a ``step`` array."""
    train, evals = [], []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        (evals if "eval_loss" in rec else train).append(rec)
    keys = lambda recs: sorted({k for r in recs for k in r})  # a key logged on some steps only (diagnostics) too
    to_arrays = lambda recs: {k: np.array([r.get(k, np.nan) for r in recs], float) for k in keys(recs)}
    return to_arrays(train), to_arrays(evals)


def trained(cfg: config_lib.Config, run_dir: Path) -> dict:
    """Train ``cfg`` into ``run_dir`` (a finished run is only re-read, an interrupted one resumes); returns
    ``{"eval_loss", "unigram", "train", "eval", "dir"}`` with the series of :func:`read_metrics`."""
    summary = loop.train(cfg, run_dir)
    if "preempted_at" in summary:  # a SIGTERM or Ctrl-C: the checkpoint is saved, the same command resumes
        raise SystemExit(
            f"error: the run in {run_dir} was stopped at step {summary['preempted_at']} (checkpoint saved); "
            "run the same command again to resume it"
        )
    tr, ev = read_metrics(run_dir / "metrics.jsonl")
    return {
        "eval_loss": summary["eval_loss"],
        "unigram": summary["unigram_loss"],
        "train": tr,
        "eval": ev,
        "dir": run_dir,
    }


def recipe_config(name: str, overrides: dict[str, str] | None = None):
    """The Config of recipe ``name`` with ``overrides`` (``{"train.steps": "100"}``) applied."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; available: {', '.join(RECIPES)}")
    file, extra, _ = RECIPES[name]
    cfg = config_lib.load_config_file(Path(file).stem)  # a shipped config, by name
    return config_lib.apply_overrides(cfg, {**extra, **(overrides or {})})


def state_bytes(cfg: config_lib.Config) -> dict[str, float]:
    """``{"params": n, "bytes_per_param": (param + optimizer-state bytes) / n, "param_bytes": .., "opt_bytes": ..}``."""
    abstract = state_lib.abstract_state(cfg, optimizer.make_optimizer(cfg))
    nbytes = lambda tree: sum(int(x.size) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
    n = state_lib.count_params(abstract.params)
    p, o = nbytes(abstract.params), nbytes(abstract.opt_state)
    return {"params": n, "param_bytes": p / n, "opt_bytes": o / n, "bytes_per_param": (p + o) / n}


def train_batches(cfg: config_lib.Config, n: int) -> list[dict[str, np.ndarray]]:
    """The first ``n`` training batches of ``cfg`` (one process)."""
    it = data_lib.make_train_iterator(
        cfg.data,
        seq_len=cfg.data.seq_len,
        global_batch=cfg.train.global_batch,
        seed=cfg.data.shuffle_seed,
        process_index=0,
        process_count=1,
    )
    return [next(it) for _ in range(n)]


def train_step_runner(cfg: config_lib.Config) -> tuple[Callable[[dict], jax.Array], int]:
    """``(run, temp_bytes)``: ``run(batch) -> loss`` advances the trainer's jitted step on one device;
    ``temp_bytes`` is XLA's compiled scratch memory of that step (activations, gradients, temporaries)."""
    one_device = config_lib.MeshConfig(data=1, fsdp=1, tensor=1)
    mesh = mesh_lib.make_mesh(one_device, devices=jax.devices()[:1])
    tx = optimizer.make_optimizer(cfg)
    model_def = state_lib.make_model_def(cfg)
    shardings = state_lib.state_shardings(state_lib.abstract_state(cfg, tx), model_def, mesh)
    state = state_lib.create_state(cfg, tx, shardings)
    schedule = optimizer.make_schedule(cfg.optim, cfg.train.steps)
    step = step_lib.make_train_step(cfg, model_def, tx, schedule, mesh, shardings)
    bsh = mesh_lib.batch_sharding(mesh)
    put = lambda batch: {k: jax.device_put(v, bsh) for k, v in batch.items()}
    example = put(train_batches(cfg, 1)[0])
    mem = step.lower(state, example).compile().memory_analysis()
    temp = int(getattr(mem, "temp_size_in_bytes", 0) or 0)
    carry = [state]

    def run(batch):
        carry[0], metrics = step(carry[0], put(batch))
        return metrics["loss"]

    return run, temp


def time_interleaved(
    fns: dict[str, Callable[[dict], jax.Array]], batches: list, rounds: int, progress=None
) -> dict[str, float]:
    """Seconds per step of each ``fns[name](batch)``: two warm-up steps, then ``rounds`` rounds in which every
    function runs over all ``batches`` in turn; the best round per function counts."""
    best = {}
    for name, fn in fns.items():
        for b in batches[:2]:
            jax.block_until_ready(fn(b))
        best[name] = float("inf")
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            for b in batches:
                out = fn(b)
            jax.block_until_ready(out)
            best[name] = min(best[name], (time.perf_counter() - t) / len(batches))
            if progress is not None:
                progress.update(1)
    return best
