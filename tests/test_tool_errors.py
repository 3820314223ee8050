"""Bad input to lpt's command-line tools: one ``error: ...`` line on stderr naming the file or key, exit code 2, no
traceback, nothing written; and ``lpt.export`` never overwrites what it did not write.

Each test injects the fault itself (a non-empty or file ``--out``, a truncated tokenizer.json, random bytes as a
SentencePiece model or as model.safetensors, a corrupt config.json, a glob that matches nothing, jax without the
CUDA plugin) and calls the tool's ``main`` in this process.
"""

import hashlib
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_errors import one_error
from shared_run import copy, shared_run
from tiny_run import OVERRIDES, ROOT

from lpt import eval as eval_tool
from lpt import export, generate
from lpt.data import prepare, train_tokenizer
from lpt.train import compile as compile_tool
from lpt.train.__main__ import main as train_main

_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ")  # lpt.train's log lines


def tree(path: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``path``."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in path.rglob("*") if p.is_file()
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The session's finished 3-step tiny run (bytes tokenizer; tests/shared_run.py): read only, a test that changes
    it (or could, were the code under test wrong) works on a copy."""
    return shared_run(tmp_path_factory)[0]


@pytest.fixture(scope="module")
def hf_dir(run, tmp_path_factory) -> Path:
    """The run exported as a Hugging Face directory (not to be modified: copy it)."""
    out = tmp_path_factory.mktemp("hf") / "hf"
    assert export.main(["--workdir", str(run), "--out", str(out)]) == 0
    return out


def _train(capsys, workdir: Path, *overrides: str) -> tuple[int, str]:
    """Run the trainer in this process on the tiny run's model for 1 step; ``(exit code, its error line)``:
    stderr apart from the trainer's log records must be one error line."""
    flags = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
    capsys.readouterr()
    rc = train_main(
        ["--config", str(ROOT / "configs" / "tiny_cpu.py"), "--workdir", str(workdir), *flags, *overrides]
        + ["--config.train.steps=1"]
    )
    err = "\n".join(ln for ln in capsys.readouterr().err.splitlines() if not _LOG_RECORD.match(ln))
    return rc, one_error(err)


# --------------------------------------------------------------------------------------------------------------------
# lpt.export --out


def test_export_refuses_a_non_empty_out_and_leaves_it_as_it_was(run, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    before = tree(out)
    capsys.readouterr()
    assert export.main(["--workdir", str(run), "--out", str(out)]) == 2
    one_error(capsys.readouterr().err, str(out), "--overwrite")
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary sibling left


def test_export_overwrite_replaces_the_directory_as_a_unit(run, hf_dir, tmp_path, capsys):
    """A stale tokenizer.json (the bytes run has none) and other files of an older export do not survive; the new
    directory equals a fresh export; no temporary sibling is left. A missing (nested) or empty --out needs no
    --overwrite."""
    out = tmp_path / "hf"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors", "notes.txt"):
        (out / name).write_text("old export")
    assert export.main(["--workdir", str(run), "--out", str(out), "--overwrite"]) == 0
    assert tree(out) == tree(hf_dir)
    assert set(tree(out)) == {"config.json", "generation_config.json", "model.safetensors"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export.main(["--workdir", str(run), "--out", str(empty)]) == 0
    assert export.main(["--workdir", str(run), "--out", str(tmp_path / "a" / "b")]) == 0
    assert tree(empty) == tree(tmp_path / "a" / "b") == tree(hf_dir)
    assert "error" not in capsys.readouterr().err


@pytest.mark.parametrize("where", ["workdir", "inside", "parent", "symlink"])
def test_export_never_writes_over_the_run_it_exports(run, tmp_path, capsys, where):
    """``--out`` that is the run's workdir, lies inside it, holds it, or is a symlink to it: refused with
    ``--overwrite`` too (the swap would delete the run), every file of the run byte-identical."""
    run = copy(run, tmp_path / "run")
    out = {"workdir": run, "inside": run / "checkpoints", "parent": run.parent, "symlink": tmp_path / "link"}[where]
    if where == "symlink":
        out.symlink_to(run)
    before = tree(run.parent)
    capsys.readouterr()
    assert export.main(["--workdir", str(run), "--out", str(out), "--overwrite"]) == 2
    one_error(capsys.readouterr().err, str(out), "the run's --workdir")
    assert tree(run.parent) == before


def test_export_overwrite_that_fails_keeps_the_old_export(run, tmp_path, monkeypatch):
    """A disk that fills up while the new export is written (an I/O failure, not bad input: it propagates) leaves
    the old directory as it was and no temporary sibling."""
    from lpt.models import hf

    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors").write_text("old export")
    before = tree(out)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf, "write_safetensors", full)
    with pytest.raises(OSError, match="No space left"):
        export.main(["--workdir", str(run), "--out", str(out), "--overwrite"])
    assert tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_out_that_is_a_file(run, tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("not a directory")
    assert export.main(["--workdir", str(run), "--out", str(out), "--overwrite"]) == 2
    one_error(capsys.readouterr().err, str(out), "is a file")
    (tmp_path / "a.txt").write_text("some text\n")
    args = ["--tokenizer", "bytes", "--input", str(tmp_path / "a.txt"), "--out", str(out), "--workers", "1"]
    assert prepare.main(args) == 2
    one_error(capsys.readouterr().err, str(out), "is a file")
    assert out.read_text() == "not a directory"


# --------------------------------------------------------------------------------------------------------------------
# tokenizer files


def _truncated_tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _random_bytes(path: Path) -> None:
    path.write_bytes(np.random.RandomState(0).bytes(300))


# file name -> (how to make it, what the error line says)
BAD_TOKENIZERS = {
    "truncated.json": (_truncated_tokenizer_json, "is not a valid Hugging Face tokenizer.json"),
    "garbage.json": (_random_bytes, "is not a valid Hugging Face tokenizer.json"),
    "garbage.model": (_random_bytes, "is not a valid SentencePiece model"),
    "empty.model": (lambda p: p.write_bytes(b""), "is not a valid SentencePiece model"),
}


@pytest.mark.parametrize("name", sorted(BAD_TOKENIZERS))
def test_prepare_with_a_bad_tokenizer_file(name, tmp_path, capsys):
    make, expected = BAD_TOKENIZERS[name]
    tok = tmp_path / name
    make(tok)
    (tmp_path / "a.txt").write_text("some text\n")
    args = ["--tokenizer", str(tok), "--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "prep")]
    assert prepare.main([*args, "--workers", "1"]) == 2
    one_error(capsys.readouterr().err, str(tok), expected)
    assert not (tmp_path / "prep").exists()


@pytest.mark.parametrize("name", ["truncated.json", "garbage.model"])
def test_training_with_a_bad_tokenizer_file(name, tmp_path, capsys):
    make, expected = BAD_TOKENIZERS[name]
    tok = tmp_path / name
    make(tok)
    rc, line = _train(capsys, tmp_path / "w", f"--config.data.tokenizer={tok}")
    assert rc == 2 and str(tok) in line and expected in line, line
    assert not (tmp_path / "w").exists()


# --------------------------------------------------------------------------------------------------------------------
# input globs and exit codes of the data tools


def test_prepare_and_train_tokenizer_with_a_glob_that_matches_nothing(tmp_path, capsys):
    glob = str(tmp_path / "nothing" / "*.txt")
    assert prepare.main(["--tokenizer", "bytes", "--input", glob, "--out", str(tmp_path / "prep")]) == 2
    one_error(capsys.readouterr().err, f"--input {glob!r} matches no files")
    assert train_tokenizer.main(["--vocab-size", "300", "--out", str(tmp_path / "t.json"), "--input", glob]) == 2
    one_error(capsys.readouterr().err, f"--input {glob!r} matches no files")
    assert train_tokenizer.main(["--vocab-size", "10", "--out", str(tmp_path / "t.json")]) == 2
    one_error(capsys.readouterr().err, "--vocab-size 10")
    (tmp_path / "dir.json").mkdir()
    assert train_tokenizer.main(["--vocab-size", "300", "--out", str(tmp_path / "dir.json")]) == 2
    one_error(capsys.readouterr().err, str(tmp_path / "dir.json"), "is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.json"]


def test_prepare_with_a_corrupt_manifest(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text\n")
    out = tmp_path / "prep"
    out.mkdir()
    (out / "manifest.json").write_text('{"format": 1, "tok')
    args = ["--tokenizer", "bytes", "--input", str(tmp_path / "a.txt"), "--out", str(out), "--workers", "1"]
    assert prepare.main(args) == 2
    one_error(capsys.readouterr().err, str(out / "manifest.json"), "not JSON")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]


# --------------------------------------------------------------------------------------------------------------------
# Hugging Face directories: lpt.eval --hf, lpt.generate --hf and the trainer's init_from.hf


def _corrupt(hf_dir: Path, tmp_path: Path, name: str, content: bytes) -> Path:
    bad = tmp_path / "bad_hf"
    shutil.copytree(hf_dir, bad)
    (bad / name).write_bytes(content)
    return bad


def test_hf_dir_with_random_bytes_as_model_safetensors(hf_dir, tmp_path, capsys):
    size = (hf_dir / "model.safetensors").stat().st_size
    bad = _corrupt(hf_dir, tmp_path, "model.safetensors", np.random.RandomState(0).bytes(size))
    file = str(bad / "model.safetensors")
    capsys.readouterr()
    assert eval_tool.main(["--hf", str(bad)]) == 2
    one_error(capsys.readouterr().err, file, "is not a safetensors file")
    assert generate.main(["--hf", str(bad), "--prompt", "a", "--max-new-tokens", "1"]) == 2
    one_error(capsys.readouterr().err, file, "is not a safetensors file")
    rc, line = _train(capsys, tmp_path / "w", f"--config.init_from.hf={bad}")
    assert rc == 2 and file in line and "is not a safetensors file" in line, line


CORRUPT_CONFIGS = {
    "truncated": (b'{"architectures": ["LlamaForCausalLM"], "hidden_si', "is not a JSON file"),
    "an array": (b"[]", "holds an array; expected a JSON object"),
    "a string size": (b'{"model_type": "llama", "hidden_size": "32"}', "hidden_size='32' is not an integer"),
    "rope without factor": (
        b'{"model_type": "llama", "rope_scaling": {"rope_type": "linear"}}',
        "rope_scaling of rope type 'linear' has no factor",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_CONFIGS))
def test_hf_dir_with_a_corrupt_config_json(case, hf_dir, tmp_path, capsys):
    content, expected = CORRUPT_CONFIGS[case]
    bad = _corrupt(hf_dir, tmp_path, "config.json", content)
    capsys.readouterr()
    assert eval_tool.main(["--hf", str(bad)]) == 2
    one_error(capsys.readouterr().err, str(bad / "config.json"), expected)
    if case == "truncated":  # the trainer reads it with the same function
        rc, line = _train(capsys, tmp_path / "w", f"--config.init_from.hf={bad}")
        assert rc == 2 and str(bad / "config.json") in line and expected in line, line


# --------------------------------------------------------------------------------------------------------------------
# lpt.train.compile without the CUDA plugin


def test_compile_for_a_gpu_without_the_cuda_plugin(monkeypatch, capsys):
    """jax as installed without jax-cuda12-plugin: no topology factory for cuda."""
    from jax._src import xla_bridge

    from lpt import targets

    xla_bridge._discover_and_register_pjrt_plugins()  # what jax finds installed; then drop the CUDA plugin's factory
    monkeypatch.delitem(xla_bridge._topology_factories, "cuda", raising=False)
    targets.devices.cache_clear()
    try:
        rc = compile_tool.main(["--config", str(ROOT / "configs" / "tiny_cpu.py"), "--topology", "h100:1x1x8"])
    finally:
        targets.devices.cache_clear()
    assert rc == 2
    out = capsys.readouterr()
    one_error(out.err, "'h100:1x1x8'", "CUDA plugin", "jax-cuda12-plugin", "'.[dev]'")
    assert out.out == ""


# --------------------------------------------------------------------------------------------------------------------
# summary.json


@pytest.mark.parametrize("fault", ["a directory", "invalid JSON"])
def test_export_eval_generate_do_not_read_summary_json(fault, run, tmp_path, capsys):
    """They read the checkpoint and config.json; a summary.json that is a directory or not JSON changes nothing."""
    run = copy(run, tmp_path / "run")
    summary = run / "summary.json"
    summary.unlink()
    summary.mkdir() if fault == "a directory" else summary.write_text('{"eval_loss": ')
    assert export.main(["--workdir", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert eval_tool.main(["--workdir", str(run), "--batches", "1"]) == 0
    assert generate.main(["--workdir", str(run), "--prompt", "a", "--max-new-tokens", "2"]) == 0
    assert "error" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "module",
    ["lpt.eval", "lpt.export", "lpt.generate", "lpt.data.prepare", "lpt.data.train_tokenizer", "lpt.train.__main__"],
)
def test_help_states_the_whole_first_paragraph(module, capsys):
    """Each command's --help describes it in whole sentences (the docstring's first paragraph, not its first line)."""
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]  # usage, description, options
    assert description.rstrip().endswith("."), description


def test_train_tokenizer_prints_its_summary_line_alone(tmp_path, capfd):
    """Off a terminal, ``lpt.data.train_tokenizer`` writes one line to stdout: no blank lines from the progress bars
    of ``tokenizers`` (written to the file descriptor, hence capfd)."""
    (tmp_path / "a.txt").write_text("hello world hello world\nthe quick brown fox\n")
    argv = ["--vocab-size", "300", "--out", str(tmp_path / "tok.json"), "--input", str(tmp_path / "*.txt")]
    assert train_tokenizer.main(argv) == 0
    out = capfd.readouterr().out
    assert out.splitlines() == [out.strip()] and out.startswith(f"wrote {tmp_path / 'tok.json'}: vocab "), repr(out)


def test_the_loss_plot_title_names_the_run():
    """loss.png's title starts with the run's name (its workdir's), then the model and the precision recipe."""
    import ml_collections

    from lpt.train import loop

    cfg = ml_collections.ConfigDict(
        {
            "model": {"kind": "llama", "d_model": 32, "n_layers": 2},
            "precision": {"param_dtype": "bfloat16", "update_rule": "kahan"},
        }
    )
    assert loop._title(cfg, Path("/runs/bf16_kahan_seed3")) == "bf16_kahan_seed3: llama d32 L2 | bfloat16 kahan"
    assert loop._title(cfg, Path("/runs/x/.")).startswith("x: ")
