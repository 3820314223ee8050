"""``python -m lpt.export``: a run trained here for 4 steps (tiny Llama with GQA, a BPE tokenizer.json, vocab_size 0
resolved to the tokenizer's) exported to a Hugging Face directory that transformers loads with the same logits."""

import json
import pydoc_data.topics
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import transformers
from flax import nnx
from tiny_run import train_tiny

from lpt import export
from lpt.models import hf
from lpt.train import load_params

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(workdir, tokenizer.json path) of a 4-step run with checkpoints at steps 2 and 4."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tmp = tmp_path_factory.mktemp("run")
    text = "\n\n".join(list(pydoc_data.topics.topics.values())[:40])
    (tmp / "corpus.txt").write_text(text)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(tmp / "tokenizer.json"))
    overrides = {
        "model.n_layers": "2",
        "model.init_std": "0.2",
        "data.source": "text",
        "data.paths": str(tmp / "corpus.txt"),
        "data.tokenizer": str(tmp / "tokenizer.json"),
        "data.cache_dir": str(tmp / "cache"),
        "train.global_batch": "8",
        "train.steps": "4",
        "train.eval_every": "4",
    }
    train_tiny(tmp / "workdir", overrides)
    return tmp / "workdir", tmp / "tokenizer.json"


def _lpt_logits(cfg, params, tokens):
    model = hf.model_from_params(cfg.model, cfg.precision, params)
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))


def test_export_loads_in_transformers_with_the_same_logits(run, tmp_path, torch):
    workdir, tokenizer = run
    assert export.main(["--workdir", str(workdir), "--out", str(tmp_path / "hf")]) == 0
    out = tmp_path / "hf"
    params, cfg = load_params(workdir)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    assert (
        vocab == cfg.model.vocab_size == transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer)).vocab_size
    )
    assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok("def f(x): return x")["input_ids"]  # the copied tokenizer loads
    # the run's separator, <|endoftext|> = id 1 (after <unk>), is what transformers starts, stops and pads with
    ids = {"bos_token_id": 1, "eos_token_id": 1, "pad_token_id": 1}
    assert json.loads((out / "generation_config.json").read_text()) == ids
    assert hf_tok.convert_tokens_to_ids("<|endoftext|>") == 1
    tm = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(tm).__name__ == "LlamaForCausalLM" and tm.config.num_key_value_heads == 1
    assert (tm.config.eos_token_id, tm.generation_config.eos_token_id, tm.generation_config.pad_token_id) == (1, 1, 1)
    tokens = np.random.RandomState(0).randint(0, vocab, (2, 32)).astype(np.int32)
    with torch.no_grad():
        ref = tm(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    got = _lpt_logits(cfg, params, tokens)
    diff = float(np.abs(got - ref).max())
    print(f"\nexport (step 4): max |lpt - transformers| = {diff:.3g}, max |logit| = {np.abs(ref).max():.3g}")
    assert np.abs(ref).max() > 0.5 and diff <= 1e-4


def test_export_check_compares_with_the_run_and_fails_on_a_wrong_tensor(run, tmp_path, capsys, torch):
    """``--check`` prints the max |diff| of the run's lpt logits and the export's transformers logits; an export whose
    final norm is off by 1% no longer passes (exit 1), while lpt's own reading of the same file would still agree
    with transformers."""
    workdir, _ = run
    assert export.main(["--workdir", str(workdir), "--out", str(tmp_path / "hf"), "--check"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    diff = float(line.split("= ")[1].split(" ")[0])
    assert line.startswith("check: max |lpt - transformers| = ") and "equal within" in line and diff <= 1e-4, line
    tensors = hf.read_tensors(tmp_path / "hf")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * np.float32(1.01)
    hf.write_safetensors(tmp_path / "hf" / "model.safetensors", tensors)
    params, model_cfg, _, _ = export.run_params(workdir)
    bad, scale = export.check(tmp_path / "hf", params, model_cfg)
    assert bad > 1e-4 * max(1.0, scale) and bad > 100 * diff


def test_export_step_picks_that_checkpoint(run, tmp_path):
    workdir, _ = run
    assert export.main(["--workdir", str(workdir), "--out", str(tmp_path / "s2"), "--step", "2"]) == 0
    at2, _ = load_params(workdir, 2)
    exported = hf.load_params(tmp_path / "s2", hf.read_config(tmp_path / "s2"))
    jax.tree.map(np.testing.assert_array_equal, exported, hf._nest(hf._flatten(at2)))
    exported_norm = hf.read_tensors(tmp_path / "s2")["model.norm.weight"]
    assert not np.array_equal(exported_norm, np.asarray(load_params(workdir)[0]["final_norm"]["scale"]))  # step 4's


def test_the_run_config_takes_its_vocab_size_from_the_embedding(run, tmp_path):
    """The trainer records the resolved vocab_size; ``lpt.train.load_params`` sets a recorded 0 to the embedding's
    rows and refuses a size that disagrees with them; without a config in the checkpoint it reads config.json."""
    from tokenizers import Tokenizer

    from lpt.train import checkpoint

    workdir, tokenizer = run
    n = Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)
    assert json.loads((workdir / "config.json").read_text())["model"]["vocab_size"] == n > 0  # configured as 0
    params, cfg = load_params(workdir)
    rows = np.shape(params["embed"]["embedding"])[0]
    saved = cfg.to_dict()
    saved["model"]["vocab_size"] = 0
    assert checkpoint.run_config(workdir, saved, params).model.vocab_size == rows
    saved["model"]["vocab_size"] = rows + 1
    with pytest.raises(ValueError, match=f"vocab_size={rows + 1} but the checkpoint's embedding has {rows} rows"):
        checkpoint.run_config(workdir, saved, params)
    assert checkpoint.run_config(workdir, None, params).model.to_dict() == cfg.model.to_dict()
    with pytest.raises(ValueError, match="records no config and there is no config.json"):
        checkpoint.run_config(tmp_path, None, params)


def test_token_ids_are_the_separator_or_those_of_the_init_from_hf_directory(run, tmp_path):
    """An export's bos/eos/pad: the run's separator (bytes: 0; the run's tokenizer.json: its <|endoftext|>, 1); a run
    started from init_from.hf with that directory's tokenizer takes the ids the directory sets (eos a list here, pad
    left to the separator); with another tokenizer, or once the directory is gone, the separator again."""
    from lpt.train import config as config_lib

    _, tokenizer = run
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 2], "pad_token_id": None}))
    (source / "tokenizer.json").write_bytes(tokenizer.read_bytes())

    def ids(tok, hf_dir=""):
        cfg = config_lib.build({"data": {"tokenizer": str(tok)}, "init_from": {"hf": str(hf_dir)}})
        return tuple(export.token_ids(cfg).values())

    assert ids("bytes") == (0, 0, 0)
    assert ids(tokenizer) == (1, 1, 1)
    assert ids(source / "tokenizer.json", source) == ids(tokenizer, source) == (0, [1, 2], 1)  # the same content
    assert ids("bytes", source) == (0, 0, 0)  # another tokenizer: the source's ids do not apply
    (source / "config.json").unlink()
    assert ids(tokenizer, source) == (1, 1, 1)


def test_export_errors_exit_2(tmp_path, capsys):
    assert export.main(["--workdir", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")]) == 2
    assert f"--workdir {str(tmp_path / 'nothing')!r} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()
    p = subprocess.run([sys.executable, "-m", "lpt.export", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "--workdir" in p.stdout
