"""``python -m lpt.eval``: a trained tiny run evaluated on its own validation batches gives the run's final
``eval_loss`` (the same f32 forward in another XLA program: equal up to f32 rounding); perplexity and bits per byte
follow from it; data overrides, batches and errors."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from float_bounds import gamma, transformer_logits_sigma
from shared_run import shared_run

import lpt.models as M
from lpt import eval as E

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(workdir, summary) of the session's 3-step run with 2 eval batches (tests/shared_run.py), checkpoints at steps
    2 and 3: read only."""
    return shared_run(tmp_path_factory)


def _eval(capsys, *argv):
    assert E.main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    return json.loads(out)


def _loss_tolerance(workdir, batches, batch):
    """|Δ| between two f32 programs' eval loss (mean over batches of each batch's mean cross entropy): a token's
    lse(z) − z_y moves by Σ_v p_v Δz_v + Δz_y, each logit within 6σ per program (tests/float_bounds.py); the
    logsumexp adds V + 8 roundings (exp, log: 2 ulps each) and its sum with the shift; the mean of the positive
    cross entropies rounds by <= γ_n relative, n = tokens per batch."""
    from lpt import data as data_lib
    from lpt.inference import load_model

    model, _, cfg = load_model(workdir)
    kw = dict(seq_len=int(cfg.data.seq_len), batch=batch, num_batches=batches, split="validation")
    tol = 0.0
    for b in data_lib.make_eval_batches(cfg.data, **kw):
        z, sigma = transformer_logits_sigma(model, b["inputs"])
        y = np.asarray(b["targets"])[..., None]
        lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) + z.max(-1, keepdims=True)
        p = np.exp(z - lse)
        ce = (lse - np.take_along_axis(z, y, -1))[..., 0]
        dz = 12 * ((p * sigma).sum(-1) + np.take_along_axis(sigma, y, -1)[..., 0])
        per_token = dz + 2 * (gamma(z.shape[-1] + 8) + 2.0**-23 * np.abs(lse[..., 0]))
        tol += per_token.mean() + 2 * gamma(ce.size) * ce.mean()
    return tol / batches


def test_eval_of_a_run_is_its_final_eval_loss(run, capsys):
    workdir, summary = run
    r = _eval(capsys, "--workdir", workdir)
    # the same batches and f32 forward as the trainer's eval step, in another XLA program
    assert abs(r["loss"] - summary["eval_loss"]) <= _loss_tolerance(workdir, batches=2, batch=4)
    assert r["step"] == 3 and r["batches"] == 2 and r["batch_size"] == 4 and r["seq_len"] == 32
    assert r["tokens"] == 2 * 4 * 32 and r["split"] == "validation"
    assert r["perplexity"] == pytest.approx(math.exp(r["loss"]), rel=1e-12)
    assert r["bytes_per_token"] == 1.0  # the bytes tokenizer
    assert r["data"] == "embedded" and r["tokenizer"] == "bytes"  # what was measured: the text, its tokens
    assert r["bits_per_byte"] == pytest.approx(r["loss"] / math.log(2), rel=1e-12)
    # an earlier checkpoint, one batch, shorter windows: other numbers
    r2 = _eval(capsys, "--workdir", workdir, "--step", 2, "--batches", 1, "--config.data.seq_len=16")
    assert r2["step"] == 2 and r2["seq_len"] == 16 and r2["tokens"] == 1 * 4 * 16
    assert r2["loss"] != r["loss"]
    one = _eval(capsys, "--workdir", workdir, "--batches", 1)
    assert one["loss"] != r["loss"]  # the second batch counts


def test_evaluate_hf_directory(tmp_path, capsys):
    cfg = dict(kind="gpt2", vocab_size=256, d_model=32, n_layers=1, n_heads=2, d_ff=48, max_seq_len=16)
    model = M.build_model(cfg, {}, rngs=nnx.Rngs(0))
    M.save_pretrained(model, tmp_path / "hf")
    assert E.main(["--hf", str(tmp_path / "hf"), "--batches", "2", "--batch-size", "2"]) == 0
    out, err = capsys.readouterr()
    r = json.loads(out)
    assert r["seq_len"] == 16 and r["tokens"] == 2 * 2 * 16  # tiny_cpu's data, seq_len capped at max_seq_len
    assert abs(r["loss"] - math.log(256)) < 0.05  # an untrained model (init_std 0.02) is close to uniform
    assert r["data"] == "embedded" and r["tokenizer"] == "bytes"
    # no tokenizer.json: bytes, said in one line on stderr
    notes = [line for line in err.splitlines() if "tokenizer.json" in line]
    assert notes == [f"note: {tmp_path / 'hf'} has no tokenizer.json; its 256 ids are read as bytes"], err
    # another text and window: named in the result
    text = tmp_path / "doc.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    argv = ["--config.data.source=text", f"--config.data.paths={text}", "--config.data.seq_len=8"]
    argv += [f"--config.data.cache_dir={tmp_path / 'cache'}"]
    r = _eval(capsys, "--hf", tmp_path / "hf", "--batches", 1, "--batch-size", 2, *argv)
    assert r["data"] == f"text:{text}" and r["tokenizer"] == "bytes" and r["seq_len"] == 8 and r["tokens"] == 16


@pytest.mark.parametrize(
    ("argv", "msg"),
    [
        (["--config.data.seq_len=64"], "data.seq_len=64 exceeds the model's max_seq_len=32"),
        (["--config.train.steps=3"], "only config.data keys"),
        (["--config.data.nope=1"], "unknown config key 'data.nope'"),
        (["--batches", "0"], "batches=0 must be a positive int"),
        (["--batches", "100000"], "100000 eval batches of 4"),
    ],
)
def test_errors_are_one_line(run, capsys, argv, msg):
    assert E.main(["--workdir", str(run[0]), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err and err.count("\n") == 1
