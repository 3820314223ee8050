"""``lpt.generate``: greedy decoding equals recomputing the full forward per token, sampling filters (top-k, top-p,
the tokenizer's vocabulary) and seeds, stopping at the end token, streamed text, and the CLI on a trained run
(``--workdir``) and on a Hugging Face directory (``--hf``)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from float_bounds import transformer_logits_sigma
from shared_run import shared_run

import lpt.models as M
from lpt import eval as E
from lpt import generate as G
from lpt.data.tokenizer import ByteTokenizer
from lpt.inference import load_model

ROOT = Path(__file__).resolve().parents[1]
GPT2 = dict(kind="gpt2", vocab_size=256, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=24, init_std=0.3)
PROMPTS = [[5, 9, 200, 17, 3], [42, 7], [1, 2, 3, 4, 5, 6, 7]]


@pytest.fixture(scope="module")
def model():
    return M.build_model(GPT2, {}, rngs=nnx.Rngs(2))


def _reference_greedy(model, prompts, new):
    """Greedy tokens without a cache: the ordinary forward over each row's whole sequence for every new token."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))
    out = []
    for p in prompts:
        seq = np.zeros((1, max(map(len, prompts)) + new - 1), np.int32)  # right padding: causal, so harmless
        seq[0, : len(p)] = p
        for i in range(new):
            t = int(np.asarray(forward(state, jnp.asarray(seq)))[0, len(p) + i - 1].argmax())
            if i < new - 1:
                seq[0, len(p) + i] = t
        out.append(list(seq[0, len(p) : len(p) + new - 1]) + [t])
    return out


def _assert_exact_argmax(model, prompts, generated):
    """Each greedy token leads the runner-up of its exact logits by more than 6σ of either (tests/float_bounds.py's
    rounding error model of an f32 forward; exceeded with probability 2e-9 per logit): every f32 program of the
    model (the cache's, the full forward's, the sampler's) picks it, whatever order XLA:CPU adds its sums in."""
    for p, new in zip(prompts, generated, strict=True):
        logits, sigma = transformer_logits_sigma(model, np.asarray([[*p, *new[:-1]]]))
        steps = np.arange(len(p) - 1, len(p) + len(new) - 1)
        top2 = np.argsort(logits[0, steps], -1)[:, -2:]
        assert top2[:, 1].tolist() == list(new)
        gap = np.diff(np.take_along_axis(logits[0, steps], top2, -1), axis=-1)[:, 0]
        assert np.all(gap > 6 * np.take_along_axis(sigma[0, steps], top2, -1).sum(-1)), gap


def test_greedy_equals_full_forward_per_token(model):
    got = G.generate_tokens(model, PROMPTS, max_new_tokens=8, temperature=0.0)
    _assert_exact_argmax(model, PROMPTS, got)
    assert got == _reference_greedy(model, PROMPTS, 8)
    # the default fills the context: the longest prompt (7) + 18 - 1 = max_seq_len (24)
    assert [len(r) for r in G.generate_tokens(model, [[1]] * 2 + [PROMPTS[2]])] == [18, 18, 18]


def test_seeds_top_k_top_p(model):
    kw = dict(max_new_tokens=12, temperature=1.5)
    a = G.generate_tokens(model, PROMPTS, seed=7, **kw)
    assert a == G.generate_tokens(model, PROMPTS, seed=7, **kw)  # same seed: same tokens
    assert a != G.generate_tokens(model, PROMPTS, seed=8, **kw)
    greedy = G.generate_tokens(model, PROMPTS, max_new_tokens=12, temperature=0.0)
    _assert_exact_argmax(model, PROMPTS, greedy)  # so top_k=1 and a tiny top_p (other programs) pick these tokens
    assert a != greedy
    assert G.generate_tokens(model, PROMPTS, seed=7, top_k=1, **kw) == greedy
    assert G.generate_tokens(model, PROMPTS, seed=7, top_p=1e-6, **kw) == greedy


def test_sample_filters():
    logits = jnp.log(jnp.array([[0.05, 0.5, 0.3, 0.15]], jnp.float32))
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)

    def draws(**kw):
        s = G.Sampling(**{"temperature": 1.0, **kw})
        return np.asarray(jax.vmap(lambda k: G.sample(logits, k, s)[0])(keys))

    free = np.bincount(draws(), minlength=4) / len(keys)
    np.testing.assert_allclose(free, [0.05, 0.5, 0.3, 0.15], atol=0.03)
    assert set(draws(top_k=2)) == {1, 2}
    nucleus = draws(top_p=0.7)  # 0.5 < 0.7 keeps the second token (0.3); 0.8 >= 0.7 drops the rest
    assert set(nucleus) == {1, 2} and abs((nucleus == 1).mean() - 0.5 / 0.8) < 0.03
    assert set(draws(top_p=0.5)) == {1}
    assert set(draws(vocab=1)) == {0}  # ids the tokenizer lacks are never drawn
    hot = np.bincount(draws(temperature=2.0), minlength=4) / len(keys)  # p^(1/2), renormalized
    np.testing.assert_allclose(hot, np.sqrt([0.05, 0.5, 0.3, 0.15]) / np.sqrt([0.05, 0.5, 0.3, 0.15]).sum(), atol=0.03)
    assert int(G.sample(logits, keys[0], G.Sampling(temperature=0.0))[0]) == 1


def test_rows_stop_at_their_stop_token(model):
    free = G.generate_tokens(model, PROMPTS, max_new_tokens=8, temperature=0.0)
    stop = free[0][3]
    got = G.generate_tokens(model, PROMPTS, max_new_tokens=8, temperature=0.0, stop_tokens=[stop])
    assert got == [r[: r.index(stop)] if stop in r else r for r in free]
    assert len(got[0]) == free[0].index(stop) < 8


def test_generate_text_streams_what_it_returns(model):
    pieces = {0: [], 1: []}
    texts = G.generate(
        model,
        ByteTokenizer(),
        ["Once upon", "é"],
        max_new_tokens=10,
        temperature=1.0,
        seed=1,
        on_text=lambda row, text: pieces[row].append(text),
    )
    assert ["".join(pieces[0]), "".join(pieces[1])] == texts
    ids = G.generate_tokens(
        model, [list(b"Once upon"), list("é".encode())], max_new_tokens=10, temperature=1.0, seed=1, stop_tokens=[0]
    )
    assert texts == [bytes(r).decode("utf-8", errors="replace") for r in ids]


def test_text_stream_holds_back_a_cut_utf8_character():
    s = G.TextStream(ByteTokenizer(), list(b"a"))
    assert [s.add(t) for t in "xé".encode()] == ["x", "", "é"]
    assert s.add(0xC3) == "" and s.flush() == "\ufffd" and s.text() == "xé\ufffd"


def test_errors(model):
    tok = ByteTokenizer()
    for kw, msg in [
        (dict(temperature=-1.0), "temperature=-1.0 must be"),
        (dict(top_p=0.0), "top_p=0.0 must be in"),
        (dict(top_p=1.5), "top_p=1.5 must be in"),
        (dict(top_k=300), "top_k=300 must be"),
        (dict(max_new_tokens=0), "max_new_tokens=0 must be"),
        (dict(max_new_tokens=30), "max_new_tokens=30 does not fit"),
    ]:
        with pytest.raises(ValueError, match=msg):
            G.generate(model, tok, ["ab"], **kw)
    with pytest.raises(ValueError, match="longer than config.model.max_seq_len=24"):
        G.generate(model, tok, ["x" * 25])
    with pytest.raises(ValueError, match="non-empty list of strings"):
        G.generate(model, tok, "ab")


# --------------------------------------------------------------------------------------------------------------------
# the CLI


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The session's finished 3-step tiny run (tests/shared_run.py), checkpoints at steps 2 and 3: read only."""
    return shared_run(tmp_path_factory)[0]


def test_cli_workdir(run, capsys):
    assert G.main(["--workdir", str(run), "--prompt", "The ", "--max-new-tokens", "12", "--temperature", "0"]) == 0
    out = capsys.readouterr()
    model, tok, cfg = load_model(run)
    assert cfg.model.d_model == 32 and isinstance(model, M.Transformer)
    want = G.generate(model, tok, ["The "], max_new_tokens=12, temperature=0.0)[0]
    assert out.out == "The " + want + "\n"
    assert "tokens/s after the first step (compilation excluded)" in out.err
    argv = ["--workdir", str(run), "--prompt", "a", "--prompt", "bc", "--max-new-tokens", "5", "--seed", "3"]
    argv += ["--top-k", "20", "--top-p", "0.9", "--dtype", "bfloat16", "--step", "2"]
    assert G.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[0] a") and any(line.startswith("[1] bc") for line in lines)


def test_cli_hf(model, tmp_path, capsys):
    M.save_pretrained(model, tmp_path / "hf")
    argv = ["--hf", str(tmp_path / "hf"), "--prompt", "Hi", "--max-new-tokens", "6", "--temperature", "0"]
    assert G.main(argv) == 0
    want = G.generate(model, ByteTokenizer(), ["Hi"], max_new_tokens=6, temperature=0.0)[0]
    out, err = capsys.readouterr()
    assert out == "Hi" + want + "\n"
    assert "has no tokenizer.json; its 256 ids are read as bytes" in err  # said, not silent


def test_cli_hf_without_tokenizer_refuses_a_vocabulary_that_is_not_bytes(tmp_path, capsys):
    model = M.build_model({**GPT2, "vocab_size": 300}, {}, rngs=nnx.Rngs(0))
    M.save_pretrained(model, tmp_path / "hf")
    assert G.main(["--hf", str(tmp_path / "hf"), "--prompt", "Hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer.json and a vocabulary of 300 ids, not the 256 of bytes" in err


@pytest.mark.parametrize(
    ("argv", "msg"),
    [
        (["--temperature", "-0.5"], "temperature=-0.5 must be"),
        (["--top-p", "0"], "top_p=0.0 must be in (0, 1]"),
        (["--max-new-tokens", "40"], "max_new_tokens=40 does not fit"),
        (["--step", "1"], "step=1 is not a checkpoint"),
    ],
)
def test_cli_errors_are_one_line(run, capsys, argv, msg):
    assert G.main(["--workdir", str(run), "--prompt", "ab", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and msg in err and err.count("\n") == 1
    assert out == ""  # the prompt is echoed only once generation runs


@pytest.mark.parametrize("tool", ["generate", "eval"])
@pytest.mark.parametrize("exists", [False, True], ids=["missing", "empty"])
def test_read_only_tools_create_nothing_in_a_wrong_workdir(tmp_path, capsys, tool, exists):
    workdir = tmp_path / "does" / "not" / "exist"
    if exists:
        workdir.mkdir(parents=True)
    argv = ["--workdir", str(workdir)] + (["--prompt", "ab"] if tool == "generate" else [])
    assert (G.main if tool == "generate" else E.main)(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    what = "holds no checkpoints/ directory" if exists else "does not exist"
    assert err[-1] == f"error: --workdir {str(workdir)!r} {what}; give the directory of an lpt run"
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == (
        [Path("does"), Path("does/not"), Path("does/not/exist")] if exists else []
    )
