"""Validated, hashable views of ``config.model`` and ``config.precision``.

The trainer's configs are ``ml_collections.ConfigDict``; the model turns them into frozen dataclasses once, so that
a typo becomes a ``ValueError`` naming the key and the allowed ones, and so the precision choices can live as static
(hashable) attributes of NNX modules.

Storage rule. ``update_rule == "f32_master"`` stores every parameter in float32 and each layer views it through
``param_dtype`` (round-to-nearest-even, straight-through gradient) and then ``compute_dtype``; with any other update
rule the parameters are stored in ``param_dtype`` itself (the optimizer's last transform keeps them there). GaussWS
bitwidth parameters are always float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax.numpy as jnp

from lpt.optim.recipes import UPDATE_RULES as ROUNDING_RULES

PARAM_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
}
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
UPDATE_RULES = ("f32_master", *ROUNDING_RULES)  # f32 master weights, or a rule of lpt.optim that rounds into params
KINDS = ("llama", "gpt2")
LAYER_KINDS = ("qkv", "out", "up", "down", "lm_head")
MATMULS = ("bf16", "fp8")
ATTENTION_IMPLS = ("xla", "pallas", "softmax")
PQT_METHODS = ("none", "gaussws", "diffq")
PQT_LAYER_KINDS = ("qkv", "out", "up", "down")


def _as_dict(cfg, what: str) -> dict:
    if cfg is None:
        return {}
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    if isinstance(cfg, Mapping):
        return dict(cfg)
    raise ValueError(f"{what} must be a ConfigDict or a mapping, got {type(cfg).__name__}")


def _take(d: dict, allowed: dict, what: str) -> dict:
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {what}; valid keys: {sorted(allowed)}")
    out = dict(allowed)
    out.update(d)
    missing = [k for k, v in out.items() if v is _REQUIRED]
    if missing:
        raise ValueError(f"{what} is missing required key(s) {missing}")
    return out


def _choice(value, allowed, what: str):
    if value not in allowed:
        raise ValueError(f"{what}={value!r} is not supported; allowed: {list(allowed)}")
    return value


_REQUIRED = object()


ROPE_SCALINGS = ("none", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (see :func:`lpt.models.layers.rope_inv_freq`); Hugging Face's ``rope_scaling``."""

    type: str = "none"  # "none" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_len: int = 8192  # llama3 only: the context length the model was pretrained at


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    kind: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    rope_theta: float
    norm_eps: float
    tie_embeddings: bool
    init_std: float
    remat: bool = False
    scan_layers: bool = False
    rope_scaling: RopeScaling = RopeScaling()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclasses.dataclass(frozen=True)
class PrecisionSpec:
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    update_rule: str = "f32_master"
    matmul: tuple[tuple[str, str], ...] = tuple((k, "bf16") for k in LAYER_KINDS)
    attention_impl: str = "xla"
    attention_stable: bool = True
    attention_beta: float = 7.0
    pqt_method: str = "none"
    pqt_layers: tuple[str, ...] = ()
    pqt_b_init: float = 6.0
    pqt_b_target: float = 4.0
    pqt_loss_weight: float = 0.0

    @property
    def store_dtype(self):
        """dtype the parameters are stored in (float32 under f32_master)."""
        return jnp.float32 if self.update_rule == "f32_master" else PARAM_DTYPES[self.param_dtype]

    @property
    def view_dtype(self):
        """dtype the layers see the weights in before casting to compute dtype."""
        return PARAM_DTYPES[self.param_dtype]

    @property
    def compute(self):
        return COMPUTE_DTYPES[self.compute_dtype]

    def matmul_for(self, layer_kind: str) -> str:
        return dict(self.matmul)[layer_kind]

    def pqt_for(self, layer_kind: str) -> str:
        return self.pqt_method if layer_kind in self.pqt_layers else "none"


def model_spec(model_cfg) -> ModelSpec:
    d = _take(
        _as_dict(model_cfg, "config.model"),
        {
            "kind": _REQUIRED,
            "vocab_size": 256,
            "d_model": _REQUIRED,
            "n_layers": _REQUIRED,
            "n_heads": _REQUIRED,
            "n_kv_heads": None,
            "d_ff": _REQUIRED,
            "max_seq_len": _REQUIRED,
            "rope_theta": 10000.0,
            "norm_eps": 1e-5,
            "tie_embeddings": False,
            "init_std": 0.02,
            "remat": False,
            "scan_layers": False,
            "rope_scaling": {},
        },
        "config.model",
    )
    rs = _take(
        _as_dict(d["rope_scaling"], "config.model.rope_scaling"),
        {f.name: f.default for f in dataclasses.fields(RopeScaling)},
        "config.model.rope_scaling",
    )
    _choice(rs["type"], ROPE_SCALINGS, "config.model.rope_scaling.type")
    if rs["type"] != "none" and not float(rs["factor"]) > 0:
        raise ValueError(f"config.model.rope_scaling.factor={rs['factor']!r} must be > 0")
    if rs["type"] == "llama3" and not float(rs["high_freq_factor"]) > float(rs["low_freq_factor"]):
        raise ValueError(
            f"config.model.rope_scaling: high_freq_factor={rs['high_freq_factor']!r} must exceed "
            f"low_freq_factor={rs['low_freq_factor']!r}"
        )
    d["rope_scaling"] = RopeScaling(
        type=rs["type"],
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_len=int(rs["original_max_len"]),
    )
    _choice(d["kind"], KINDS, "config.model.kind")
    if d["n_kv_heads"] is None:
        d["n_kv_heads"] = d["n_heads"]
    if d["kind"] == "gpt2" and d["n_kv_heads"] != d["n_heads"]:
        raise ValueError(f"gpt2 has no GQA: n_kv_heads={d['n_kv_heads']} must equal n_heads={d['n_heads']}")
    for k in ("remat", "scan_layers", "tie_embeddings"):
        if not isinstance(d[k], bool):
            raise ValueError(f"config.model.{k}={d[k]!r} must be a bool")
    for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
        if not isinstance(d[k], int) or d[k] <= 0:
            raise ValueError(f"config.model.{k}={d[k]!r} must be a positive int")
    if d["d_model"] % d["n_heads"]:
        raise ValueError(f"config.model.d_model={d['d_model']} is not divisible by n_heads={d['n_heads']}")
    if d["n_heads"] % d["n_kv_heads"]:
        raise ValueError(f"config.model.n_heads={d['n_heads']} is not divisible by n_kv_heads={d['n_kv_heads']}")
    if d["kind"] == "llama" and (d["d_model"] // d["n_heads"]) % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {d['d_model'] // d['n_heads']}")
    return ModelSpec(**{k: d[k] for k in (f.name for f in dataclasses.fields(ModelSpec))})


def precision_spec(precision_cfg) -> PrecisionSpec:
    d = _take(
        _as_dict(precision_cfg, "config.precision"),
        {
            "param_dtype": "float32",
            "compute_dtype": "float32",
            "update_rule": "f32_master",
            # the optimizer's keys (lpt.train.optimizer; validated by lpt.train.config): accepted, not stored
            "moment_rounding": "stochastic",
            "update_impl": "xla",
            "matmul": {},
            "attention": {},
            "pqt": {},
        },
        "config.precision",
    )
    _choice(d["param_dtype"], PARAM_DTYPES, "config.precision.param_dtype")
    _choice(d["compute_dtype"], COMPUTE_DTYPES, "config.precision.compute_dtype")
    _choice(d["update_rule"], UPDATE_RULES, "config.precision.update_rule")
    mm = _take(
        _as_dict(d["matmul"], "config.precision.matmul"), dict.fromkeys(LAYER_KINDS, "bf16"), "config.precision.matmul"
    )
    for k, v in mm.items():
        _choice(v, MATMULS, f"config.precision.matmul.{k}")
    att = _take(
        _as_dict(d["attention"], "config.precision.attention"),
        {"impl": "xla", "stable": True, "beta": 7.0},
        "config.precision.attention",
    )
    _choice(att["impl"], ATTENTION_IMPLS, "config.precision.attention.impl")
    pqt = _take(
        _as_dict(d["pqt"], "config.precision.pqt"),
        {"method": "none", "layers": (), "b_init": 6.0, "b_target": 4.0, "loss_weight": 0.0},
        "config.precision.pqt",
    )
    _choice(pqt["method"], PQT_METHODS, "config.precision.pqt.method")
    layers = (pqt["layers"],) if isinstance(pqt["layers"], str) else tuple(pqt["layers"])
    for k in layers:
        _choice(k, PQT_LAYER_KINDS, "config.precision.pqt.layers entry")
    return PrecisionSpec(
        param_dtype=d["param_dtype"],
        compute_dtype=d["compute_dtype"],
        update_rule=d["update_rule"],
        matmul=tuple((k, mm[k]) for k in LAYER_KINDS),
        attention_impl=att["impl"],
        attention_stable=bool(att["stable"]),
        attention_beta=float(att["beta"]),
        pqt_method=pqt["method"],
        pqt_layers=layers,
        pqt_b_init=float(pqt["b_init"]),
        pqt_b_target=float(pqt["b_target"]),
        pqt_loss_weight=float(pqt["loss_weight"]),
    )
