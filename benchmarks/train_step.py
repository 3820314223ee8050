"""Tokens/s of the lpt train step relative to a plain Flax+optax float32 step of the same model, in one run.

    python benchmarks/train_step.py [--config configs/tiny_cpu.py] [--steps 20] [--runs plain lpt ...] \
        [--config.key=value ...]

``--runs`` names the steps to time; the first is the baseline of the ratios. ``plain`` is the plain step below;
``NAME`` is lpt's step for the config; ``NAME:key=value,key=value`` is lpt's step with those overrides on top (e.g.
``bf16:precision.matmul.qkv=bf16,precision.matmul.up=bf16``). Each lpt run also prints its MFU (model FLOPs per
token, :func:`lpt.models.flops_per_token`, against the device's bf16 peak) where the peak is known.

Baseline: the same ``lpt.models`` transformer built with the float32 recipe, ``optax.adamw`` (same
hyperparameters), a ``jax.jit`` step with donated params/opt state, nothing else. lpt step: what ``python -m
lpt.train`` runs for the given config (sharded state, f32 loss, clipping, update rule and diagnostics, finiteness
check). Both see the same batches; each is timed over ``--steps`` steps after two warm-up steps, best of 5
interleaved rounds (min is the least noisy estimate on a shared machine). Prints tokens/s of both and
the ratio lpt / baseline.

``--profile DIR`` then traces 3 more steps of each run with ``jax.profiler`` into ``DIR/NAME`` and prints where each
one's device time goes (:mod:`trace_summary`: busy time per step, by kind of kernel, the top kernels).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import trace_summary  # benchmarks/ is the script's directory, first on sys.path
from flax import nnx

from lpt import data as data_lib
from lpt import models
from lpt.models.config import PROJECTIONS
from lpt.train import config as config_lib
from lpt.train import mesh as mesh_lib
from lpt.train import metrics, optimizer
from lpt.train import state as state_lib
from lpt.train import step as step_lib
from lpt.train.machine import describe


def plain_step_fn(cfg):
    """A minimal Flax NNX + optax float32 train step of the same architecture."""
    f32 = dataclasses.replace(  # the same layers with f32 params, compute and master weights
        cfg.precision,
        param_dtype="float32",
        compute_dtype="float32",
        update_rule="f32_master",
        update_impl="xla",
        moment_dtype="auto",
    )
    with nnx.use_eager_sharding(False):
        model = models.build_model(cfg.model, f32, rngs=nnx.Rngs(cfg.train.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(cfg.optim.lr, b1=cfg.optim.b1, b2=cfg.optim.b2, weight_decay=cfg.optim.weight_decay)
    opt_state = tx.init(params)

    def loss_fn(params, inputs, targets):
        logits = nnx.merge(graphdef, params)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    carry = [params, opt_state]

    def run(batch):
        carry[0], carry[1], loss = step(carry[0], carry[1], batch["inputs"], batch["targets"])
        return loss

    return run


def lpt_step_fn(cfg):
    mesh = mesh_lib.make_mesh(cfg.train.mesh)
    tx = optimizer.make_optimizer(cfg)
    model_def = state_lib.make_model_def(cfg)
    shardings = state_lib.state_shardings(state_lib.abstract_state(cfg, tx), model_def, mesh)
    state = state_lib.create_state(cfg, tx, shardings)
    step = step_lib.make_train_step(
        cfg, model_def, tx, optimizer.make_schedule(cfg.optim, cfg.train.steps), mesh, shardings
    )
    bsh = mesh_lib.batch_sharding(mesh)
    carry = [state]

    def run(batch):
        carry[0], metrics = step(carry[0], {k: jax.device_put(v, bsh) for k, v in batch.items()})
        return metrics["loss"]

    return run


def time_steps(runs: dict, batches, rounds: int = 5) -> dict:
    """Best-of-``rounds`` seconds per step for each runner, rounds interleaved (after two warm-up steps each)."""
    for run in runs.values():
        for b in batches[:2]:
            jax.block_until_ready(run(b))
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, run in runs.items():
            t = time.perf_counter()
            for b in batches[2:]:
                out = run(b)
            jax.block_until_ready(out)
            best[name] = min(best[name], (time.perf_counter() - t) / (len(batches) - 2))
    return best


def run_configs(config: str, rest: list[str], runs: list[str]) -> dict:
    """``{name: Config or "plain"}`` for ``--runs``: lpt runs get the command line's overrides, then their own."""
    out = {}
    for run in runs:
        name, _, overrides = run.partition(":")
        if name in out:
            raise SystemExit(f"--runs {run!r}: the name {name!r} is given twice; give each run its own name")
        if run == "plain":
            out[name] = "plain"
            continue
        own = [f"--config.{kv}" for kv in overrides.split(",") if kv]
        out[name], _ = config_lib.parse_args(["--config", config, "--workdir", "/unused", *rest, *own])
    return out


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/tiny_cpu.py")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", nargs="+", default=["plain", "lpt"], help="the first is the baseline")
    parser.add_argument("--profile", default=None, help="trace 3 steps of each run into PROFILE/NAME, summarized")
    args, rest = parser.parse_known_args(argv)
    rest = [*rest, "--config.data.worker_count=0"]  # a few batches read up front: no grain worker processes
    cfg, _ = config_lib.parse_args(["--config", args.config, "--workdir", "/unused", *rest])
    configs = run_configs(args.config, rest, args.runs)
    it = data_lib.make_train_iterator(
        cfg.data, seq_len=cfg.data.seq_len, global_batch=cfg.train.global_batch, process_index=0, process_count=1
    )
    batches = [{k: jnp.asarray(np.asarray(v)) for k, v in next(it).items()} for _ in range(max(args.steps, 3) + 2)]
    tokens = cfg.train.global_batch * cfg.data.seq_len
    runners = {name: plain_step_fn(cfg) if c == "plain" else lpt_step_fn(c) for name, c in configs.items()}
    sec = time_steps(runners, batches)
    base = args.runs[0].partition(":")[0]
    peak = metrics.device_peak_flops()
    print(f"config {args.config}, {tokens} tokens per step; {jax.device_count()} x {jax.devices()[0].device_kind}")
    for name, t in sec.items():
        c = configs[name]
        what = "plain flax+optax f32" if c == "plain" else _recipe(c.precision)
        flops = models.flops_per_token(cfg.model, cfg.data.seq_len) * tokens / t
        mfu = f"MFU {flops / (peak * jax.device_count()):6.1%}" if peak else ""
        print(
            f"{name:>12}: {t * 1e3:8.1f} ms/step {tokens / t:10.0f} tokens/s {sec[base] / t:6.3f}x {base}  {mfu}  "
            f"({what})",
            flush=True,
        )
    print(f"machine: {describe()}")
    if args.profile:
        for name, run in runners.items():
            profile(run, batches[2:5], f"{args.profile}/{name}")
            print(f"--- {name}: {trace_summary.summarize(f'{args.profile}/{name}', steps=3, top=12)}", flush=True)


def profile(run, batches, log_dir: str) -> None:
    """``run`` over ``batches`` under ``jax.profiler.trace(log_dir)`` (with a perfetto trace), after a warm-up."""
    jax.block_until_ready(run(batches[0]))
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for b in batches:
            out = run(b)
        jax.block_until_ready(out)


def _recipe(p) -> str:
    formats = sorted({p.matmul_for(x) for x in PROJECTIONS})
    return (
        f"params {p.param_dtype}, compute {p.compute_dtype}, update {p.update_rule} ({p.update_impl}), "
        f"moments {p.moment_dtype}, matmuls {'/'.join(formats)}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
