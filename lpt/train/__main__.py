"""``python -m lpt.train --config configs/tiny_cpu.py --workdir runs/tiny [--config.key=value ...]``

The whole training recipe, top to bottom: config -> processes -> mesh -> data -> model/optimizer/state -> resume ->
jitted steps -> loop (log, eval, checkpoint, SIGTERM, NaN guard) -> final eval, checkpoint, plot, summary.
``train(cfg, workdir)`` is the same recipe as a function (tests call it).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

import lpt
from lpt import data as data_lib
from lpt.train import checkpoint as ckpt_lib
from lpt.train import config as config_lib
from lpt.train import distributed, machine, metrics, optimizer
from lpt.train import mesh as mesh_lib
from lpt.train import state as state_lib
from lpt.train import step as step_lib

log = logging.getLogger("lpt.train")


class NonFiniteLossError(RuntimeError):
    """Raised when the training loss, the gradient norm or a parameter becomes NaN or inf."""


def train(cfg, workdir: str | Path) -> dict:
    """Train per ``cfg`` in ``workdir`` (resuming from its newest checkpoint); return the run summary."""
    workdir = Path(workdir)
    t_start = time.time()
    is_main = jax.process_index() == 0
    steps, seq_len, global_batch = cfg.train.steps, cfg.data.seq_len, cfg.train.global_batch

    # 1. Mesh over all devices of all processes; the batch must split over data*fsdp.
    mesh = mesh_lib.make_mesh(cfg.train.mesh)
    mesh_lib.check_batch(global_batch, cfg.optim.microbatches, mesh)
    if global_batch % jax.process_count():
        raise ValueError(f"train.global_batch={global_batch} is not divisible by {jax.process_count()} processes")
    log.info("mesh %s over %d device(s), %d process(es)", dict(mesh.shape), mesh.size, jax.process_count())

    # 2. Data: this process's slice of every global batch, and fixed validation batches.
    shard = dict(process_index=jax.process_index(), process_count=jax.process_count())
    data_iter = data_lib.make_train_iterator(
        cfg.data, seq_len=seq_len, global_batch=global_batch, seed=cfg.data.shuffle_seed, **shard
    )
    eval_batches = data_lib.make_eval_batches(
        cfg.data, seq_len=seq_len, batch=global_batch, num_batches=cfg.train.eval_batches, **shard
    )
    batch_sharding = mesh_lib.batch_sharding(mesh)
    to_global = lambda local: {
        k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v)) for k, v in local.items()
    }
    unigram = data_lib.unigram_loss(cfg.data, split="validation")

    # 3. Model, optimizer and the sharded layout of the train state.
    tx = optimizer.make_optimizer(cfg)
    schedule = optimizer.make_schedule(cfg.optim, steps)
    model_def = state_lib.make_model_def(cfg)
    abstract = state_lib.abstract_state(cfg, tx)
    shardings = state_lib.state_shardings(abstract, model_def, mesh)

    # 4. Resume from the newest readable checkpoint in workdir, else initialise.
    ckpt = ckpt_lib.Checkpointer(workdir, keep=cfg.train.keep_checkpoints)
    restored = ckpt.restore_latest(state_lib.with_shardings(abstract, shardings), data_iter)
    if restored is None:
        state = state_lib.create_state(cfg, tx, shardings)
        log.info("initialised %s parameters", f"{state_lib.count_params(state.params):,}")
    else:
        state, meta = restored
        log.info("resumed from step %d (saved on mesh %s, now %s)", meta["step"], meta["mesh"], dict(mesh.shape))
    start = int(state.step)

    # 5. Jitted steps (state donated) and throughput bookkeeping.
    train_step = step_lib.make_train_step(cfg, model_def, tx, schedule, mesh, shardings)
    eval_step = step_lib.make_eval_step(cfg, model_def, mesh, shardings)
    diag_every = config_lib.get(cfg, "train.diagnostics_every")  # 0 = no activation diagnostics pass
    diag_step = step_lib.make_diagnostics_step(cfg, model_def, mesh, shardings) if diag_every else None
    flops_per_token = _flops_per_token(cfg)
    peak = metrics.device_peak_flops()
    writer = metrics.MetricsWriter(workdir, enabled=is_main, drop_after=start)  # forget steps a crash re-runs
    preempt = distributed.PreemptionFlag()
    metadata = lambda s: _metadata(cfg, mesh, s)
    fault = _FaultInjection()

    def evaluate(s: int) -> float:
        losses = [float(eval_step(state.params, state.rest, to_global(b))) for b in eval_batches]
        loss = float(np.mean(losses))
        writer.write(s, {"eval_loss": loss, "unigram_loss": unigram}, prefix="eval")
        return loss

    # 6. The loop. Step s's metrics are fetched after step s+1 is dispatched (keeps the device busy); every
    #    checkpoint is preceded by a finiteness check of all steps so far, so a NaN never reaches a checkpoint.
    #    Every diagnostics_every steps a forward pass on the step's batch and params adds the activation statistics
    #    (model/fp8/..., model/attn/...) to that step's metrics, which are then logged.
    pending: list[tuple[int, dict, bool]] = []
    last_log_time, last_log_step, eval_loss = time.time(), start, None
    postfix: dict[str, str] = {}
    bar = tqdm(total=steps, initial=start, disable=not is_main, desc="train", dynamic_ncols=True, mininterval=1.0)

    def last_good() -> str:
        latest = ckpt.manager.latest_step()
        if latest is None:
            return "No checkpoint had been written yet."
        return f"The last good checkpoint is step {latest} in {ckpt.directory} (kept intact)."

    def drain() -> None:
        nonlocal last_log_time, last_log_step
        while pending:
            s, m, has_diag = pending.pop(0)
            host = {k: float(v) for k, v in m.items()}
            if not (np.isfinite(host["loss"]) and np.isfinite(host["grad_norm"]) and host["params_finite"] == 1.0):
                raise NonFiniteLossError(
                    f"non-finite training state at step {s} (loss={host['loss']}, grad_norm={host['grad_norm']}, "
                    f"all params finite: {host['params_finite'] == 1.0}): stopping. {last_good()} Try a lower "
                    f"optim.lr, a larger optim.warmup_steps or another precision recipe."
                )
            bar.update(s - bar.n)
            if s % cfg.train.log_every == 0 or s == steps or has_diag:
                now = time.time()
                tok_s = (s - last_log_step) * global_batch * seq_len / max(now - last_log_time, 1e-9)
                host["tokens_per_sec"] = tok_s
                if flops_per_token and peak:
                    host["mfu"] = tok_s * flops_per_token / (peak * jax.device_count())
                writer.write(s, host)
                postfix.update(loss=f"{host['loss']:.3f}", tok_s=f"{tok_s:,.0f}")
                bar.set_postfix(postfix, refresh=False)
                last_log_time, last_log_step = now, s

    try:
        for s in range(start + 1, steps + 1):
            batch = to_global(next(data_iter))
            diag = None
            if diag_every and s % diag_every == 0:  # before the step: same params, batch and key as its forward
                diag = diag_step(state.params, state.rest, batch, state.step)
            state, step_metrics = train_step(state, batch)
            drain()
            pending.append((s, {**step_metrics, **diag} if diag else step_metrics, diag is not None))
            fault.sigterm(s)
            stop = preempt.requested(s, sync_every=cfg.train.log_every)
            if s % cfg.train.eval_every == 0 or s == steps:
                drain()
                eval_loss = evaluate(s)
                postfix["eval"] = f"{eval_loss:.3f}"
                bar.set_postfix(postfix, refresh=False)
            if s % cfg.train.checkpoint_every == 0 or s == steps or stop:
                drain()
                ckpt.save(s, state, data_iter, metadata(s), force=True)
            fault.kill(s, ckpt)
            if stop:
                ckpt.wait()
                log.warning("preempted: saved checkpoint at step %d in %s; exiting cleanly", s, ckpt.directory)
                return {"preempted_at": s}
        drain()
        if eval_loss is None:  # resumed at the final step
            eval_loss = evaluate(steps)
    finally:
        bar.close()
        ckpt.close()
        writer.close()
        preempt.restore()

    # 7. Summary and loss-curve PNG.
    elapsed = time.time() - t_start
    summary = {
        "final_step": steps,
        "eval_loss": eval_loss,
        "unigram_loss": unigram,
        "wall_seconds": elapsed,
        "tokens_per_sec": (steps - start) * global_batch * seq_len / elapsed,
        "flops_per_token": flops_per_token,
        "machine": machine.describe(),  # the last digits of eval_loss depend on the CPU/accelerator (docs/training.md)
    }
    if is_main:
        metrics.plot_losses(writer.jsonl_path, workdir / "loss.png", baseline=unigram, title=_title(cfg))
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        log.info("done: validation loss %.4f vs unigram baseline %.4f (%.0f s)", eval_loss, unigram, elapsed)
    return summary


def _flops_per_token(cfg) -> float | None:
    from lpt import models

    if not hasattr(models, "flops_per_token"):
        return None
    return float(models.flops_per_token(cfg.model, cfg.data.seq_len))


def _metadata(cfg, mesh, s: int) -> dict:
    import flax
    import optax
    import orbax.checkpoint

    return {
        "step": s,
        "config": json.loads(json.dumps(cfg.to_dict())),
        "versions": {
            "lpt": getattr(lpt, "__version__", "unknown"),
            "jax": jax.__version__,
            "flax": flax.__version__,
            "optax": optax.__version__,
            "orbax": orbax.checkpoint.__version__,
        },
        "mesh": dict(mesh.shape),
        "process_count": jax.process_count(),
        "device_kind": jax.devices()[0].device_kind,
        "data_worker_count": cfg.data.worker_count,
        "time": time.time(),
    }


def _title(cfg) -> str:
    p = cfg.precision
    return f"{cfg.model.kind} d{cfg.model.d_model} L{cfg.model.n_layers} | {p.param_dtype} {p.update_rule}"


class _FaultInjection:
    """Test hooks: LPT_FAULT_SIGTERM_AT_STEP=k sends SIGTERM to itself after step k (only in process
    LPT_FAULT_PROCESS if set); LPT_FAULT_KILL_AT_STEP=k waits for the pending checkpoint and then SIGKILLs itself
    after step k (a hard crash)."""

    def __init__(self):
        only = os.environ.get("LPT_FAULT_PROCESS")
        mine = only is None or int(only) == jax.process_index()
        self.sigterm_at = int(os.environ.get("LPT_FAULT_SIGTERM_AT_STEP", "-1")) if mine else -1
        self.kill_at = int(os.environ.get("LPT_FAULT_KILL_AT_STEP", "-1"))

    def sigterm(self, s: int) -> None:
        if s == self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)

    def kill(self, s: int, ckpt) -> None:
        if s == self.kill_at:
            ckpt.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    if not log.handlers:  # our own handler: libraries may already have configured the root logger
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    try:
        cfg, args = config_lib.parse_args(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    how = distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    log.info("processes: %s; devices: %s", how, jax.devices())
    try:
        train(cfg, args.workdir)
    except NonFiniteLossError as e:
        log.error("%s", e)
        return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
