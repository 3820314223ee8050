"""Config files, command-line overrides and validation for ``python -m lpt.train``.

A config file is a Python file with ``get_config() -> ml_collections.ConfigDict`` (see ``configs/``). The loader
puts the file's directory on ``sys.path`` while it runs, so a recipe config can start from another one
(``from tiny_cpu import get_config as base``). The loaded config is checked against ``SCHEMA`` (every key, its type,
its allowed values): a missing key, an unknown key or a value outside the allowed set raises ``ValueError`` naming
the key and listing what is valid. ``--config.a.b=value`` overrides are parsed with the type recorded in the schema.
Every config sets every key; ``python -m lpt.train --help`` lists them.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import ml_collections

import lpt.configs
from lpt.models import config as model_config
from lpt.optim.adam import MOMENT_ROUNDINGS
from lpt.optim.fused_adamw import IMPLS as UPDATE_IMPLS

# integer keys that must be >= 1 (intervals, counts, sizes)
POSITIVE = (
    "train.steps",
    "train.global_batch",
    "optim.microbatches",
    "data.seq_len",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.checkpoint_every",
    "train.keep_checkpoints",
)
_CONFIGS = Path(lpt.configs.__file__).parent  # the shipped configs (a link to the repository's configs/)
MATMUL_KINDS = model_config.LAYER_KINDS

# key path -> (type, allowed values or None). tuple[str] values are written "a,b" on the command line.
SCHEMA: dict[str, tuple[type, tuple | None]] = {
    "model.kind": (str, model_config.KINDS),
    "model.vocab_size": (int, None),  # 0 = the tokenizer's vocabulary size (data.tokenizer)
    "model.d_model": (int, None),
    "model.n_layers": (int, None),
    "model.n_heads": (int, None),
    "model.n_kv_heads": (int, None),
    "model.d_ff": (int, None),
    "model.max_seq_len": (int, None),
    "model.rope_theta": (float, None),
    "model.rope_scaling.type": (str, model_config.ROPE_SCALINGS),
    "model.rope_scaling.factor": (float, None),
    "model.rope_scaling.low_freq_factor": (float, None),
    "model.rope_scaling.high_freq_factor": (float, None),
    "model.rope_scaling.original_max_len": (int, None),
    "model.norm_eps": (float, None),
    "model.tie_embeddings": (bool, None),
    "model.init_std": (float, None),
    "model.remat": (bool, None),
    "model.scan_layers": (bool, None),
    "precision.param_dtype": (str, tuple(model_config.PARAM_DTYPES)),
    "precision.compute_dtype": (str, tuple(model_config.COMPUTE_DTYPES)),
    "precision.update_rule": (str, model_config.UPDATE_RULES),
    "precision.moment_rounding": (str, MOMENT_ROUNDINGS),  # 16-bit Adam moments
    "precision.update_impl": (str, UPDATE_IMPLS),  # kahan's fused step: XLA or the Pallas kernel
    **{f"precision.matmul.{k}": (str, model_config.MATMULS) for k in MATMUL_KINDS},
    "precision.attention.impl": (str, model_config.ATTENTION_IMPLS),
    "precision.attention.stable": (bool, None),
    "precision.attention.beta": (float, None),
    "precision.pqt.method": (str, model_config.PQT_METHODS),
    "precision.pqt.layers": (tuple, model_config.PQT_LAYER_KINDS),
    "precision.pqt.b_init": (float, None),
    "precision.pqt.b_target": (float, None),
    "precision.pqt.loss_weight": (float, None),
    "data.source": (str, ("embedded", "text", "arrayrecord", "prepared")),
    "data.paths": (str, None),
    "data.seq_len": (int, None),
    "data.validation_fraction": (float, None),
    "data.worker_count": (int, None),
    "data.shuffle_seed": (int, None),
    "data.cache_dir": (str, None),  # "" = $LPT_DATA_CACHE, else ~/.cache/lpt/data
    "data.tokenizer": (str, None),  # "bytes", a Hugging Face tokenizer.json or a SentencePiece .model
    "optim.lr": (float, None),
    "optim.warmup_steps": (int, None),
    "optim.schedule": (str, ("cosine", "constant")),
    "optim.b1": (float, None),
    "optim.b2": (float, None),
    "optim.eps": (float, None),
    "optim.weight_decay": (float, None),
    "optim.grad_clip": (float, None),
    "optim.microbatches": (int, None),
    "train.steps": (int, None),
    "train.global_batch": (int, None),
    "train.seed": (int, None),
    "train.eval_every": (int, None),
    "train.eval_batches": (int, None),
    "train.log_every": (int, None),
    "train.diagnostics_every": (int, None),  # activation diagnostics pass every N steps (0 = off)
    "train.profile_steps": (str, None),  # "FIRST,LAST": a jax.profiler trace of those steps; "" = off
    "train.checkpoint_every": (int, None),
    "train.keep_checkpoints": (int, None),
    "train.mesh.data": (int, None),
    "train.mesh.fsdp": (int, None),
    "train.mesh.tensor": (int, None),
    "init_from.hf": (str, None),  # "" or a Hugging Face model directory to start from
    "init_from.workdir": (str, None),  # "" or an lpt run directory to start from
    "init_from.step": (int, None),  # with init_from.workdir: its checkpoint step (-1 = the newest)
}


def _flatten(cfg: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _close_matches(key: str) -> str:
    """'(did you mean X?) valid keys in that section: ...' for an unknown ``key``."""
    section = key.rsplit(".", 1)[0] + "." if "." in key else ""
    same_section = sorted(k for k in SCHEMA if k.startswith(section))
    guess = difflib.get_close_matches(key, SCHEMA, n=1)
    hint = f"did you mean {guess[0]!r}? " if guess else ""
    return hint + "valid keys in that section: " + ", ".join(same_section or sorted(SCHEMA))


def _check_value(key: str, value: Any) -> None:
    typ, allowed = SCHEMA[key]
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is tuple:
        if not isinstance(value, tuple | list) or any(v not in allowed for v in value):
            raise ValueError(f"config key {key}={value!r}: must be a tuple drawn from {allowed}")
        return
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ValueError(f"config key {key}={value!r} has type {type(value).__name__}; expected {typ.__name__}")
    if allowed is not None and value not in allowed:
        raise ValueError(f"config key {key}={value!r} is not allowed; valid values: {', '.join(allowed)}")


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Raise ValueError if ``cfg`` has unknown or missing keys, wrong types or values outside the allowed set."""
    flat = _flatten(cfg)
    unknown = sorted(set(flat) - set(SCHEMA))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; {_close_matches(unknown[0])}")
    missing = sorted(set(SCHEMA) - set(flat))
    if missing:
        raise ValueError(f"config is missing key(s) {missing}; every config must set all keys of lpt.train.SCHEMA")
    for key, value in flat.items():
        _check_value(key, value)
    diag_every = cfg.train.diagnostics_every
    if diag_every < 0:
        raise ValueError(f"config key train.diagnostics_every={diag_every} must be >= 0 (0 = off)")
    update_impl, p = cfg.precision.update_impl, cfg.precision
    if update_impl == "pallas" and (p.update_rule != "kahan" or p.param_dtype != "bfloat16"):
        raise ValueError(
            f"precision.update_impl='pallas' runs the fused bf16 AdamW + Kahan kernel: it needs "
            f"precision.update_rule='kahan' and precision.param_dtype='bfloat16', got {p.update_rule!r} and "
            f"{p.param_dtype!r} (use precision.update_impl='xla')"
        )
    mesh = cfg.train.mesh
    sizes = (mesh.data, mesh.fsdp, mesh.tensor)
    if sum(s == -1 for s in sizes) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"train.mesh (data, fsdp, tensor) = {sizes}: each must be >= 1, and at most one may be -1")
    for key in POSITIVE:
        if flat[key] < 1:
            raise ValueError(f"config key {key}={flat[key]} must be >= 1")
    profile_steps(cfg)  # raises on a malformed range
    if not cfg.optim.lr > 0:
        raise ValueError(f"config key optim.lr={cfg.optim.lr} must be > 0")
    if p.update_rule != "f32_master" and p.param_dtype == "float32":
        raise ValueError(
            f"precision.update_rule={p.update_rule!r} rounds each update into low-precision params, but "
            f"precision.param_dtype='float32'; set precision.param_dtype=bfloat16 (or float16, float8_*) with it, "
            f"or use precision.update_rule=f32_master for f32 params"
        )
    if cfg.train.mesh.tensor > 1:
        check_heads(cfg, cfg.train.mesh.tensor)
    if cfg.train.global_batch % cfg.optim.microbatches:
        raise ValueError(
            f"train.global_batch={cfg.train.global_batch} is not divisible by optim.microbatches="
            f"{cfg.optim.microbatches}"
        )
    if cfg.model.vocab_size < 0:
        raise ValueError(f"config key model.vocab_size={cfg.model.vocab_size} must be >= 0 (0 = the tokenizer's size)")
    if cfg.init_from.hf and cfg.init_from.workdir:
        raise ValueError(
            f"init_from.hf={cfg.init_from.hf!r} and init_from.workdir={cfg.init_from.workdir!r} are both set; "
            "start from one of them"
        )
    if cfg.init_from.step < -1:
        raise ValueError(f"config key init_from.step={cfg.init_from.step} must be >= 0, or -1 for the newest")
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ValueError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")


def resolve(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``cfg`` with ``model.vocab_size`` = the tokenizer's vocabulary size when it is 0 (a copy; ``cfg`` unchanged).

    A nonzero ``model.vocab_size`` may exceed the tokenizer's (padding, e.g. to a multiple of 128 for FP8 heads)
    but not fall below it."""
    from lpt.data.tokenizer import load_tokenizer

    n = load_tokenizer(cfg.data.tokenizer).vocab_size
    if cfg.model.vocab_size == n:
        return cfg
    if cfg.model.vocab_size and cfg.model.vocab_size < n:
        raise ValueError(
            f"config key model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of "
            f"data.tokenizer={cfg.data.tokenizer!r} ({n} tokens); set it to 0 to take the tokenizer's size"
        )
    if cfg.model.vocab_size:
        return cfg
    out = ml_collections.ConfigDict(cfg.to_dict())
    out.model.vocab_size = n
    return out


def profile_steps(cfg: ml_collections.ConfigDict) -> tuple[int, int] | None:
    """``train.profile_steps`` as (first, last) step, or None when it is ""; ValueError if malformed."""
    text = cfg.train.profile_steps.strip()
    if not text:
        return None
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or not 1 <= int(parts[0]) <= int(parts[1]):
        raise ValueError(
            f"config key train.profile_steps={text!r} must be 'FIRST,LAST' with 1 <= FIRST <= LAST (e.g. '100,110'), "
            f"or '' for no trace"
        )
    return int(parts[0]), int(parts[1])


def check_heads(cfg: ml_collections.ConfigDict, tensor: int) -> None:
    """Raise ValueError unless the query and key/value heads split evenly over a tensor axis of size ``tensor``."""
    for key in ("n_heads", "n_kv_heads"):
        n = cfg.model[key]
        if n % tensor:
            raise ValueError(
                f"config key model.{key}={n} cannot be split over train.mesh.tensor={tensor} (attention heads are "
                f"sharded over the tensor axis); choose a tensor size that divides {n}"
            )


def parse_value(key: str, text: str) -> Any:
    """Parse the command-line string ``text`` for config key ``key`` using the schema's type."""
    if key not in SCHEMA:
        raise ValueError(f"unknown config key {key!r}; {_close_matches(key)}")
    typ, _ = SCHEMA[key]
    if typ is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"config key {key}: {text!r} is not a bool (use true/false)")
        return text.lower() in ("true", "1")
    if typ is tuple:
        return tuple(t for t in text.split(",") if t)
    try:
        return typ(text)
    except ValueError:
        raise ValueError(f"config key {key}: cannot parse {text!r} as {typ.__name__}") from None


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: dict[str, str]) -> ml_collections.ConfigDict:
    """Return a copy of ``cfg`` with ``{"a.b": "text"}`` overrides applied (parsed by schema type), validated and
    passed through :func:`resolve`."""
    tree = cfg.to_dict()
    for key, text in overrides.items():
        value = parse_value(key, text)
        *parents, leaf = key.split(".")
        node = tree
        for p in parents:
            node = node[p]
        node[leaf] = value
    cfg = ml_collections.ConfigDict(tree)
    validate(cfg)
    return resolve(cfg)


def shipped_configs() -> list[str]:
    """Names of the configs shipped with lpt (``configs/`` of the repository, ``lpt.configs`` in the wheel)."""
    return sorted(p.stem for p in _CONFIGS.glob("*.py") if not p.stem.startswith("_"))


def resolve_config(name_or_path: str | Path) -> Path:
    """A config file from a path (``configs/tiny_cpu.py``) or the name of a shipped config (``tiny_cpu``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = _CONFIGS / f"{path.name}.py"
    if path.suffix == "" and len(path.parts) == 1 and shipped.is_file():
        return shipped
    what = "does not exist" if path.suffix or len(path.parts) > 1 else "is neither a file nor a shipped config"
    raise ValueError(
        f"config {str(name_or_path)!r} {what}; shipped configs: {', '.join(shipped_configs())} "
        "(give one by name, or a path such as configs/tiny_cpu.py)"
    )


def load_config_file(path: str | Path) -> ml_collections.ConfigDict:
    """Import ``path`` (a Python file defining ``get_config()``, or the name of a shipped config such as
    ``tiny_cpu``) and return its validated ConfigDict."""
    path = resolve_config(path)
    spec = importlib.util.spec_from_file_location(f"_lpt_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {str(path)!r} does not define get_config()")
    cfg = module.get_config()
    validate(cfg)
    return cfg


def config_comments(path: str | Path) -> dict[str, str]:
    """``{key: comment}`` from the ``c.a.b = value  # comment`` lines of a config file and of the shipped configs it
    imports (``from tiny_cpu import get_config as base``)."""
    path = resolve_config(path)
    text = path.read_text()
    comments: dict[str, str] = {}
    for base in re.findall(r"^from (\w+) import", text, re.M):
        if (path.parent / f"{base}.py").is_file():
            comments.update(config_comments(path.parent / f"{base}.py"))
    for key, comment in re.findall(r"^\s*c\.([\w.]+)\s*=.*?#\s*(.+)$", text, re.M):
        comments[key] = comment.strip()
    return comments


def schema_help(cfg: ml_collections.ConfigDict | None = None, comments: dict[str, str] | None = None) -> str:
    """The config keys with their types and allowed values for ``--help``; with ``cfg``, each key's current value,
    and with ``comments``, the config file's comment on it."""
    flat = _flatten(cfg) if cfg is not None else {}
    head = "config keys (override any with --config.KEY=VALUE or --config.KEY VALUE; tuples as a,b)"
    lines = [head + (": current values from the given --config" if cfg is not None else ":")]
    for key, (typ, allowed) in SCHEMA.items():
        value = f" = {flat[key]!r}" if key in flat else ""
        choices = f"  one of: {', '.join(allowed)}" if allowed else ""
        lines.append(f"  {key}{value}  ({typ.__name__}){choices}")
        if comments and key in comments:
            lines.append(f"      {comments[key]}")
    return "\n".join(lines)


def _help_for(config: str) -> str:
    try:
        return schema_help(load_config_file(config), config_comments(config))
    except ValueError as e:
        return f"{schema_help()}\n\n(--config {config}: {e})"


def parse_overrides(items: list[str]) -> dict[str, str]:
    """``{"a.b": "text"}`` from ``--config.a.b=value`` or ``--config.a.b value`` arguments; ValueError for others."""
    overrides, i = {}, 0
    while i < len(items):  # --config.a.b=value or --config.a.b value
        item = items[i]
        if not item.startswith("--config."):
            raise ValueError(f"unrecognised argument {item!r}; overrides look like --config.train.steps=100")
        if "=" in item:
            key, text = item[len("--config.") :].split("=", 1)
        elif i + 1 < len(items) and not items[i + 1].startswith("--"):
            key, text = item[len("--config.") :], items[i + 1]
            i += 1
        else:
            raise ValueError(f"override {item!r} has no value; write {item}=VALUE")
        overrides[key] = text
        i += 1
    return overrides


def parse_args(argv: list[str]) -> tuple[ml_collections.ConfigDict, argparse.Namespace]:
    """Parse ``--config FILE --workdir DIR [--config.key=value ...]`` (+ optional multi-process flags)."""
    epilog = schema_help()
    if any(a in ("-h", "--help") for a in argv):  # with --config: the file's values and comments
        peek = argparse.ArgumentParser(add_help=False)
        peek.add_argument("--config")
        config = peek.parse_known_args(argv)[0].config
        epilog = _help_for(config) if config else epilog
    parser = argparse.ArgumentParser(
        prog="python -m lpt.train",
        description="Train an lpt transformer.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="config file (configs/tiny_cpu.py) or shipped name (tiny_cpu)")
    parser.add_argument("--workdir", required=True, help="checkpoints, metrics and plots go here; resumes from it")
    parser.add_argument("--coordinator", default=None, help="host:port of process 0 (explicit multi-process)")
    parser.add_argument("--num_processes", type=int, default=None, help="number of processes (explicit)")
    parser.add_argument("--process_id", type=int, default=None, help="this process's index (explicit)")
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest)
    cfg = apply_overrides(load_config_file(args.config), overrides)
    return cfg, args
