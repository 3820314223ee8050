"""Config loading, overrides and validation; mesh resolution; clear errors for bad input (in-process, fast)."""

import re
from pathlib import Path

import pytest
from jax.sharding import AbstractMesh

from lpt.train import config as config_lib
from lpt.train import mesh as mesh_lib
from lpt.train.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.py")


def test_every_config_file_loads_and_validates():
    files = sorted(p for p in (ROOT / "configs").glob("*.py") if p.name != "__init__.py")
    assert len(files) >= 1
    for f in files:
        cfg = config_lib.load_config_file(f)
        assert set(config_lib._flatten(cfg)) == set(config_lib.SCHEMA), f.name
        assert "python -m lpt.train --config configs/" in (f.read_text().split('"""')[1]), f.name


# what a measurement looks like in a config's source: a date, "Expected result", a number with 4+ decimals, a loss, GiB
# per chip or seconds of wall time followed by a number
_MEASURED = re.compile(
    r"\b\d{4}-\d{2}-\d{2}\b|Expected result|\b\d+\.\d{4,}\b|\bloss(?:es)?\b[^.\n]{0,30}?\d\.\d\d"
    r"|\d GiB per chip|\d s wall"
)
_CITED = re.compile(r'docs/results\.md, "([^"]+)"(?: and "([^"]+)")?')


def test_configs_state_no_results_and_cite_docs_results():
    """A shipped config's source holds no dated or measured result; its docstring names, by title, the sections of
    docs/results.md that hold them (each title the start of a heading there)."""
    headings = [
        line.lstrip("#").strip() for line in (ROOT / "docs" / "results.md").read_text().splitlines() if line[:1] == "#"
    ]
    files = sorted((ROOT / "configs").glob("*.py"))
    assert len(files) >= 14
    for f in files:
        text = f.read_text()
        found = _MEASURED.search(text)
        assert not found, f"{f.name} states {found.group(0)!r}: measured results go to docs/results.md"
        if f.name == "__init__.py":
            continue
        cited = [t for m in _CITED.finditer(" ".join(text.split('"""')[1].split())) for t in m.groups() if t]
        assert cited, f"{f.name} names no section of docs/results.md"
        for title in cited:
            assert any(h.startswith(title) for h in headings), f"{f.name}: no section {title!r} in docs/results.md"


def test_override_parsed_with_schema_type():
    cfg, args = config_lib.parse_args(
        [
            "--config",
            TINY,
            "--workdir",
            "/tmp/x",
            "--config.train.steps=7",
            "--config.optim.lr=0.5",
            "--config.model.tie_embeddings=true",
            "--config.precision.pqt.layers=out,down",
        ]
    )
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.optim.lr == 0.5
    assert cfg.model.tie_embeddings is True
    assert tuple(cfg.precision.pqt.layers) == ("out", "down")
    assert args.workdir == "/tmp/x"


def test_unknown_override_key_lists_valid_keys():
    with pytest.raises(ValueError, match=r"unknown config key 'train.stpes'.*did you mean 'train.steps'.*global_batch"):
        config_lib.parse_args(["--config", TINY, "--workdir", "/tmp/x", "--config.train.stpes=5"])


def test_unknown_key_in_config_file_rejected(tmp_path):
    f = tmp_path / "typo.py"
    f.write_text(
        "from tiny_cpu import get_config as base\n"
        "def get_config():\n    c = base()\n    c.optim.learning_rate = 1.0\n    return c\n"
    )
    cfg_dir = ROOT / "configs"
    (tmp_path / "tiny_cpu.py").write_text((cfg_dir / "tiny_cpu.py").read_text())
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['optim.learning_rate'\].*optim\.lr"):
        config_lib.load_config_file(f)


def test_bad_values_rejected_with_allowed_set():
    cfg = config_lib.load_config_file(TINY)
    with pytest.raises(ValueError, match=r"precision.update_rule='kahn'.*kahan"):
        config_lib.apply_overrides(cfg, {"precision.update_rule": "kahn"})
    with pytest.raises(ValueError, match=r"cannot parse 'ten' as int"):
        config_lib.apply_overrides(cfg, {"train.steps": "ten"})
    with pytest.raises(ValueError, match=r"at most one may be -1"):
        config_lib.apply_overrides(cfg, {"train.mesh.data": "-1", "train.mesh.fsdp": "-1"})
    with pytest.raises(ValueError, match=r"does not exist"):
        config_lib.load_config_file("configs/nope.py")


def test_mesh_shape_fills_minus_one_and_rejects_mismatch():
    assert mesh_lib.resolve_mesh_shape(config_lib.MeshConfig(data=-1, fsdp=2, tensor=1), 8) == (4, 2, 1)
    with pytest.raises(ValueError, match=r"needs 4 devices but 8 are available"):
        mesh_lib.resolve_mesh_shape(config_lib.MeshConfig(data=2, fsdp=2, tensor=1), 8)
    with pytest.raises(ValueError, match=r"do not divide the 8 available devices"):
        mesh_lib.resolve_mesh_shape(config_lib.MeshConfig(data=-1, fsdp=3, tensor=1), 8)


def test_batch_not_divisible_by_mesh():
    mesh = AbstractMesh((2, 2, 1), mesh_lib.MESH_AXES)
    mesh_lib.check_batch(8, 1, mesh)  # fine: 8 over data*fsdp = 4
    with pytest.raises(ValueError, match=r"global_batch=6 .* not divisible by mesh data\*fsdp = 2\*2 = 4"):
        mesh_lib.check_batch(6, 1, mesh)
    with pytest.raises(ValueError, match=r"microbatch 2 with optim.microbatches=4"):
        mesh_lib.check_batch(8, 4, mesh)


def test_logical_rules_shard_params_and_batch():
    from lpt.sharding import RULES, logical_to_mesh

    spec = logical_to_mesh(("embed", "mlp"), RULES)
    assert tuple(spec) == ("fsdp", "tensor")
    spec = logical_to_mesh(("batch", "length", "embed"), RULES)
    assert tuple(spec) == (("data", "fsdp"), None, None)  # embed replicated: fsdp already used by batch


def test_cli_bad_data_path_and_bad_key_exit_with_clear_message(tmp_path, capsys):
    rc = main(
        [
            "--config",
            TINY,
            "--workdir",
            str(tmp_path),
            "--config.data.source=text",
            "--config.data.paths=/nonexistent/dir/*.txt",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "/nonexistent/dir/*.txt" in err
    rc = main(["--config", TINY, "--workdir", str(tmp_path), "--config.model.dmodel=3"])
    err = capsys.readouterr().err
    assert rc == 2 and "model.d_model" in err


def test_help_lists_every_config_key(capsys):
    from lpt.train.config import SCHEMA

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    missing = [k for k in SCHEMA if k not in out]
    assert not missing and "data.cache_dir" in SCHEMA and "one of: auto, xla, pallas, softmax" in out


def test_softmax_attention_and_cache_dir_are_config_keys(tmp_path):
    from lpt.train import config as config_lib

    cfg = config_lib.apply_overrides(
        config_lib.load_config_file(TINY),
        {"precision.attention.impl": "softmax", "data.cache_dir": str(tmp_path / "cache")},
    )
    assert cfg.precision.attention.impl == "softmax" and cfg.data.cache_dir.endswith("cache")


def test_configs_by_name_and_shipped_in_the_wheel(tmp_path):
    """``--config tiny_cpu`` resolves to the shipped file; the wheel carries configs/ as lpt.configs and the GPU
    target file, so a non-editable install outside the repository finds them."""
    import shutil
    import subprocess
    import sys
    import zipfile

    assert config_lib.resolve_config("tiny_cpu").samefile(ROOT / "configs" / "tiny_cpu.py")
    assert config_lib.load_config_file("tiny_cpu_bf16_kahan").precision.update_rule == "kahan"
    with pytest.raises(
        ValueError, match="'tiny' is neither a file nor a shipped config; shipped configs: .*gpt2_124m, .*tiny_cpu"
    ):
        config_lib.resolve_config("tiny")
    src = tmp_path / "src"  # a clean copy: a stale build/ of the checkout must not leak into the wheel
    skip = shutil.ignore_patterns(".venv*", ".git", "build", "*.egg-info", "runs", "__pycache__", "tests", "docs")
    shutil.copytree(ROOT, src, symlinks=True, ignore=skip)
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    names = zipfile.ZipFile(next(tmp_path.glob("lpt-*.whl"))).namelist()
    assert {"lpt/configs/tiny_cpu.py", "lpt/configs/llama_1b.py", "lpt/targets/h100_sxm.txtpb"} <= set(names)
    assert not any(n.startswith("configs/") for n in names)


def _shown_overrides() -> list[tuple[str, dict[str, str]]]:
    """Every ``--config.KEY=VALUE`` group shown in README.md and docs/*.md: one group per (continued) line."""
    groups = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            found = [(k, v) for k, v in re.findall(r"--config\.([a-z_.]+)=([^\s`'\"\]]+)", line) if "." in k]
            found = [(k, v) for k, v in found if v.lower() != "value"]  # the syntax itself, e.g. --config.a.b=value
            if found:
                groups.append((f"{doc.name}: {line.strip()[:80]}", dict(found)))
    return groups


def test_every_override_shown_in_the_docs_is_valid():
    """Each group of overrides the README and docs show applies to tiny_cpu, validates, and gives a train state
    whose layout builds on a 1-device mesh (the Kahan-on-f32 example used to fail there)."""
    from lpt import eval as lpt_eval
    from lpt.train import optimizer
    from lpt.train import state as state_lib

    groups = _shown_overrides()
    assert len(groups) >= 5
    base = config_lib.load_config_file(TINY)
    mesh = mesh_lib.make_mesh(base.train.mesh)
    for where, overrides in groups:
        files = ("data.paths", "data.tokenizer", "init_from.hf")  # paths to files or directories the reader makes
        overrides = {k: v for k, v in overrides.items() if not k.startswith(files)}
        if "lpt.eval" in where:  # eval takes config.data keys only, on the evaluated model's own data section
            data = lpt_eval.data_config(base.data, [f"--config.{k}={v}" for k, v in overrides.items()])
            assert all(
                getattr(data, k.removeprefix("data.")) == config_lib.parse_value(k, v) for k, v in overrides.items()
            )
            continue
        cfg = config_lib.apply_overrides(base, overrides)  # raises with the key and value if the docs are wrong
        if any(k.startswith("train.mesh") for k in overrides):
            continue
        tx = optimizer.make_optimizer(cfg)
        abstract = state_lib.abstract_state(cfg, tx)
        state_lib.state_shardings(abstract, state_lib.make_model_def(cfg), mesh)
        assert where


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.keep_checkpoints=0", "train.keep_checkpoints=0 must be >= 1"),
        ("train.eval_every=0", "train.eval_every=0 must be >= 1"),
        ("train.checkpoint_every=0", "train.checkpoint_every=0 must be >= 1"),
        ("train.eval_batches=0", "train.eval_batches=0 must be >= 1"),
        ("optim.lr=-1", "optim.lr=-1.0 must be > 0"),
        ("precision.update_rule=kahan", "precision.update_rule='kahan' rounds each update into low-precision params"),
        ("train.mesh.tensor=4", "model.n_kv_heads=2 cannot be split over train.mesh.tensor=4"),
    ],
)
def test_bad_values_are_one_line_errors(tmp_path, capsys, override, message):
    """Each bad value exits 2 with one ``error:`` line naming the key and value, and writes nothing."""
    work = tmp_path / "w"
    extra = ["--config.model.n_kv_heads=2"] if "tensor" in override else []
    rc = main(["--config", TINY, "--workdir", str(work), f"--config.{override}", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: ") and message in err[-1], err
    assert not work.exists()


def test_overrides_take_the_space_form_too():
    cfg, _ = config_lib.parse_args(
        ["--config", "tiny_cpu", "--workdir", "w", "--config.train.steps", "20", "--config.optim.lr=0.01"]
    )
    assert cfg.train.steps == 20 and cfg.optim.lr == 0.01
    with pytest.raises(ValueError, match=r"override '--config.train.steps' has no value"):
        config_lib.parse_args(["--config", "tiny_cpu", "--workdir", "w", "--config.train.steps"])


def test_help_with_a_config_shows_each_keys_value_and_doc(capsys):
    with pytest.raises(SystemExit):
        main(["--config", "tiny_cpu_bf16_kahan", "--help"])
    out = capsys.readouterr().out
    assert "  precision.update_rule = 'kahan'  (str)" in out  # the derived config's value
    assert "  model.d_model = 128  (int >= 1)\n      residual stream width" in out  # the key's range and doc
    assert "  optim.b2 = 0.95  (float in [0, 1))\n      Adam beta2" in out  # a default the files do not set


def test_every_key_has_one_typed_definition():
    """Each key of the tree has a type, a default of that type (inside its allowed values) and a doc line; the
    defaults alone are a valid config."""
    flat = {}

    def walk(d, prefix=""):
        for k, v in d.items():
            walk(v, f"{prefix}{k}.") if isinstance(v, dict) else flat.setdefault(f"{prefix}{k}", v)

    walk(config_lib.defaults().to_dict())
    assert set(config_lib.LEAVES) == set(flat)  # every key of a config has exactly one definition, and no other
    for key, leaf in config_lib.LEAVES.items():
        assert leaf.doc and "\n" not in leaf.doc, key
        assert leaf.type in (bool, int, float, str, tuple[str, ...]), key
        if leaf.choices is not None and leaf.type != tuple[str, ...]:
            assert leaf.default in leaf.choices, key
    config_lib.build(config_lib.defaults())


def test_a_config_file_sets_only_its_own_keys(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text(
        "from lpt.train.config import defaults\n\n"
        "def get_config():\n    c = defaults()\n    c.train.steps = 7\n    return c\n"
    )
    cfg = config_lib.load_config_file(f)
    assert cfg.train.steps == 7 and cfg.optim.b2 == 0.95 and cfg.model.d_model == 128
    # a file that builds a partial ConfigDict itself gets the defaults for the rest
    f.write_text(
        "import ml_collections\n\ndef get_config():\n    return ml_collections.ConfigDict({'train': {'steps': 9}})\n"
    )
    cfg = config_lib.load_config_file(f)
    assert cfg.train.steps == 9 and cfg.precision.update_rule == "f32_master" and cfg.data.tokenizer == "bytes"


def test_a_saved_config_without_newer_keys_still_loads():
    """A run's config.json from before a key existed: the key takes its default; a key that no longer exists is
    an error naming it."""
    saved = config_lib.defaults().to_dict()
    del saved["precision"]["moment_rounding"], saved["train"]["mesh"]
    cfg = config_lib.complete(saved)
    assert cfg.precision.moment_rounding == "stochastic" and cfg.train.mesh.data == -1
    saved["precision"]["no_such_key"] = "int8"
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['precision.no_such_key'\]"):
        config_lib.complete(saved)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"optim.b2": "2.0"}, r"optim.b2=2.0 must be in \[0, 1\)"),
        ({"optim.b1": "-0.1"}, r"optim.b1=-0.1 must be in \[0, 1\)"),
        ({"optim.b2": "1.0"}, r"optim.b2=1.0 must be in \[0, 1\)"),
        ({"optim.eps": "-1e-8"}, r"optim.eps=-1e-08 must be > 0"),
        ({"optim.eps": "0"}, r"optim.eps=0.0 must be > 0"),
        ({"model.n_kv_heads": "3"}, r"model.n_heads=4 is not divisible by n_kv_heads=3"),
        ({"data.worker_count": "-1"}, r"data.worker_count=-1 must be >= 0 \(0 = in-process\)"),
        ({"precision.pqt.layers": "qkv,lm_head"}, r"precision.pqt.layers=\('qkv', 'lm_head'\): must be a tuple"),
        ({"precision.matmul.qkv": "fp4"}, r"precision.matmul.qkv='fp4' is not allowed; valid values: .*mxfp8, nvfp4"),
        (
            {"precision.matmul.up": "nvfp4", "model.d_ff": "200"},
            r"precision.matmul.up='nvfp4' needs K and N multiples of 16, but the model's up weight is 128x200",
        ),
        (
            {"precision.matmul.qkv": "mxfp8", "model.head_dim": "40"},
            r"precision.matmul.qkv='mxfp8' needs K and N multiples of 32, but the model's qkv weight is 128x80",
        ),
    ],
)
def test_values_outside_their_range_are_one_line_errors(override, message):
    with pytest.raises(ValueError, match=message) as e:
        config_lib.apply_overrides(config_lib.load_config_file(TINY), override)
    assert "\n" not in str(e.value)
