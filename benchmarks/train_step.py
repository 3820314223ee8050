"""Tokens/s of the lpt train step relative to a plain Flax+optax float32 step of the same model, in one run.

    python benchmarks/train_step.py [--config configs/tiny_cpu.py] [--steps 20] [--config.key=value ...]

Baseline: the same ``lpt.models`` transformer built with the float32 recipe, ``optax.adamw`` (same
hyperparameters), a ``jax.jit`` step with donated params/opt state, nothing else. lpt step: what ``python -m
lpt.train`` runs for the given config (sharded state, f32 loss, clipping, update rule and diagnostics, finiteness
check). Both see the same batches; each is timed over ``--steps`` steps after two warm-up steps, best of 5
interleaved rounds (min is the least noisy estimate on a shared machine). Prints tokens/s of both and
the ratio lpt / baseline.
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
from flax import nnx

from lpt import data as data_lib
from lpt import models
from lpt.train import config as config_lib
from lpt.train import mesh as mesh_lib
from lpt.train import optimizer
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


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/tiny_cpu.py")
    parser.add_argument("--steps", type=int, default=20)
    args, rest = parser.parse_known_args(argv)
    cfg, _ = config_lib.parse_args(["--config", args.config, "--workdir", "/unused", *rest])
    cfg.data.worker_count = 0  # a few batches read up front: no grain worker processes to outlive the benchmark
    it = data_lib.make_train_iterator(
        cfg.data, seq_len=cfg.data.seq_len, global_batch=cfg.train.global_batch, process_index=0, process_count=1
    )
    batches = [{k: jnp.asarray(np.asarray(v)) for k, v in next(it).items()} for _ in range(args.steps + 2)]
    tokens = cfg.train.global_batch * cfg.data.seq_len
    sec = time_steps({"plain flax+optax f32": plain_step_fn(cfg), "lpt": lpt_step_fn(cfg)}, batches)
    results = {name: tokens / t for name, t in sec.items()}
    for name, t in sec.items():
        print(f"{name:>22}: {t * 1e3:8.1f} ms/step  {tokens / t:10.0f} tokens/s", flush=True)
    p = cfg.precision
    print(
        f"lpt / plain = {results['lpt'] / results['plain flax+optax f32']:.3f}  "
        f"(config {args.config}: params {p.param_dtype}, compute {p.compute_dtype}, update {p.update_rule}; "
        f"{jax.device_count()} x {jax.devices()[0].device_kind})"
    )
    print(f"machine: {describe()}")


if __name__ == "__main__":
    main(sys.argv[1:])
