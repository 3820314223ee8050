"""``config.init_from``: a fine-tune starts from another run's checkpoint or a Hugging Face directory.

* f32 source -> f32 fine-tune: the step-0 params are the source's bit for bit, the optimizer is fresh (step 0, zero
  moments), and the origin is in the log, the checkpoints' metadata and summary.json;
* bf16 + Kahan: the bits that bf16 storage drops are in the compensation (``p - c`` = the f32 source to 2^-16
  relative; ``p`` alone is off by up to 2^-9);
* a shape mismatch (a config key, or one tensor) is a one-line error naming it;
* resuming wins: a second start of the fine-tune resumes its own checkpoint, without reading the source;
* a Hugging Face directory (written by ``lpt.models.hf.save_params``) loads the same params;
* on a 4-device mesh (fsdp=4) the params and the compensation land in the train state's shardings, same values.
"""

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import fault_runner
import jax
import numpy as np
import pytest
import shared_run
from cpu_devices import cpu_env
from tiny_run import tiny_config

import lpt.optim
from lpt.models import hf
from lpt.train import checkpoint, init_from, loop
from lpt.train import config as config_lib

BF16_KAHAN = {
    "precision.param_dtype": "bfloat16",
    "precision.compute_dtype": "bfloat16",
    "precision.update_rule": "kahan",
}


def config(**overrides):
    """The source run's config (tests/shared_run.py), then ``overrides``, resolved."""
    return config_lib.resolve(tiny_config({**shared_run.OVERRIDES, **overrides}))


def flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = np.asarray(v)
    return out


def start(cfg):
    """(step-0 state, origin) of ``cfg`` as the trainer builds it."""
    prog = loop.program(cfg, loop.make_mesh(cfg))
    return init_from.initial_state(cfg, prog)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The session's 3-step f32 run (tests/shared_run.py; its weights moved off the init grid), checkpoints at steps
    2 and 3: its workdir, read only."""
    return shared_run.shared_run(tmp_path_factory)[0]


def test_f32_fine_tune_starts_from_the_source_bitwise(source, tmp_path, caplog):
    want, _ = checkpoint.load_params(source)
    cfg = config(**{"init_from.workdir": str(source)})
    state, origin = start(cfg)
    assert origin == {"workdir": str(source.resolve()), "step": 3}
    assert int(state.step) == 0
    got, ref = flat(jax.device_get(state.params)), flat(want)
    assert got.keys() == ref.keys() and len(got) > 5
    for k in ref:
        assert got[k].dtype == np.float32
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")]
    assert len(adam) == 1 and int(adam[0].count) == 0
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(adam[0].mu))  # fresh moments

    # the trainer: logs the origin and records it in the metadata; preempted after step 2 (SIGTERM: step 2 saved, a
    # clean exit). The fine-tune keeps the source's 3-step schedule: the same train step, compiled once for both
    run = tmp_path / "ft"
    ft = config(**{"init_from.workdir": str(source), "train.eval_every": "2"})
    with caplog.at_level(logging.INFO, logger="lpt.train"):
        assert loop.train(ft, run, hooks=fault_runner.hooks(sigterm_at=2)) == {"preempted_at": 2}
    assert f"from init_from.workdir={source.resolve()} (step 3)" in caplog.text
    meta = json.loads(next((run / "checkpoints" / "2" / "metadata").glob("*")).read_text())
    assert meta["init_from"] == origin and meta["step"] == 2

    # a second start resumes the fine-tune's own checkpoint (step 2) and never reads the source; the summary records
    # the origin
    caplog.clear()
    again = config(**{"init_from.workdir": str(tmp_path / "no_such_run"), "train.eval_every": "2"})
    with caplog.at_level(logging.INFO, logger="lpt.train"):
        summary = loop.train(again, run)
    assert "resumed from step 2" in caplog.text and "initialised" not in caplog.text
    assert summary["init_from"] == origin
    meta = json.loads(next((run / "checkpoints" / "3" / "metadata").glob("*")).read_text())
    assert meta["init_from"] == origin and meta["step"] == 3
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]  # steps 1-2 from the first start, 3 resumed


def test_bf16_kahan_keeps_the_dropped_bits_in_the_compensation(source):
    want = flat(checkpoint.load_params(source)[0])
    kahan, _ = start(config(**BF16_KAHAN, **{"init_from.workdir": str(source)}))
    nearest, _ = start(config(**{**BF16_KAHAN, "precision.update_rule": "nearest", "init_from.workdir": str(source)}))
    p = flat(jax.device_get(kahan.params))
    c = flat(jax.device_get(lpt.optim.find_compensation(kahan.opt_state)))
    p_nearest = flat(jax.device_get(nearest.params))
    worst_with, worst_without = 0.0, 0.0
    for k, w in want.items():
        assert p[k].dtype == jax.numpy.bfloat16 and c[k].dtype == jax.numpy.bfloat16
        np.testing.assert_array_equal(p[k], p_nearest[k], err_msg=k)  # the same round-to-nearest storage
        nz = w != 0
        p32, c32 = p[k].astype(np.float32), c[k].astype(np.float32)
        worst_with = max(worst_with, float(np.max(np.abs(p32 - c32 - w)[nz] / np.abs(w[nz]))))
        worst_without = max(worst_without, float(np.max(np.abs(p32 - w)[nz] / np.abs(w[nz]))))
    assert worst_with <= 2.0**-16  # p - c reproduces the f32 source
    assert worst_without > 2.0**-10  # without the compensation the low bits are lost (up to 2^-9)


def test_shape_mismatch_names_the_key(source):
    with pytest.raises(ValueError, match=r"has model.d_model=32 but config.model.d_model=64") as e:
        start(config(**{"init_from.workdir": str(source), "model.d_model": "64"}))
    assert "\n" not in str(e.value)
    cfg = config(**{"init_from.workdir": str(source)})
    prog = loop.program(cfg, loop.make_mesh(cfg))
    params, _ = checkpoint.load_params(source)
    params["blocks"]["0"]["mlp"]["up"]["kernel"] = np.zeros((32, 65), np.float32)  # orbax: string block keys
    with pytest.raises(ValueError, match=r"parameter 'blocks/0/mlp/up/kernel' has shape \(32, 65\); .* \(32, 64\)"):
        init_from.state_from_params(cfg, prog, params, "here")
    with pytest.raises(ValueError, match=r"init_from.step=7 is not a checkpoint of .*; available: \[2, 3\]"):
        start(config(**{"init_from.workdir": str(source), "init_from.step": "7"}))


def test_hugging_face_directory(source, tmp_path):
    params, run_cfg = checkpoint.load_params(source)
    hf.save_params(tmp_path / "hf", params, run_cfg.model)
    state, origin = start(config(**{"init_from.hf": str(tmp_path / "hf")}))
    assert origin == {"hf": str((tmp_path / "hf").resolve())}
    got, ref = flat(jax.device_get(state.params)), flat(params)
    assert got.keys() == ref.keys()
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    with pytest.raises(ValueError, match=r"the config sets model.n_layers=3 \(the source has 1\)"):
        start(config(**{"init_from.hf": str(tmp_path / "hf"), "model.n_layers": "3"}))
    assert Path(tmp_path / "hf" / "config.json").is_file()


def test_the_model_section_comes_from_the_hugging_face_directory(source, tmp_path):
    """tiny_cpu with the source's n_kv_heads states no shape of the source (its model keys are the defaults, or
    equal the source's): with init_from.hf the model section is the directory's; keys set to other shapes are listed
    all at once; a key the user sets on purpose (max_seq_len) is kept."""
    params, run_cfg = checkpoint.load_params(source)
    hf.save_params(tmp_path / "hf", params, run_cfg.model)
    base = config_lib.load_config_file("tiny_cpu")
    run = {"init_from.hf": str(tmp_path / "hf"), "data.seq_len": "16", "train.global_batch": "8"}
    run["model.n_kv_heads"] = str(run_cfg.model.n_kv_heads)  # tiny_cpu sets 2, not the default
    cfg = config_lib.apply_overrides(base, run)
    for key in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
        assert getattr(cfg.model, key) == getattr(run_cfg.model, key), key
    assert config_lib.apply_overrides(base, {**run, "model.max_seq_len": "16"}).model.max_seq_len == 16
    with pytest.raises(
        ValueError, match=r"model.d_ff=128 \(the source has 64\); model.n_layers=3 \(the source has 1\)"
    ):
        config_lib.apply_overrides(base, {**run, "model.n_layers": "3", "model.d_ff": "128"})


SHARDED = """
import sys, ml_dtypes, numpy as np
sys.path[:0] = ["tests/train", "tests"]
import lpt.optim, test_init_from as T
from lpt.train import checkpoint, init_from, loop
cfg = T.config(**{**T.BF16_KAHAN, "init_from.workdir": sys.argv[1], "train.mesh.data": "1", "train.mesh.fsdp": "4"})
prog = loop.program(cfg, loop.make_mesh(cfg))
state, _ = init_from.initial_state(cfg, prog)
comp = lpt.optim.find_compensation(state.opt_state)
want = T.flat(checkpoint.load_params(sys.argv[1])[0])
def get(tree, k):
    for part in k.split("/"):
        tree = tree[int(part) if part.isdigit() else part]
    return tree
split = 0
for k, w in want.items():
    p, c, sh = get(state.params, k), get(comp, k), get(prog.shardings.params, k)
    assert p.sharding.is_equivalent_to(sh, p.ndim) and c.sharding.is_equivalent_to(sh, c.ndim), k
    split += len({str(s.index) for s in p.addressable_shards}) == 4
    p, c = np.asarray(p), np.asarray(c)
    np.testing.assert_array_equal(p, w.astype(ml_dtypes.bfloat16), err_msg=k)  # numpy's cast: nearest even
    np.testing.assert_array_equal(c, (p.astype(np.float32) - w).astype(ml_dtypes.bfloat16), err_msg=k)
print("sharded leaves", split)
"""


def test_sharded_placement_on_four_devices(source):
    env = cpu_env(4)
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-c", textwrap.dedent(SHARDED), str(source)]
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert int(p.stdout.split("sharded leaves")[-1]) >= 5  # the kernels split over fsdp=4
