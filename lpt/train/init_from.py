"""The first train state of a run: a fresh init from ``train.seed``, or the params of a model to fine-tune.

``config.init_from`` names the source (at most one of the two is set; ``lpt.train.config.InitFromConfig`` checks that):

* ``init_from.workdir``: an lpt run directory (a local path or a ``gs://`` URL, :mod:`lpt.train.paths`); its
  checkpoint at ``init_from.step`` (-1 = the newest), read with :func:`lpt.train.load_params` (verified against the
  checkpoint's checksums);
* ``init_from.hf``: a Hugging Face model directory (``config.json`` + safetensors), read with
  :func:`lpt.models.hf.load_params`.

The trainer calls :func:`initial_state` only when its workdir holds no checkpoint: resuming the run's own checkpoint
always wins over ``init_from``. From a source:

* the model must have the source's shape: the keys of ``config.model`` that shape the parameters (:data:`SHAPE_KEYS`)
  are compared with the source's (the run's saved ``config.model``, or :func:`lpt.models.hf.read_config`), then every
  tensor's path and shape; the first mismatch raises a one-line ValueError naming it. Other ``config.model`` keys that
  differ (``rope_theta``, ``norm_eps``, ...) are allowed (e.g. a context extension) and logged;
* the params are widened to float32 (exact) and stored in the recipe's storage dtype, per leaf the dtype of the train
  state (float32 under ``f32_master``: bit for bit the source's f32 values; otherwise round-to-nearest-even through
  :func:`lpt.numerics.round_nearest`, so no ``astype`` that XLA could keep in f32);
* with ``precision.update_rule="kahan"`` the low bits that the rounding drops go into the optimizer's compensation
  buffer (:func:`lpt.optim.compensation_from_f32`, :func:`lpt.optim.replace_compensation`): ``p - c`` reproduces the
  f32 source to about 2^-17 relative for bf16 params and a bf16 compensation, instead of the 2^-9 of ``p`` alone,
  so the fine-tune starts from the source's values rather than their rounding;
* the optimizer starts fresh (``tx.init``: zero moments, step 0); the model's other variables and any parameter the
  source does not have (only PQT bitwidths, ``.../bitwidth``, which a Hugging Face directory never holds) come from
  the fresh init of ``train.seed``;
* every array is placed directly with the train state's shardings (each device receives only its shards of the host
  copy that loading reads), and one jitted function with ``out_shardings`` builds the state.

:func:`initial_state` returns the state and its *origin*, a small dict the trainer logs in one line and records in
every checkpoint's metadata and in ``summary.json`` (``{"seed": 0}``, ``{"workdir": "/abs/run", "step": 600}``,
``{"hf": "/abs/dir"}``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import lpt.optim
from lpt import numerics, options
from lpt.models import hf
from lpt.models.config import SHAPE_KEYS, ModelSpec
from lpt.train import checkpoint as ckpt_lib
from lpt.train import paths
from lpt.train import state as state_lib
from lpt.train.config import Config

log = logging.getLogger("lpt.train")

# config.model keys that decide the parameters' paths and shapes (max_seq_len too for gpt2's learned positions)
# keys compared for information only: they change the function, not the shapes
_OTHER_KEYS = ("max_seq_len", "rope_theta", "rope_scaling", "norm_eps", "sliding_window")


def _origin_text(origin: dict) -> str:
    """One line for the log: ``init_from.workdir=/abs/run (step 600)``, ``init_from.hf=/abs/dir`` or ``seed 0``."""
    if "workdir" in origin:
        return f"init_from.workdir={origin['workdir']} (step {origin['step']})"
    if "hf" in origin:
        return f"init_from.hf={origin['hf']}"
    return f"a fresh init from train.seed={origin['seed']}"


def initial_state(cfg: Config, prog) -> tuple[state_lib.TrainState, dict]:
    """``(state, origin)``: the step-0 train state of ``cfg`` laid out as ``prog.shardings`` (``prog`` is
    :func:`lpt.train.loop.program`'s), from ``config.init_from`` if set, else a fresh init; see the module docstring."""
    if not (cfg.init_from.workdir or cfg.init_from.hf):
        state = state_lib.create_state(cfg, prog.tx, prog.shardings)
        origin = {"seed": int(cfg.train.seed)}
    else:
        params, origin = _load_source(cfg)
        state = state_from_params(cfg, prog, params, _origin_text(origin))
    log.info("initialised %s parameters from %s", f"{state_lib.count_params(state.params):,}", _origin_text(origin))
    return state, origin


def _load_source(cfg: Config) -> tuple[dict, dict]:
    """``(params, origin)``: the source's params (nested dict of numpy arrays, any float dtype) after checking its
    model's shape keys against ``cfg.model``."""
    if cfg.init_from.workdir:
        workdir = paths.resolve(os.path.expanduser(cfg.init_from.workdir), what="init_from.workdir")
        step = _source_step(workdir, cfg.init_from.step)
        where = f"init_from.workdir={cfg.init_from.workdir!r} (step {step})"
        params, run_cfg = ckpt_lib.load_params(workdir, step)
        _check_model(run_cfg.model.to_dict(), cfg.model.to_dict(), where, scan=True)
        return params, {"workdir": str(workdir), "step": step}
    path = Path(cfg.init_from.hf).expanduser().resolve()
    where = f"init_from.hf={cfg.init_from.hf!r}"
    if not path.is_dir():
        raise ValueError(f"{where} is not a directory (a Hugging Face model directory: config.json + *.safetensors)")
    _check_model(hf.read_config(path).to_dict(), cfg.model.to_dict(), where, scan=False)
    return hf.load_params(path, cfg.model), {"hf": str(path)}


def _source_step(workdir: Path, step: int) -> int:
    """The checkpoint step ``init_from.step`` names in ``workdir`` (-1: the newest)."""
    steps = ckpt_lib.steps(workdir)
    if not steps:
        raise ValueError(
            f"init_from.workdir={str(workdir)!r} holds no checkpoint (expected {workdir / 'checkpoints'}/<step>/)"
        )
    if step == -1:
        return steps[-1]
    if step not in steps:
        raise ValueError(f"init_from.step={step} is not a checkpoint of {workdir}; available: {steps}")
    return step


def _check_model(source: dict, model: dict, where: str, *, scan: bool) -> None:
    """ValueError naming the first key of :data:`SHAPE_KEYS` (and ``scan_layers`` if ``scan``; ``max_seq_len`` for
    gpt2) where the source's ``config.model`` and this run's differ; the other differing keys are logged."""
    keys = SHAPE_KEYS + (("scan_layers",) if scan else ()) + (("max_seq_len",) if model["kind"] == "gpt2" else ())
    default = options.to_dict(ModelSpec())
    for k in keys:
        if source.get(k, default.get(k)) != model[k]:  # a key the source's config predates has its default
            raise ValueError(
                f"{where} has model.{k}={source.get(k)!r} but config.model.{k}={model[k]!r}; a fine-tune keeps the "
                f"source's shape (set config.model.{k}={source.get(k)!r})"
            )
    other = [f"{k}={source.get(k)!r}->{model[k]!r}" for k in _OTHER_KEYS if k not in keys and source.get(k) != model[k]]
    if other:
        log.info("%s: this run changes config.model %s", where, ", ".join(other))


def _flat(tree) -> dict[str, Any]:
    """``{"blocks/0/attn/q/kernel": leaf}`` of a nested dict (int keys as their digits)."""
    return options.flatten(tree, "/")


def state_from_params(cfg: Config, prog, params: dict, where: str) -> state_lib.TrainState:
    """The step-0 train state with ``params`` (nested dict of host arrays, checked against ``prog.abstract``), stored
    in the state's dtypes, with a fresh optimizer (and the Kahan compensation of the dropped bits), placed as
    ``prog.shardings``."""
    want = _flat(prog.abstract.params)
    got = _flat(params)
    for k in sorted(set(want) | set(got)):
        if k not in want:
            raise ValueError(f"{where}: parameter {k!r} (shape {tuple(np.shape(got[k]))}) is not in config.model")
        if k not in got:
            if k.endswith("/bitwidth"):  # PQT bitwidths: from the fresh init
                continue
            raise ValueError(f"{where}: parameter {k!r} (shape {tuple(want[k].shape)}) is missing from the source")
        shape, needed = tuple(np.shape(got[k])), tuple(want[k].shape)
        if shape != needed:
            raise ValueError(f"{where}: parameter {k!r} has shape {shape}; config.model needs {needed}")
        if not jnp.issubdtype(np.asarray(got[k]).dtype, jnp.floating):  # jnp knows ml_dtypes' bf16 and fp8
            raise ValueError(f"{where}: parameter {k!r} has dtype {np.asarray(got[k]).dtype}; expected a float")
    param_sh = _flat(prog.shardings.params)
    given = {}
    for k, x in got.items():
        x32 = np.asarray(x, dtype=np.float32)  # source dtype -> f32: exact widening (f32: no copy)
        given[k] = jax.make_array_from_callback(x32.shape, param_sh[k], lambda idx, x32=x32: x32[idx])
    kahan = cfg.precision.update_rule == "kahan"
    comp_dtypes = _flat(lpt.optim.find_compensation(prog.abstract.opt_state)) if kahan else {}
    init = state_lib.init_fn(cfg, prog.tx)

    def build(given):
        fresh = init()  # model from train.seed: only its other variables and any bitwidth leaf survive XLA's DCE
        fresh_flat = _flat(fresh.params)
        stored, comp = {}, {}
        for k in want:
            dtype = want[k].dtype
            w32 = given[k] if k in given else fresh_flat[k].astype(jnp.float32)  # storage dtype -> f32 (exact)
            if kahan:
                stored[k], comp[k] = lpt.optim.compensation_from_f32(w32, dtype, comp_dtypes[k].dtype)
            elif dtype == jnp.float32:
                stored[k] = w32
            else:
                stored[k] = numerics.round_nearest(w32, dtype)  # f32 -> storage dtype, round to nearest even
        params = _nest_like(fresh.params, stored)
        opt_state = prog.tx.init(params)
        if kahan:
            opt_state = lpt.optim.replace_compensation(opt_state, _nest_like(fresh.params, comp))
        return state_lib.TrainState(
            step=jnp.zeros((), jnp.int32), params=params, rest=fresh.rest, opt_state=opt_state, guard=fresh.guard
        )

    in_sh = {k: param_sh[k] for k in given}
    return jax.jit(build, in_shardings=(in_sh,), out_shardings=prog.shardings)(given)


def _nest_like(template: dict, flat: dict[str, Any], prefix: str = "") -> dict:
    """``flat`` (as from :func:`_flat`) rebuilt with ``template``'s nesting and keys (int block indices kept)."""
    out = {}
    for k, v in template.items():
        name = f"{prefix}{k}"
        out[k] = _nest_like(v, flat, name + "/") if isinstance(v, dict) else flat[name]
    return out
