"""Resuming a run with other Adam moment storage (``precision.moment_dtype``, :mod:`lpt.train.resume`).

A bf16-Kahan run (bf16 moments) resumes with 8-bit moments: the checkpoint is read in its own layout, params, the
Kahan compensation and the step pass through bit for bit, and the moments equal ``lpt.optim.convert_moments`` of the
saved ones bit for bit; the run continues and its next checkpoint holds e4m3 codes and block scales. The same run
is then read back into bf16 moments. Any other recipe change still refuses to resume.
"""

import jax
import numpy as np
import pytest
from run_records import state_arrays, trainer_log
from tiny_run import tiny_config, train_tiny

import lpt.optim as O
from lpt.train import checkpoint as ckpt_lib
from lpt.train import loop, resume
from lpt.train import state as state_lib

E4M3 = "float8_e4m3fn"
KAHAN = {"precision.param_dtype": "bfloat16", "precision.compute_dtype": "bfloat16", "precision.update_rule": "kahan"}


def _restored(workdir, overrides):
    """The trainer's restore of ``workdir``'s newest checkpoint for a run with ``overrides``: (state, metadata)."""
    cfg = tiny_config({**KAHAN, **overrides})
    mesh = loop.make_mesh(cfg)
    prog = loop.program(cfg, mesh)
    layout = state_lib.with_shardings(prog.abstract, prog.shardings)
    ckpt = ckpt_lib.Checkpointer(workdir, keep=5, async_save=False)
    try:
        state, meta = ckpt.restore_latest(layout, cfg, resume.layout_of(cfg, mesh, layout, prog.model_def))
    finally:
        ckpt.close()
    return resume.convert(state, meta.get("config"), cfg, prog.shardings), meta


def _bits(tree) -> dict[str, bytes]:
    """Every array of ``tree`` (NamedTuple states included) by its position, as raw bytes."""
    return {str(i): np.asarray(v).tobytes() for i, v in enumerate(jax.tree.leaves(tree))}


def test_a_run_resumes_with_8_bit_moments_and_back(tmp_path):
    wd = tmp_path / "run"
    train_tiny(wd, {**KAHAN, "train.steps": "2"})  # bf16 moments, checkpoint at step 2
    saved, _ = _restored(wd, {"train.steps": "4"})
    converted, _ = _restored(wd, {"train.steps": "4", "precision.moment_dtype": E4M3})

    assert _bits(converted.params) == _bits(saved.params)
    assert int(converted.step) == int(saved.step) == 2
    assert _bits(O.find_compensation(converted.opt_state)) == _bits(O.find_compensation(saved.opt_state))
    # the 8-bit moments read back in f32 (exact widening) are the saved bf16 ones rounded once: e4m3 keeps 3 mantissa
    # bits (relative error <= 2^-4 per element above its block's subnormal range; sqrt(v) stored: v's <= ~2^-3)
    widen = jax.jit(O.convert_moments, static_argnums=(1, 2))  # one program per state, not one per eager op
    wide = widen(converted.opt_state, E4M3, "float32")
    ref = widen(saved.opt_state, "bfloat16", "float32")
    for a, b in zip(jax.tree.leaves(wide), jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if b.size > 1 and np.any(b):
            assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2.0**-3
    kinds = {np.asarray(v).dtype.name for v in jax.tree.leaves(converted.opt_state)}
    assert {"uint16", "complex64"} <= kinds  # packed e4m3 codes and their block scales

    with trainer_log() as log:  # at INFO (train_tiny keeps the trainer at WARNING)
        summary = loop.train(tiny_config({**KAHAN, "train.steps": "4", "precision.moment_dtype": E4M3}), wd)
    assert any("re-storing Adam's moments from bfloat16" in m for m in log)
    assert summary["final_step"] == 4 and np.isfinite(summary["eval_loss"])
    opt4 = state_arrays(wd, 4, "opt_state")
    assert {"uint16", "complex64"} <= {v.dtype.name for v in opt4.values()}
    assert (wd / "config.json").read_text().count(f'"moment_dtype": "{E4M3}"') == 1

    back, _ = _restored(wd, {"train.steps": "6"})  # back to bf16 moments ("auto" for bf16 params)
    assert {np.asarray(v).dtype.name for v in jax.tree.leaves(back.opt_state)} >= {"uint32", "bfloat16"}
    assert not {"uint16", "complex64"} & {np.asarray(v).dtype.name for v in jax.tree.leaves(back.opt_state)}
    assert int(back.step) == 4

    with pytest.raises(ValueError, match=r"another model, precision recipe.*precision.moment_rounding"):
        train_tiny(wd, {**KAHAN, "train.steps": "8", "precision.moment_rounding": "nearest"})
