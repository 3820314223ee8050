"""The config is parsed once, at the edge, into the typed tree: nothing below ``lpt.train.config`` sees a ConfigDict.

``lpt.train.config`` turns config files (``ml_collections.ConfigDict``), ``config.json`` and the command line into
an ``lpt.train.config.Config``; every other module of lpt takes that tree or one of its sections. These tests read
the source of every lpt module (the AST, so docstrings and comments do not count).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lpt
from lpt.train import config as config_lib

ROOT = Path(lpt.__file__).parent
EDGE = ROOT / "train" / "config.py"  # the one module that parses ConfigDicts and mappings into a Config
# the parameter names that carry a config or a config section
_CONFIG_PARAMS = ("cfg", "config")
_UNTYPED = ("ConfigDict", "Mapping", "dict", "Any")  # annotations that would let a ConfigDict through


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if p != EDGE and "configs" not in p.relative_to(ROOT).parts)


def configdict_uses(source: str) -> list[str]:
    """``ml_collections`` imports and ``ConfigDict`` names in the code of ``source`` (not its strings)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ml_collections" for a in node.names):
            found.append(f"line {node.lineno}: import ml_collections")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ml_collections":
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Name) and node.id == "ConfigDict":
            found.append(f"line {node.lineno}: ConfigDict")
        elif isinstance(node, ast.Attribute) and node.attr == "ConfigDict":
            found.append(f"line {node.lineno}: .ConfigDict")
    return found


def untyped_config_params(source: str) -> list[str]:
    """Function parameters of ``source`` that carry a config (``cfg``, ``config``, ``*_cfg``) without an annotation
    naming its type, or with one that admits a ConfigDict or a plain mapping."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
            if arg.arg not in _CONFIG_PARAMS and not arg.arg.endswith("_cfg"):
                continue
            note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            if not note or any(word in note.replace(".", " ").replace("|", " ").split() for word in _UNTYPED):
                found.append(f"line {node.lineno}: {node.name}({arg.arg}: {note or 'no annotation'})")
    return found


def test_no_configdict_below_the_entry_points():
    found = {str(p.relative_to(ROOT)): configdict_uses(p.read_text()) for p in _modules()}
    assert not {k: v for k, v in found.items() if v}


def test_every_config_parameter_is_typed():
    found = {str(p.relative_to(ROOT)): untyped_config_params(p.read_text()) for p in _modules()}
    assert not {k: v for k, v in found.items() if v}


def test_the_scans_find_what_they_look_for():
    """Each scan flags the code it forbids (so the two tests above can fail), and nothing in strings."""
    assert configdict_uses("import ml_collections\nx = ml_collections.ConfigDict({})") == [
        "line 1: import ml_collections",
        "line 2: .ConfigDict",
    ]
    assert configdict_uses("from ml_collections import ConfigDict") == ["line 1: from ml_collections import ..."]
    assert configdict_uses('"""a ConfigDict in a docstring"""\n# ConfigDict') == []
    assert untyped_config_params("def f(cfg): ...\ndef g(model_cfg: dict): ...\ndef h(cfg: Mapping | None): ...") == [
        "line 1: f(cfg: no annotation)",
        "line 2: g(model_cfg: dict)",
        "line 3: h(cfg: Mapping | None)",
    ]
    assert untyped_config_params("def f(cfg: config_lib.Config, data_cfg: DataConfig): ...") == []
    assert configdict_uses(EDGE.read_text())  # the edge itself does parse ConfigDicts


def test_the_parsed_tree_is_typed_and_checked_as_a_whole():
    """The command line gives a Config whose sections are the typed classes; a rule between sections (the batch over
    the microbatches) is checked when the tree is built, whichever way it is built."""
    cfg, _ = config_lib.parse_args(["--config", "tiny_cpu", "--workdir", "unused", "--config.train.steps=7"])
    assert isinstance(cfg, config_lib.Config) and isinstance(cfg.train, config_lib.TrainConfig)
    assert cfg.train.steps == 7 and cfg.model.vocab_size == 256  # resolved: the tokenizer's size
    with pytest.raises(ValueError, match=r"train.global_batch=32 is not divisible by optim.microbatches=3"):
        config_lib.with_values(cfg, {"optim.microbatches": 3})
    with pytest.raises(ValueError, match=r"train.global_batch=32 is not divisible by optim.microbatches=3"):
        config_lib.build({"optim": {"microbatches": 3}})
    # config.json round trip: the dict written into a run directory builds the same tree
    assert config_lib.build(cfg.to_dict()) == cfg
