"""The training recipe, top to bottom: mesh -> data -> program (model, optimizer, shardings, jitted steps) -> resume
-> loop (log, eval, checkpoint, SIGTERM, NaN guard) -> final eval, plot, summary.

``train(cfg, workdir)`` runs it on a :class:`lpt.train.config.Config` (``python -m lpt.train`` parses the command line
into one and calls it; the lab and the tests call it directly). ``program(cfg, mesh)`` builds the jitted steps and the
sharded layout of the train state without touching data or devices' memory; ``python -m lpt.train.compile`` compiles the
same program ahead of time for a TPU or GPU topology.

Hooks: ``train(..., hooks=[fn, ...])`` calls ``fn(step, checkpointer)`` after each train step is dispatched, before
the preemption check (a hook that sends SIGTERM to its own process makes the run save at that step and exit). The
tests inject faults this way.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

import lpt
from lpt import data as data_lib
from lpt import models
from lpt.train import checkpoint as ckpt_lib
from lpt.train import config as config_lib
from lpt.train import distributed, history, init_from, machine, metrics, optimizer, paths, resume
from lpt.train import mesh as mesh_lib
from lpt.train import state as state_lib
from lpt.train import step as step_lib
from lpt.train import workdir as workdir_lib

log = logging.getLogger("lpt.train")

Hook = Callable[[int, ckpt_lib.Checkpointer], None]


class NonFiniteLossError(RuntimeError):
    """Raised when the training loss, the gradient norm or a parameter becomes NaN or inf."""


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything the loop runs, built from the config and the mesh alone (no data, no device memory)."""

    tx: Any  # optax GradientTransformation
    schedule: Callable  # step -> learning rate
    model_def: state_lib.ModelDef
    abstract: state_lib.TrainState  # ShapeDtypeStructs of the train state
    shardings: state_lib.TrainState  # NamedShardings of the train state on the mesh
    train_step: Callable  # jitted (state, batch) -> (state, metrics), state donated
    eval_step: Callable  # jitted (params, rest, batch) -> loss
    diag_step: Callable | None  # jitted activation-diagnostics pass, None when train.diagnostics_every == 0


def program(cfg: config_lib.Config, mesh: Mesh) -> Program:
    """Model, optimizer, train-state layout and jitted steps of the resolved ``cfg`` (:func:`lpt.train.config.resolve`)
    on ``mesh``."""
    model_def = state_lib.make_model_def(cfg)
    tx = optimizer.make_optimizer(cfg, mesh.size, state_lib.param_shardings(model_def, mesh))
    schedule = optimizer.make_schedule(cfg.optim, cfg.train.steps)
    abstract = state_lib.abstract_state(cfg, tx)
    shardings = state_lib.state_shardings(abstract, model_def, mesh)
    diag_every = cfg.train.diagnostics_every  # 0 = no activation diagnostics pass
    return Program(
        tx=tx,
        schedule=schedule,
        model_def=model_def,
        abstract=abstract,
        shardings=shardings,
        train_step=step_lib.make_train_step(cfg, model_def, tx, schedule, mesh, shardings),
        eval_step=step_lib.make_eval_step(model_def, mesh, shardings),
        diag_step=step_lib.make_diagnostics_step(cfg.train, model_def, mesh, shardings) if diag_every else None,
    )


def make_mesh(cfg: config_lib.Config, devices=None) -> Mesh:
    """The run's mesh; raises ValueError when the global batch or the attention heads do not split over it."""
    mesh = mesh_lib.make_mesh(cfg.train.mesh, devices)
    mesh_lib.check_batch(cfg.train.global_batch, cfg.optim.microbatches, mesh)
    config_lib.check_heads(cfg.model, mesh.shape["tensor"])
    mesh_lib.check_platform(cfg.precision, mesh.devices.flat[0].platform)
    return mesh


def train(cfg: config_lib.Config, workdir: str | Path, *, hooks: Sequence[Hook] = ()) -> dict:
    """Train per ``cfg`` in ``workdir`` (resuming from its newest checkpoint); return the run summary.

    The workdir is locked for the run (a second trainer on it fails at once, naming the holder); a run that already
    finished returns its summary without writing anything. ``workdir`` is a local path or a ``gs://`` URL
    (:mod:`lpt.train.paths`)."""
    cfg = config_lib.resolve(cfg)  # model.vocab_size 0 -> the tokenizer's, so config.json records the size
    is_main = jax.process_index() == 0
    # cleanup: a run that fails before writing anything leaves no new directory (removed while the lock is held)
    with workdir_lib.WorkdirLock(workdir, enabled=is_main, cleanup=True) as lock:
        preempt = distributed.PreemptionFlag()  # from the start: a SIGTERM or Ctrl-C during start-up exits cleanly
        try:
            return _train(cfg, paths.run_path(workdir), hooks, preempt, lock)
        finally:
            preempt.restore()


def _train(
    cfg: config_lib.Config,
    workdir: Path,
    hooks: Sequence[Hook],
    preempt: distributed.PreemptionFlag,
    lock: workdir_lib.WorkdirLock,
) -> dict:
    t_start = time.time()
    is_main = jax.process_index() == 0
    steps, seq_len, global_batch = cfg.train.steps, cfg.data.seq_len, cfg.train.global_batch
    history.check(workdir, ckpt_lib.steps(workdir))  # the run's files of the right kind, its history not orphaned

    # 1. Mesh over all devices of all processes; the batch must split over data*fsdp.
    mesh = make_mesh(cfg)
    if global_batch % jax.process_count():
        raise ValueError(f"train.global_batch={global_batch} is not divisible by {jax.process_count()} processes")
    log.info("mesh %s over %d device(s), %d process(es)", dict(mesh.shape), mesh.size, jax.process_count())

    # 2. Data: this process's slice of every global batch, and fixed validation batches.
    eval_batches, to_global = _eval_data(cfg, mesh)
    unigram = data_lib.unigram_loss(cfg.data, split="validation")
    corpus = data_lib.corpus_identity(cfg.data)  # saved with every checkpoint; a resume needs the same corpus

    # 3. Model, optimizer, the sharded layout of the train state, the jitted steps.
    prog = program(cfg, mesh)

    # 4. Resume from the newest readable checkpoint in workdir, else initialise (from config.init_from if set).
    ckpt = ckpt_lib.Checkpointer(workdir, keep=cfg.train.keep_checkpoints)
    #    A checkpoint whose Adam moments are stored otherwise (precision.moment_dtype) is read in its own layout and
    #    its moments re-stored into this run's (lpt.train.resume).
    layout = state_lib.with_shardings(prog.abstract, prog.shardings)
    try:
        restored = ckpt.restore_latest(layout, cfg, resume.layout_of(cfg, mesh, layout, prog.model_def), corpus)
    except ckpt_lib.AllDamagedError as e:  # the history of the lost steps goes aside with them
        moved = history.move_aside(workdir) if is_main else None
        raise ValueError(f"{e}{f'; the run history that went with them is in {moved}' if moved else ''}") from None
    if restored is None:  # a fresh init, or config.init_from's params (a fine-tune) with a fresh optimizer
        state, origin = init_from.initial_state(cfg, prog)
    else:
        state, meta = restored
        state = resume.convert(state, meta.get("config"), cfg, prog.shardings)
        origin = meta.get("init_from")
        log.info("resumed from step %d (saved on mesh %s, now %s)", int(state.step), meta.get("mesh"), dict(mesh.shape))
    start = int(state.step)
    summary_path = workdir / "summary.json"
    if start >= steps and summary_path.exists():  # finished (a smaller train.steps does not rewrite its results)
        ckpt.close()
        log.info("the run already finished at step %d (%s); nothing to do", start, summary_path)
        return _read_summary(summary_path)
    if start > steps:
        ckpt.close()
        raise ValueError(
            f"the newest checkpoint in {workdir / 'checkpoints'} is step {start}, past train.steps={steps}; "
            f"set train.steps >= {start} to continue it, or use a new --workdir"
        )
    if restored is not None:
        _warn_schedule_change(restored[1].get("config"), cfg, start)
    data_iter = _train_data(cfg, start)

    # 5. The loop. Step s's metrics are fetched after step s+1 is dispatched (keeps the device busy); every
    #    checkpoint is preceded by a finiteness check of all steps so far, so a NaN never reaches a checkpoint.
    #    Every diagnostics_every steps a forward pass on the step's batch and params adds the activation statistics
    #    (model/fp8/..., model/attn/...) to that step's metrics, which are then logged.
    #    Nothing in the workdir is written before the train step compiles: a config that fails leaves it as it was.
    diag_every = cfg.train.diagnostics_every
    t_compile = time.time()  # ahead of time, so that the first tokens/s excludes compilation
    train_step = prog.train_step.lower(state, batch_structs(cfg, mesh)).compile()
    compile_seconds = time.time() - t_compile
    log.info("compiled the train step in %.1f s", compile_seconds)
    writer = metrics.MetricsWriter(workdir, enabled=is_main, drop_after=start)  # forget steps a crash re-runs
    if is_main:
        resolved = json.dumps(cfg.to_dict(), indent=2, sort_keys=True)  # keys sorted, as config.json always had them
        (workdir / "config.json").write_text(resolved + "\n")
        writer.text("config", resolved, start)
    logger = _Logger(cfg, writer, ckpt, start, disable=not is_main)
    t_loop = time.time()
    eval_loss = None

    def evaluate(s: int) -> float:
        losses = [float(prog.eval_step(state.params, state.rest, to_global(b))) for b in eval_batches]
        loss = float(np.mean(losses))
        writer.write(s, {"eval_loss": loss, "unigram_loss": unigram}, prefix="eval")
        logger.show(eval=f"{loss:.3f}")
        return loss

    profile = cfg.train.profile_range
    try:
        if preempt.requested(start):  # a signal during start-up: no new step, nothing to save
            log.warning("stopped during start-up, before step %d; nothing new to save; exiting cleanly", start + 1)
            return {"preempted_at": start}
        for s in range(start + 1, steps + 1):
            if profile and s == profile[0]:
                jax.profiler.start_trace(str(workdir / "profile"))  # TensorBoard's profile plugin opens it
            batch = to_global(next(data_iter))
            diag = None
            if diag_every and s % diag_every == 0:  # ahead of the step: same params, batch and key as its forward
                diag = prog.diag_step(state.params, state.rest, batch, state.step)
            state, step_metrics = train_step(state, batch)
            if profile and s == profile[1]:
                jax.block_until_ready(state)
                jax.profiler.stop_trace()
                log.info("profiled steps %d-%d: trace in %s", *profile, workdir / "profile")
            logger.drain()
            logger.add(s, {**step_metrics, **diag} if diag else step_metrics, diag is not None)
            for hook in hooks:
                hook(s, ckpt)
            stop = preempt.requested(s, sync_every=cfg.train.log_every)
            if s % cfg.train.eval_every == 0 or s == steps:
                logger.drain()
                eval_loss = evaluate(s)
            if s % cfg.train.checkpoint_every == 0 or s == steps or stop:
                logger.drain()
                writer.sync()  # object storage: the records of the steps the checkpoint holds are stored first
                lock.refresh()  # object storage: stop here if another trainer took the workdir's lease over
                ckpt.save(s, state, _metadata(cfg, mesh, s, origin, corpus), force=True)
            if stop:
                ckpt.wait()
                log.warning("preempted: saved checkpoint at step %d in %s; exiting cleanly", s, ckpt.directory)
                return {"preempted_at": s}
        logger.drain()
        if eval_loss is None:  # resumed at the final step: its evaluation is in metrics.jsonl unless the crash lost it
            final = [
                r["eval_loss"] for r in metrics.read_jsonl(writer.jsonl_path) if r["step"] == steps and "eval_loss" in r
            ]
            eval_loss = final[-1] if final else evaluate(steps)
    finally:
        logger.close()
        ckpt.close()
        writer.close()

    # 6. Summary and loss-curve PNG.
    elapsed = time.time() - t_start
    summary = {
        "final_step": steps,
        "eval_loss": eval_loss,
        "unigram_loss": unigram,
        "wall_seconds": elapsed,
        "compile_seconds": compile_seconds,
        "tokens_per_sec": (steps - start) * global_batch * seq_len / (time.time() - t_loop) if steps > start else None,
        "flops_per_token": _flops_per_token(cfg),
        "init_from": origin,  # where the step-0 params came from (lpt.train.init_from)
        "machine": machine.describe(),  # the last digits of eval_loss depend on the CPU/accelerator (docs/training.md)
    }
    if is_main:
        metrics.plot_losses(writer.jsonl_path, workdir / "loss.png", baseline=unigram, title=_title(cfg, workdir))
        summary_path.write_text(json.dumps(summary, indent=2))
        log.info("done: validation loss %.4f vs unigram baseline %.4f (%.0f s)", eval_loss, unigram, elapsed)
    return summary


def _read_summary(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError as e:  # not UTF-8, or not JSON
        raise ValueError(
            f"{path} is not the run's JSON summary ({e}); delete it and run again to rewrite it from the final "
            "checkpoint"
        ) from None


def batch_structs(cfg: config_lib.Config, mesh: Mesh) -> dict:
    """The global batch as sharded ShapeDtypeStructs (int32 [global_batch, seq_len] inputs and targets)."""
    tokens = jax.ShapeDtypeStruct(
        (cfg.train.global_batch, cfg.data.seq_len), np.int32, sharding=mesh_lib.batch_sharding(mesh)
    )
    return {"inputs": tokens, "targets": tokens}


def _train_data(cfg: config_lib.Config, start: int):
    """The iterator of this process's slices of global batches ``start, start + 1, …`` (step ``s`` trains on batch
    ``s − 1``, so a run at step ``start`` continues exactly where it stopped)."""
    shard = dict(process_index=jax.process_index(), process_count=jax.process_count())
    return data_lib.make_train_iterator(
        cfg.data,
        seq_len=cfg.data.seq_len,
        global_batch=cfg.train.global_batch,
        seed=cfg.data.shuffle_seed,
        start=start,
        **shard,
    )


def _eval_data(cfg: config_lib.Config, mesh: Mesh):
    """(fixed validation batches of this process, local batch -> global jax.Array)."""
    seq_len, global_batch = cfg.data.seq_len, cfg.train.global_batch
    shard = dict(process_index=jax.process_index(), process_count=jax.process_count())
    eval_batches = data_lib.make_eval_batches(
        cfg.data, seq_len=seq_len, batch=global_batch, num_batches=cfg.train.eval_batches, **shard
    )
    batch_sharding = mesh_lib.batch_sharding(mesh)

    def to_global(local: dict) -> dict:
        return {k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v)) for k, v in local.items()}

    return eval_batches, to_global


class _Logger:
    """Fetches pending step metrics, stops on a non-finite state, writes every log_every-th step (and steps with
    diagnostics) with tokens/s and MFU, and drives the progress bar."""

    def __init__(
        self,
        cfg: config_lib.Config,
        writer: metrics.MetricsWriter,
        ckpt: ckpt_lib.Checkpointer,
        start: int,
        *,
        disable: bool,
    ):
        self.cfg, self.writer, self.ckpt = cfg, writer, ckpt
        self.tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
        self.flops_per_token, self.peak = _flops_per_token(cfg), metrics.device_peak_flops()
        self.pending: list[tuple[int, dict, bool]] = []
        self.last_time, self.last_step = time.time(), start
        self.postfix: dict[str, str] = {}
        self.bar = tqdm(
            total=cfg.train.steps, initial=start, disable=disable, desc="train", dynamic_ncols=True, mininterval=1.0
        )

    def add(self, s: int, step_metrics: dict, has_diag: bool) -> None:
        self.pending.append((s, step_metrics, has_diag))

    def show(self, **items: str) -> None:
        self.postfix.update(items)
        self.bar.set_postfix(self.postfix, refresh=False)

    def _last_good(self) -> str:
        latest = self.ckpt.manager.latest_step()
        if latest is None:
            return "No checkpoint had been written yet."
        return (
            f"The newest checkpoint is step {latest} in {self.ckpt.directory}, saved from a state checked finite; "
            f"it is kept, and its checksums are verified when a run restores it."
        )

    def drain(self) -> None:
        while self.pending:
            s, m, has_diag = self.pending.pop(0)
            host = {k: float(v) for k, v in m.items()}
            finite = np.isfinite(host["loss"]) and np.isfinite(host["grad_norm"])
            skipping = "skipped" in host  # train.bad_step="skip": the train step leaves a non-finite step out
            if not (finite or skipping) or host["params_finite"] != 1.0:
                raise NonFiniteLossError(
                    f"non-finite training state at step {s} (loss={host['loss']}, grad_norm={host['grad_norm']}, "
                    f"all params finite: {host['params_finite'] == 1.0}): stopping. {self._last_good()} Try a lower "
                    f"optim.lr, a larger optim.warmup_steps, another precision recipe, or train.bad_step=skip."
                )
            if skipping and host["skipped_in_a_row"] > self.cfg.train.max_skips:
                raise NonFiniteLossError(
                    f"step {s} is bad step {int(host['skipped_in_a_row'])} in a row (loss={host['loss']}, "
                    f"grad_norm={host['grad_norm']}), more than train.max_skips={self.cfg.train.max_skips}: "
                    f"stopping. {self._last_good()} Try a lower optim.lr or another precision recipe."
                )
            if skipping and host["skipped"]:
                self.show(skipped=f"{int(host['skipped_total'])}")
                log.warning(
                    "step %d skipped (loss=%s, grad_norm=%s): params and optimizer state unchanged",
                    s,
                    host["loss"],
                    host["grad_norm"],
                )
            self.bar.update(s - self.bar.n)
            if s % self.cfg.train.log_every == 0 or s == self.cfg.train.steps or has_diag:
                now = time.time()
                tok_s = (s - self.last_step) * self.tokens_per_step / max(now - self.last_time, 1e-9)
                host["tokens_per_sec"] = tok_s
                if self.flops_per_token and self.peak:
                    host["mfu"] = tok_s * self.flops_per_token / (self.peak * jax.device_count())
                self.writer.write(s, host)
                self.show(loss=f"{host['loss']:.3f}", tok_s=f"{tok_s:,.0f}")
                self.last_time, self.last_step = now, s

    def close(self) -> None:
        self.bar.close()


def _flops_per_token(cfg: config_lib.Config) -> float:
    return float(models.flops_per_token(cfg.model, cfg.data.seq_len))


def _warn_schedule_change(saved: dict | None, cfg: config_lib.Config, step: int) -> None:
    """Say on stderr when the learning-rate schedule of the resumed run differs from the checkpoint's at ``step``
    (``train.steps`` or an optim key changed): the cosine is stretched or squeezed from there on."""
    if not saved:
        return
    old = config_lib.build(saved)
    if old.train.steps == cfg.train.steps and old.optim == cfg.optim:
        return
    before = float(optimizer.make_schedule(old.optim, old.train.steps)(step + 1))
    after = float(optimizer.make_schedule(cfg.optim, cfg.train.steps)(step + 1))
    if before != after:
        log.warning(
            "the learning-rate schedule differs from the checkpoint's (train.steps %d -> %d, optim %s): lr at step "
            "%d is %.4g instead of %.4g (x%.3g)",
            old.train.steps,
            cfg.train.steps,
            "changed" if old.optim != cfg.optim else "unchanged",
            step + 1,
            after,
            before,
            after / before if before else float("inf"),
        )


def _metadata(cfg: config_lib.Config, mesh: Mesh, s: int, origin: dict | None, corpus: dict) -> dict:
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
        "init_from": origin,  # where the step-0 params came from: {"seed": s}, {"workdir", "step"} or {"hf"}
        "corpus": corpus,  # lpt.data.corpus_identity: a resume on other files behind the same data.paths is refused
        "time": time.time(),
    }


def _title(cfg: config_lib.Config, workdir: Path) -> str:
    """loss.png's title: the run (its workdir's name), then its model and precision recipe."""
    p = cfg.precision
    name = paths.resolve(workdir).name
    return f"{name}: {cfg.model.kind} d{cfg.model.d_model} L{cfg.model.n_layers} | {p.param_dtype} {p.update_rule}"
