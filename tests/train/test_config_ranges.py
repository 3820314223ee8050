"""Each int and float key's allowed range, and bad config files: one ``error:`` line naming the key or the file and
what is allowed, exit code 2, nothing created (in-process, fast: every case fails while the config is parsed)."""

import math

import pytest

from lpt import options
from lpt.data.pipeline import DataConfig
from lpt.models.config import ModelSpec
from lpt.train import config as config_lib
from lpt.train.__main__ import main


def one_error(capsys, argv, tmp_path, monkeypatch) -> str:
    """Run the trainer on ``argv`` in the empty ``tmp_path`` (its workdir ``runs/w`` there): exit code 2, stderr one
    ``error:`` line, nothing created; returns the line."""
    monkeypatch.chdir(tmp_path)
    rc = main([*argv, "--workdir", str(tmp_path / "runs" / "w")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert list(tmp_path.iterdir()) == []
    return err[0]


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=inf", "config key optim.lr=inf must be finite and > 0"),
        ("optim.weight_decay=nan", "config key optim.weight_decay=nan must be finite and >= 0 (0 = none)"),
        ("optim.weight_decay=-0.1", "config key optim.weight_decay=-0.1 must be >= 0 (0 = none)"),
        ("optim.grad_clip=nan", "config key optim.grad_clip=nan must be finite and >= 0 (0 = off)"),
        ("optim.grad_clip=-1", "config key optim.grad_clip=-1.0 must be >= 0 (0 = off)"),
        ("optim.warmup_steps=-1", "config key optim.warmup_steps=-1 must be >= 0 (0 = no warmup)"),
        ("model.norm_eps=-1", "config key model.norm_eps=-1.0 must be > 0"),
        ("model.init_std=nan", "config key model.init_std=nan must be finite and > 0"),
        ("model.rope_theta=0", "config key model.rope_theta=0.0 must be > 0"),
        ("model.rope_scaling.factor=0", "config key model.rope_scaling.factor=0.0 must be > 0"),
        ("precision.attention.beta=1", "config key precision.attention.beta=1.0 must be > 1"),
        ("precision.pqt.loss_weight=-1", "config key precision.pqt.loss_weight=-1.0 must be >= 0"),
        ("data.validation_fraction=0", "config key data.validation_fraction=0.0 must be in (0, 1)"),
        ("train.spike_sigmas=inf", "config key train.spike_sigmas=inf must be finite and >= 0"),
        ("train.mesh.tensor=0", "config key train.mesh.tensor=0 must be >= 1 or -1"),
        ("init_from.step=-2", "config key init_from.step=-2 must be >= 0 or -1 (-1 = the newest)"),
    ],
)
def test_a_value_outside_its_range_is_one_error_line(tmp_path, monkeypatch, capsys, override, message):
    line = one_error(capsys, ["--config", "tiny_cpu", f"--config.{override}"], tmp_path, monkeypatch)
    assert line == f"error: {message}" or line.startswith(f"error: {message} ("), line


def test_every_number_key_states_its_range_and_its_default_is_inside():
    """Each int and float key of the tree has a Range; --help shows it beside the type."""
    numbers = {k: leaf for k, leaf in config_lib.LEAVES.items() if leaf.type in (int, float)}
    assert len(numbers) > 40
    for key, leaf in numbers.items():
        assert isinstance(leaf.bounds, options.Range) and leaf.default in leaf.bounds, key
    help_text = config_lib.schema_help()
    assert "  optim.lr = 0.003  (float > 0)" in help_text
    assert "  init_from.step = -1  (int >= 0 or -1)" in help_text
    assert "  train.seed = 0  (int in [0, 2**63))" in help_text


def test_ranges_hold_for_sections_built_without_the_trainer():
    with pytest.raises(ValueError, match=r"^config key model.norm_eps=0.0 must be > 0$"):
        ModelSpec(norm_eps=0.0)
    with pytest.raises(ValueError, match=r"^config key data.validation_fraction=1.0 must be in \(0, 1\)$"):
        DataConfig(validation_fraction=1.0)


def test_range_membership_and_text():
    r = options.Range(0, 1, high_open=True)
    assert 0.0 in r and 0.5 in r and 1.0 not in r and math.nan not in r and str(r) == "in [0, 1)"
    assert math.inf not in options.at_least(0) and math.inf in options.at_least(0, finite=False)
    assert math.nan not in options.at_least(0, finite=False)  # NaN is never a number a key allows
    assert -1 in options.at_least(1, also=(-1,)) and 0 not in options.at_least(1, also=(-1,))
    assert options.SEED.message(-1) == "a seed in [0, 2**63)" and 2**63 - 1 in options.SEED


def test_a_changed_seed_is_a_resume_conflict():
    saved = config_lib.defaults().to_dict()  # a checkpoint's config, as its metadata holds it
    current = config_lib.with_values(config_lib.build(), {"train.seed": 7})
    assert config_lib.resume_conflicts(saved, current) == ["train.seed=0 -> 7"]


def test_pqt_needs_two_bitwidths():
    with pytest.raises(ValueError, match=r"precision.pqt.b_target=6.0 equals b_init"):
        config_lib.apply_overrides(
            config_lib.load_config_file("tiny_cpu_gaussws"),
            {"precision.pqt.b_init": "6", "precision.pqt.b_target": "6"},
        )


@pytest.mark.parametrize(
    "code, message",
    [
        (
            "def get_config():\n    return None\n",
            "get_config() returned NoneType (None); it must return an ml_collections",
        ),
        ("def get_config():\n    return [1]\n", "get_config() returned list ([1]); it must return an ml_collections"),
        ("import ml_collections\n\ndef get_config(:\n    pass\n", "SyntaxError at line 3: "),
        ("import no_such_module_lpt\n", "ModuleNotFoundError at line 1: No module named 'no_such_module_lpt'"),
        (
            "def get_config():\n    return {'train': {'steps': 1 / 0}}\n",
            "ZeroDivisionError at line 2: division by zero",
        ),
    ],
    ids=["none", "list", "syntax", "missing_module", "raises"],
)
def test_a_bad_config_file_is_one_error_line_naming_it(tmp_path, monkeypatch, capsys, code, message):
    config_dir = tmp_path / "cfg"
    config_dir.mkdir()
    (config_dir / "mine.py").write_text(code)
    runs = tmp_path / "out"
    runs.mkdir()
    line = one_error(capsys, ["--config", str(config_dir / "mine.py")], runs, monkeypatch)
    assert line.startswith(f"error: config file '{config_dir / 'mine.py'}': ") and message in line, line


def test_a_directory_as_config_is_named_as_one(tmp_path, monkeypatch, capsys):
    (tmp_path / "configs").mkdir()
    monkeypatch.chdir(tmp_path)
    rc = main(["--config", "configs", "--workdir", "runs/w"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: config 'configs' is a directory; expected a Python file that defines get_config")
    assert [p.name for p in tmp_path.iterdir()] == ["configs"]


def test_an_fp8_layer_too_small_for_its_blocks_names_the_key_and_the_layer(tmp_path, monkeypatch, capsys):
    argv = ["--config", "tiny_cpu", "--config.precision.matmul.up=fp8", "--config.model.d_ff=192"]
    line = one_error(capsys, argv, tmp_path, monkeypatch)
    assert "precision.matmul.up='fp8' needs K and N multiples of 128" in line and "up weight is 128x192" in line
    argv = ["--config", "tiny_cpu", "--config.precision.matmul.lm_head=fp8", "--config.model.vocab_size=300"]
    line = one_error(capsys, argv, tmp_path, monkeypatch)  # the lm_head's N: the vocabulary, known after resolve
    assert "precision.matmul.lm_head='fp8'" in line and "lm_head weight is 128x300" in line
