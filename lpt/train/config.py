"""The trainer's config: one typed tree, config files, command-line overrides and validation.

:class:`Config` is the whole tree, made of the typed sections ``model`` and ``precision`` (:mod:`lpt.models.config`),
``data`` (:mod:`lpt.data.pipeline`) and ``optim``, ``train``, ``init_from`` (here). Every key is one field with its
type, default, allowed values or range, and doc (:func:`lpt.options.option`); the parser, validation, ``--help`` and
the complete ``config.json`` are derived from them. The rules within one section are its ``check()``; the rules between
sections are :meth:`Config.check`; both run when a tree is built, so a Config is always a valid one.

The command line, a config file and a run's ``config.json`` are parsed here, once, into a Config
(:func:`parse_args`, :func:`load_config_file`, :func:`apply_overrides`, :func:`build`); everything below takes the
Config or the section it uses. ``ml_collections.ConfigDict`` is what config files write (:func:`defaults`).

A config file is a Python file with ``get_config() -> ml_collections.ConfigDict`` (see ``configs/``) that starts
from :func:`defaults` and sets the keys that make it that run; keys it does not set keep their defaults. The loader
puts the file's directory on ``sys.path`` while it runs, so a recipe config can start from another one
(``from tiny_cpu import get_config as base``). An unknown key, a value of the wrong type, outside the allowed set or
outside the key's range raises ``ValueError`` naming the key and what is valid; so does a file whose code fails (a
syntax error, a missing module) or whose ``get_config()`` returns no ConfigDict or mapping, naming the file.
``--config.a.b=value`` overrides are parsed with the key's type. ``python -m lpt.train --help`` lists every key with
its value, range and doc.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_collections

import lpt.configs
from lpt import options
from lpt.data.pipeline import DataConfig
from lpt.data.tokenizer import load_tokenizer
from lpt.models.config import PROJECTIONS, SHAPE_KEYS, ModelSpec, Precision, check_attention, check_matmul_blocks
from lpt.models.hf_config import read_config as read_hf_config
from lpt.options import SEED, Range, above, at_least, option, section
from lpt.train.guard import BAD_STEPS

_CONFIGS = Path(lpt.configs.__file__).parent  # the shipped configs (a link to the repository's configs/)


def _profile_range(text: str) -> tuple[int, int] | None:
    text = text.strip()
    if not text:
        return None
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or not 1 <= int(parts[0]) <= int(parts[1]):
        raise ValueError(
            f"config key train.profile_steps={text!r} must be 'FIRST,LAST' with 1 <= FIRST <= LAST (e.g. '100,110'), "
            f"or '' for no trace"
        )
    return int(parts[0]), int(parts[1])


@section("optim")
class OptimConfig:
    """The ``optim`` section: AdamW and its schedule."""

    lr: float = option(3e-3, "peak learning rate", bounds=above(0))
    warmup_steps: int = option(30, "linear warmup from 0", bounds=at_least(0, note="0 = no warmup"))
    schedule: str = option("cosine", '"cosine" (decay to lr/10 at train.steps) | "constant"', ("cosine", "constant"))
    b1: float = option(0.9, "Adam beta1", bounds=Range(0, 1, high_open=True))
    b2: float = option(0.95, "Adam beta2", bounds=Range(0, 1, high_open=True))
    eps: float = option(1e-8, "Adam epsilon", bounds=above(0))
    weight_decay: float = option(0.1, "decoupled weight decay (matrices only)", bounds=at_least(0, note="0 = none"))
    grad_clip: float = option(1.0, "clip the global gradient norm (0 = off)", bounds=at_least(0, note="0 = off"))
    microbatches: int = option(1, "gradient accumulation steps per optimizer step", bounds=at_least(1))
    fp8_gather: str = option(
        "microbatch",
        '"microbatch" | "step": FP8 weights quantized and gathered in each microbatch, or once per step for all '
        "of them (their codes then stay in HBM for the whole step; the compile report's fp8_codes_bytes)",
        ("microbatch", "step"),
    )


# a mesh axis: a size, or -1 for the devices the other axes leave (at most one axis; checked in MeshConfig.check)
_AXIS = at_least(1, also=(-1,), note="-1 = the devices the other axes leave")


@section("train.mesh")
class MeshConfig:
    """``train.mesh``: the device mesh's axis sizes."""

    data: int = option(-1, "data-parallel axis (-1: all devices not used by the other axes)", bounds=_AXIS)
    fsdp: int = option(1, 'fully-sharded data parallel axis (params sharded on "embed")', bounds=_AXIS)
    tensor: int = option(1, "tensor-parallel axis (heads / mlp / vocab)", bounds=_AXIS)

    def check(self):
        sizes = (self.data, self.fsdp, self.tensor)
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError(f"train.mesh (data, fsdp, tensor) = {sizes}: at most one may be -1")


@section("train")
class TrainConfig:
    """The ``train`` section: steps, batch, evaluation, logging, checkpoints and the mesh."""

    steps: int = option(600, "optimizer steps", bounds=at_least(1))
    global_batch: int = option(32, "sequences per step, summed over all devices and processes", bounds=at_least(1))
    seed: int = option(
        0, "model init and per-step randomness: key = fold_in(PRNGKey(seed), step); fixed on resume", bounds=SEED
    )
    eval_every: int = option(100, "validation every N steps (and at the end)", bounds=at_least(1))
    eval_batches: int = option(4, "validation batches per evaluation", bounds=at_least(1))
    log_every: int = option(10, "JSONL/TensorBoard logging interval", bounds=at_least(1))
    diagnostics_every: int = option(
        50, "forward pass logging FP8 underflow / attention repeated max; 0 = off", bounds=at_least(0, note="0 = off")
    )
    profile_steps: str = option("", '"FIRST,LAST" writes a jax.profiler trace of those steps to workdir/profile')
    checkpoint_every: int = option(200, "checkpoint interval (and at the end, and on SIGTERM)", bounds=at_least(1))
    keep_checkpoints: int = option(3, "newest checkpoints to keep", bounds=at_least(1))
    bad_step: str = option(
        "stop", '"stop": a non-finite loss or grad norm stops the run; "skip": such a step changes nothing', BAD_STEPS
    )
    spike_sigmas: float = option(
        0.0,
        "skip: also skip a loss or grad norm this many running stds above its mean; 0 off",
        bounds=at_least(0, note="0 = spikes not judged"),
    )
    max_skips: int = option(
        10,
        "skip: stop the run after more than this many skipped steps in a row",
        bounds=at_least(0, note="0 = stop at the first skipped step"),
    )
    mesh: MeshConfig = option(MeshConfig(), "the device mesh")

    def check(self):
        _profile_range(self.profile_steps)  # raises on a malformed range

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """``profile_steps`` as (first, last) step, or None when it is ""."""
        return _profile_range(self.profile_steps)


@section("init_from")
class InitFromConfig:
    """The ``init_from`` section: start a fresh run from another run's or a Hugging Face model's weights."""

    hf: str = option("", 'a Hugging Face model directory (config.json + *.safetensors) to fine-tune; "" = none')
    workdir: str = option("", 'an lpt run directory to fine-tune from; "" = none (fresh init)')
    step: int = option(
        -1,
        "with init_from.workdir: the checkpoint step to take (-1 = the newest)",
        bounds=at_least(0, also=(-1,), note="-1 = the newest"),
    )

    def check(self):
        if self.hf and self.workdir:
            raise ValueError(
                f"init_from.hf={self.hf!r} and init_from.workdir={self.workdir!r} are both set; start from one of them"
            )


@section("")
class Config:
    """The whole config of a run: each section typed, and the rules that span sections checked on construction
    (:meth:`check`). The trainer, the inference tools and the lab take this tree (or the section they use);
    ``ml_collections.ConfigDict`` stays at the edges (config files, ``config.json``), parsed here."""

    model: ModelSpec = option(ModelSpec(), "architecture and size")
    precision: Precision = option(Precision(), "the precision recipe")
    data: DataConfig = option(DataConfig(), "the data")
    optim: OptimConfig = option(OptimConfig(), "the optimizer")
    train: TrainConfig = option(TrainConfig(), "the training run")
    init_from: InitFromConfig = option(InitFromConfig(), "the weights a fresh run starts from")

    def check(self):
        """The rules between sections: the heads over the tensor axis, the batch over the microbatches, each layer's
        matmul format against its weights' shapes, the attention impl against the model, FP8 gathering against PQT,
        the sequence length against the model's."""
        p, o, t = self.precision, self.optim, self.train
        if t.mesh.tensor > 1:
            check_heads(self.model, t.mesh.tensor)
        if t.global_batch % o.microbatches:
            raise ValueError(
                f"train.global_batch={t.global_batch} is not divisible by optim.microbatches={o.microbatches}"
            )
        check_matmul_blocks(self.model, p)
        check_attention(self.model, p)
        noisy = [k for k in PROJECTIONS if p.matmul_for(k) == "fp8" and p.pqt_for(k) != "none"]
        if o.fp8_gather == "step" and noisy:
            raise ValueError(
                f"optim.fp8_gather='step' quantizes each FP8 weight once per step, but precision.pqt.method="
                f"{p.pqt.method!r} samples new weight noise in every microbatch of layers {noisy}; use fp8_gather="
                "'microbatch' with PQT"
            )
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")


LEAVES: dict[str, options.Leaf] = {leaf.key: leaf for leaf in options.leaves(Config)}
# key path -> (type, allowed values or None); tuple values are written "a,b" on the command line
SCHEMA: dict[str, tuple[Any, Sequence | None]] = {k: (leaf.type, leaf.choices) for k, leaf in LEAVES.items()}

# On resume, these keys must equal the checkpoint's: the model and the precision recipe define the train state and its
# numerics; the data keys and the batch define what the saved data position means; the seed defines every step's
# randomness (stochastic rounding, PQT noise), so a resumed run continues the steps it would have taken. Every other
# key (intervals, diagnostics, the mesh, data.worker_count, the optimizer's hyperparameters, train.steps) may change
# between runs.
RESUME_FIXED = ("model.", "precision.", "data.source", "data.paths", "data.tokenizer", "data.seq_len")
RESUME_FIXED += ("data.validation_fraction", "data.shuffle_seed", "train.global_batch", "train.seed")
_RESUME_FREE = ("model.remat", "precision.update_impl")  # the same math, another memory or kernel
RESUME_CONVERTED = ("precision.moment_dtype",)  # the trainer re-stores the checkpoint's moments (lpt.train.resume)


def build(values: Config | Mapping | ml_collections.ConfigDict | None = None) -> Config:
    """The typed :class:`Config` of ``values``: a ConfigDict (a config file's), a nested mapping (a run's
    ``config.json``, possibly of an older run that lacks newer keys), or a Config (returned as is). Missing keys take
    their defaults; ValueError for an unknown key, a wrong type, a value outside the allowed set or range, or values
    that do not fit together."""
    return options.build(Config, values)


def resume_conflicts(saved: Mapping, current: Config) -> list[str]:
    """The keys of ``RESUME_FIXED`` whose value in ``current`` differs from the checkpoint's ``saved`` config (a
    nested dict), as ``"key=saved -> current"`` (empty when the run may resume)."""
    old, new = _flatten(build(saved)), _flatten(current)
    return [
        f"{key}={old[key]!r} -> {new[key]!r}"
        for key in LEAVES
        if key.startswith(RESUME_FIXED) and key not in _RESUME_FREE + RESUME_CONVERTED and old[key] != new[key]
    ]


def defaults() -> ml_collections.ConfigDict:
    """Every key at its default: what a config file starts from (``c = defaults(); c.train.steps = 100``)."""
    return ml_collections.ConfigDict(options.to_dict(Config()))


def complete(cfg: Config | Mapping | ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``cfg`` (possibly partial: a file, or a ``config.json`` of an older run) as a ConfigDict with every key, the
    missing ones at their defaults; ValueError as :func:`build`."""
    return ml_collections.ConfigDict(options.to_dict(build(cfg)))


def _flatten(tree: Config | Mapping) -> dict[str, Any]:
    """``{"a.b": value}`` of a Config or a nested mapping."""
    return options.flatten(tree if isinstance(tree, Mapping) else options.to_dict(tree))


def with_values(cfg: Config, changes: Mapping[str, Any]) -> Config:
    """``cfg`` with the typed values ``{"a.b": value}`` (a new Config, checked as a whole)."""
    tree = options.to_dict(cfg)
    for key, value in changes.items():
        if key not in LEAVES:
            raise options.unknown_key_error(key, list(LEAVES))
        *parents, leaf = key.split(".")
        node = tree
        for p in parents:
            node = node[p]
        node[leaf] = value
    return build(tree)


def from_hf(cfg: Config) -> Config:
    """With ``init_from.hf``: ``cfg`` whose model section is the directory's ``config.json``
    (:func:`lpt.models.hf.read_config`), except the keys the config sets to other values than their defaults (e.g.
    ``max_seq_len``, ``remat``, ``scan_layers``); a shape key set to another value than the source's is an error
    naming every such key at once. ``data.tokenizer`` left at its default becomes the directory's ``tokenizer.json``
    when it has one. Without ``init_from.hf``: ``cfg`` itself."""
    if not cfg.init_from.hf:
        return cfg
    directory = Path(cfg.init_from.hf).expanduser()
    source = options.to_dict(read_hf_config(directory))
    default_model, mine = options.to_dict(ModelSpec()), options.to_dict(cfg.model)
    model = dict(mine)
    conflicts = []
    for key, value in sorted(source.items()):  # conflicts named in key order
        if mine[key] == default_model[key] or mine[key] == value:
            model[key] = value
        elif key in SHAPE_KEYS:
            conflicts.append(f"model.{key}={mine[key]!r} (the source has {value!r})")
    if conflicts:
        raise ValueError(
            f"init_from.hf={cfg.init_from.hf!r}: the config sets {'; '.join(conflicts)}; a fine-tune keeps the "
            f"source's shape: leave these keys out (the model section comes from its config.json)"
        )
    data = cfg.data
    if data.tokenizer == DataConfig().tokenizer and (directory / "tokenizer.json").is_file():
        data = dataclasses.replace(data, tokenizer=str(directory / "tokenizer.json"))
    return dataclasses.replace(cfg, model=options.build(ModelSpec, model), data=data)


def resolve(cfg: Config) -> Config:
    """``cfg`` with the model section of ``init_from.hf`` (:func:`from_hf`) and ``model.vocab_size`` = the
    tokenizer's vocabulary size when it is 0 (a new Config, checked again: the lm_head's N is now known); ``cfg``
    itself when there is nothing to resolve.

    A nonzero ``model.vocab_size`` may exceed the tokenizer's (padding, e.g. to a multiple of 128 for FP8 heads)
    but not fall below it."""
    if not isinstance(cfg, Config):
        raise ValueError(
            f"expected an lpt.train.config.Config, got {type(cfg).__name__}; build one with "
            "lpt.train.config.build(...) or load_config_file(...)"
        )
    cfg = from_hf(cfg)
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
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=n))


def check_heads(model: ModelSpec, tensor: int) -> None:
    """Raise ValueError unless the query and key/value heads split evenly over a tensor axis of size ``tensor``."""
    for key in ("n_heads", "n_kv_heads"):
        n = getattr(model, key)
        if n % tensor:
            raise ValueError(
                f"config key model.{key}={n} cannot be split over train.mesh.tensor={tensor} (attention heads are "
                f"sharded over the tensor axis); choose a tensor size that divides {n}"
            )


def parse_value(key: str, text: str) -> Any:
    """Parse the command-line string ``text`` for config key ``key`` with the key's type."""
    if key not in LEAVES:
        raise options.unknown_key_error(key, list(LEAVES))
    return options.parse(key, text, LEAVES[key].type)


def apply_overrides(cfg: Config | ml_collections.ConfigDict | Mapping, overrides: Mapping[str, str]) -> Config:
    """The Config of ``cfg`` (a Config, a config file's ConfigDict or a mapping) with ``{"a.b": "text"}`` overrides
    applied (parsed by schema type), checked and passed through :func:`resolve`."""
    values = {key: parse_value(key, text) for key, text in overrides.items()}
    return resolve(with_values(build(cfg), values))


def _shipped_configs() -> list[str]:
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
    if path.is_dir():
        what = "is a directory; expected a Python file that defines get_config()"
    elif path.suffix or len(path.parts) > 1:
        what = "does not exist"
    else:
        what = "is neither a file nor a shipped config"
    raise ValueError(
        f"config {str(name_or_path)!r} {what}; shipped configs: {', '.join(_shipped_configs())} "
        "(give one by name, or a path such as configs/tiny_cpu.py)"
    )


def _code_error(path: Path, e: Exception) -> ValueError:
    """``config file 'X': SyntaxError at line 3: invalid syntax`` for an exception raised by the code of the config
    file ``path``: the line is the innermost one in a file of ``path``'s directory (the file itself, or a base config
    it imports, then named too)."""
    if isinstance(e, SyntaxError) and e.filename:
        where, line, text = e.filename, e.lineno, e.msg
    else:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")]  # not <frozen>
        here = [f for f in frames if Path(f.filename).resolve().parent == path.parent.resolve()]
        where, line, text = (here[-1].filename, here[-1].lineno, str(e)) if here else (None, None, str(e))
    at = ""
    if line is not None:
        at = f" at line {line}" if Path(where).resolve() == path.resolve() else f" at {where} line {line}"
    text = " ".join(text.split())  # one line
    return ValueError(f"config file {str(path)!r}: {type(e).__name__}{at}" + (f": {text}" if text else ""))


def _run_config_file(path: Path) -> Any:
    """Import the config file ``path`` (its directory on ``sys.path`` meanwhile) and return ``get_config()``;
    ValueError naming the file for code that fails (a syntax error, a missing module, an exception) and for a file
    without a ``get_config``."""
    spec = importlib.util.spec_from_file_location(f"_lpt_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        spec.loader.exec_module(module)
        get_config = getattr(module, "get_config", None)
        made = get_config() if get_config is not None else None
    except Exception as e:  # noqa: BLE001 -- the file's own code failed: bad input, named in one line
        raise _code_error(path, e) from None
    finally:
        sys.path.pop(0)
    if get_config is None:
        raise ValueError(f"config file {str(path)!r} does not define get_config()")
    return made


def load_config_file(path: str | Path) -> Config:
    """Import ``path`` (a Python file defining ``get_config()``, or the name of a shipped config such as
    ``tiny_cpu``) and return its typed, checked Config; ValueError naming the file when its code fails or
    ``get_config()`` returns something other than a ConfigDict or a mapping of keys."""
    path = resolve_config(path)
    made = _run_config_file(path)
    if not isinstance(made, ml_collections.ConfigDict | Mapping):
        raise ValueError(
            f"config file {str(path)!r}: get_config() returned {type(made).__name__} ({made!r:.60}); it must return "
            "an ml_collections.ConfigDict (e.g. lpt.train.config.defaults() with its keys set) or a mapping of keys"
        )
    return build(made)


def schema_help(cfg: Config | None = None) -> str:
    """The config keys with their types, allowed values or ranges and docs for ``--help``; with ``cfg``, each key's
    value."""
    flat = _flatten(cfg) if cfg is not None else {}
    head = "config keys (override any with --config.KEY=VALUE or --config.KEY VALUE; tuples as a,b)"
    lines = [head + (": values from the given --config" if cfg is not None else ": defaults")]
    for key, leaf in LEAVES.items():
        value = flat[key] if key in flat else leaf.default
        choices = f"  one of: {', '.join(map(str, leaf.choices))}" if leaf.choices else ""
        bounds = f" {leaf.bounds}" if leaf.bounds is not None else ""
        lines.append(f"  {key} = {value!r}  ({options.type_name(leaf.type)}{bounds}){choices}")
        lines.append(f"      {leaf.doc}")
    return "\n".join(lines)


def _help_for(config: str) -> str:
    try:
        return schema_help(load_config_file(config))
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


def parse_args(argv: list[str]) -> tuple[Config, argparse.Namespace]:
    """Parse ``--config FILE --workdir DIR [--config.key=value ...]`` (+ optional multi-process flags) into the
    run's Config, resolved (:func:`apply_overrides`)."""
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
