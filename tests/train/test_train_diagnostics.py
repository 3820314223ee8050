"""The trainer's activation diagnostics (train.diagnostics_every): logged on their steps in metrics.jsonl, absent from
the train step's jaxpr, and the config key is required and validated."""

import logging
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest

from lpt.models import matmul_formats, probes
from lpt.train import config as config_lib
from lpt.train import mesh as mesh_lib
from lpt.train import metrics, optimizer
from lpt.train import state as state_lib
from lpt.train import step as step_lib
from lpt.train.loop import train

ROOT = Path(__file__).resolve().parents[2]
# the smallest model with an FP8 matmul: the LM head (K = d_model = 128, N = vocab = 256)
FP8_TINY = {
    "model.d_model": "128",
    "model.n_layers": "1",
    "model.n_heads": "1",
    "model.n_kv_heads": "1",
    "model.d_ff": "32",
    "model.max_seq_len": "8",
    "data.seq_len": "8",
    "precision.compute_dtype": "bfloat16",
    "precision.matmul.lm_head": "fp8",
    "train.global_batch": "2",
    "train.steps": "3",
    "train.eval_every": "3",
    "train.eval_batches": "1",
    "train.log_every": "3",
    "train.diagnostics_every": "2",
    "train.checkpoint_every": "3",
    "optim.warmup_steps": "0",
}


def _cfg(**overrides):
    return config_lib.apply_overrides(config_lib.load_config_file(ROOT / "configs" / "tiny_cpu.py"), overrides)


def test_run_logs_activation_diagnostics_on_their_steps(tmp_path):
    """The loop: diagnostics steps are logged (even off log_every) with the model/attn/ statistics in [0, 1]. The
    run is float32 with d_model 32 to stay cheap (an FP8 run compiles ~2x longer, scanned layers ~2.5x); the FP8 keys
    of the same diagnostics step are checked in test_train_step_jaxpr_has_no_probes, their values in
    tests/models/test_activation_diagnostics.py."""
    logging.getLogger("lpt.train").setLevel(logging.WARNING)
    small = {"model.d_model": "32", "model.n_heads": "2", "model.n_kv_heads": "2", "precision.matmul.lm_head": "bf16"}
    train(_cfg(**{**FP8_TINY, **small}), tmp_path)
    recs = {r["step"]: r for r in metrics.read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r}
    assert sorted(recs) == [2, 3]  # step 2 is logged for its diagnostics although log_every = 3
    diag = {k: v for k, v in recs[2].items() if k.startswith(("model/fp8/", "model/attn/"))}
    assert set(diag) == {"model/attn/repeated_max_frac", "model/attn/repeated_max_frac_max"}
    assert 0.0 <= diag["model/attn/repeated_max_frac"] <= diag["model/attn/repeated_max_frac_max"] <= 1.0, diag
    assert not any(k.startswith("model/attn/") for k in recs[3])  # step 3 is not a diagnostics step


def test_train_step_jaxpr_has_no_probes(monkeypatch):
    cfg = _cfg(**FP8_TINY)
    mesh = mesh_lib.make_mesh(cfg.train.mesh)
    tx = optimizer.make_optimizer(cfg)
    model_def = state_lib.make_model_def(cfg)
    abstract = state_lib.abstract_state(cfg, tx)
    shardings = state_lib.state_shardings(abstract, model_def, mesh)
    step = step_lib.make_train_step(cfg, model_def, tx, optimizer.make_schedule(cfg.optim, 3), mesh, shardings)
    diag_step = step_lib.make_diagnostics_step(cfg.train, model_def, mesh, shardings)
    batch = {k: jax.ShapeDtypeStruct((2, 8), np.int32) for k in ("inputs", "targets")}
    before = str(step.trace(abstract, batch).jaxpr)  # traced only (no compile)
    out = diag_step.trace(abstract.params, abstract.rest, batch, abstract.step).out_info
    fp8 = [f"{n}_frac" for n in ("x_underflow", "x_subnormal", "w_underflow", "w_subnormal")]
    fp8 += ["x_scale_range_log2", "snr_db"]
    attn = ["model/attn/repeated_max_frac", "model/attn/repeated_max_frac_max"]
    assert set(out) == {*(f"model/fp8/lm_head/{n}" for n in fp8), *attn}  # only lm_head is fp8 in this recipe
    assert str(step.trace(abstract, batch).jaxpr) == before

    def boom(*a, **k):
        raise AssertionError("a probe ran in the train step")

    for name in matmul_formats.names():  # every format's probe (the class attribute: a method)
        monkeypatch.setattr(type(matmul_formats.get(name)), "probe", boom)
    monkeypatch.setattr(probes, "record_attention", boom)
    assert str(step.trace(abstract, batch).jaxpr) == before


def test_diagnostics_every_has_a_default_and_is_validated():
    cfg = config_lib.load_config_file(ROOT / "configs" / "tiny_cpu.py")
    assert cfg.train.diagnostics_every == 50
    tree = cfg.to_dict()
    del tree["train"]["diagnostics_every"]  # a config that does not set it gets the default
    assert config_lib.complete(ml_collections.ConfigDict(tree)).train.diagnostics_every == 50
    assert config_lib.apply_overrides(cfg, {"train.diagnostics_every": "5"}).train.diagnostics_every == 5
    with pytest.raises(ValueError, match="diagnostics_every=-1 must be >= 0"):
        _cfg(**{"train.diagnostics_every": "-1"})


def test_block_scaled_layers_report_their_block_health():
    """A recipe with NVFP4 up/gate projections: the diagnostics step's outputs hold the block-format statistics of
    that layer kind (x and w: saturated, underflowed and clipped block shares) and its SNR, and nothing for the bf16
    kinds."""
    cfg = _cfg(**{"precision.matmul.up": "nvfp4", "precision.compute_dtype": "bfloat16"})
    mesh = mesh_lib.make_mesh(cfg.train.mesh)
    model_def = state_lib.make_model_def(cfg)
    abstract = state_lib.abstract_state(cfg, optimizer.make_optimizer(cfg))
    shardings = state_lib.state_shardings(abstract, model_def, mesh)
    diag_step = step_lib.make_diagnostics_step(cfg.train, model_def, mesh, shardings)
    batch = {k: jax.ShapeDtypeStruct((2, 8), np.int32) for k in ("inputs", "targets")}
    out = set(diag_step.trace(abstract.params, abstract.rest, batch, abstract.step).out_info)
    health = {f"model/nvfp4/up/{o}_{n}" for o in "xw" for n in ("scale_saturated_frac", "scale_underflow_frac")}
    health |= {"model/nvfp4/up/x_clipped_frac", "model/nvfp4/up/w_clipped_frac", "model/fp8/up/snr_db"}
    assert {k for k in out if not k.startswith("model/attn/")} == health
