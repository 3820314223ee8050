"""A Hugging Face ``config.json`` (GPT-2, Llama, Qwen2, Qwen3 or Mistral) <-> lpt's ``config.model``.

Llama, Qwen2, Qwen3 and Mistral are all lpt's ``kind="llama"``: Qwen2 is a Llama with ``qkv_bias``, Qwen3 one with
``qk_norm`` and (usually) a ``head_dim`` other than ``hidden_size / num_attention_heads``, Mistral without a sliding
window shorter than ``max_position_embeddings`` a Llama (lpt has no sliding-window attention: a shorter window is
refused).

:func:`read_config` maps a directory's config.json to ``config.model`` (keys the file leaves out take transformers'
defaults; what lpt's models cannot express is a one-line ValueError); :func:`hf_config` is its inverse. The
special token ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) that ``transformers.generate`` starts,
stops and pads with: :func:`read_token_ids` reads a directory's, :func:`tokenizer_token_ids` derives them from a
tokenizer.json, :func:`generation_config` is the ``generation_config.json`` that carries them.
"""

from __future__ import annotations

from pathlib import Path

import ml_collections

from lpt.models.config import model_spec
from lpt.models.hf_files import _is_index as _is_id
from lpt.models.hf_files import read_json
from lpt.options import to_dict

# Hugging Face architecture -> its family (the config.json keys it reads); every family but gpt2 is lpt's kind "llama"
ARCHITECTURES = {
    "GPT2LMHeadModel": "gpt2",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")  # the special token ids of config.json
# end-of-text tokens by the names common tokenizers give them, in the order lpt.data.tokenizer looks for them: the
# first one a tokenizer.json has is the separator lpt packs between documents
END_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
_MODEL_TYPES = {family: family for family in ARCHITECTURES.values()}  # model_type -> family (the same names)
_CLASSES = {family: arch for arch, family in ARCHITECTURES.items()}  # family -> architecture

# defaults of transformers' GPT2Config / LlamaConfig / Qwen2Config / Qwen3Config / MistralConfig, for keys a
# config.json leaves out
_GPT2_DEFAULTS = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_inner": None,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
}
_LLAMA_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "head_dim": None,
}
_QWEN_DEFAULTS = {  # Qwen2Config's (it reads head_dim when the file has one: d / h otherwise)
    **{k: v for k, v in _LLAMA_DEFAULTS.items() if k not in ("attention_bias", "mlp_bias")},
    "vocab_size": 151936,
    "intermediate_size": 22016,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}
_DEFAULTS = {
    "llama": _LLAMA_DEFAULTS,
    "qwen2": _QWEN_DEFAULTS,
    "qwen3": {**_QWEN_DEFAULTS, "head_dim": 128, "attention_bias": False},
    "mistral": {
        **{k: v for k, v in _LLAMA_DEFAULTS.items() if k not in ("attention_bias", "mlp_bias")},
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
    },
}
_NULLABLE = ("num_key_value_heads", "head_dim", "sliding_window")  # null: the derived value (h, d / h) or no window
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # GELU with the tanh approximation (lpt's GPT-2 MLP)
_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}  # Hugging Face rope_type -> lpt's


def model_family(hf: dict, where) -> str:
    """The family of a config.json dict ("gpt2", "llama", "qwen2", "qwen3"), from ``architectures`` or else
    ``model_type``; ``where`` names the file in the ValueError when neither is supported."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"{where}: architectures={archs!r} is not a list of class names")
    if archs:
        known = [a for a in archs if a in ARCHITECTURES]
        if not known:
            raise ValueError(f"{where}: architectures={archs} is not supported; allowed: {list(ARCHITECTURES)}")
        return ARCHITECTURES[known[0]]
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in _MODEL_TYPES:
        raise ValueError(
            f"{where}: model_type={model_type!r} (no architectures) is not supported; allowed: {list(_MODEL_TYPES)}"
        )
    return _MODEL_TYPES[model_type]


def model_kind(hf: dict, where) -> str:
    """lpt's ``config.model.kind`` ("gpt2" or "llama") of a config.json dict (:func:`model_family`)."""
    return "gpt2" if model_family(hf, where) == "gpt2" else "llama"


def _model_cfg(where, **kw) -> ml_collections.ConfigDict:
    """``config.model`` with every key: ``kw`` over the model section's defaults, checked by lpt's own rules
    (divisibility, even head_dim, ...); their ValueError is prefixed with ``where``."""
    try:
        return ml_collections.ConfigDict(to_dict(model_spec(kw)))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


# the JSON types a config.json value may have, by the type of transformers' default (None: an optional integer)
_JSON_TYPES = {
    bool: ((bool,), "true or false"),
    int: ((int,), "an integer"),
    float: ((int, float), "a number"),
    str: ((str,), "a string"),
    type(None): ((int, type(None)), "an integer or null"),
}


def _typed(hf: dict, defaults: dict, where) -> dict:
    """``hf`` over ``defaults``, each default's key checked to hold a JSON value of the default's type (JSON true
    and false are not numbers; the keys of :data:`_NULLABLE` may be null too); ValueError naming ``where`` and the
    key."""
    c = {**defaults, **hf}
    for key, default in defaults.items():
        types, name = _JSON_TYPES[type(default)]
        if key in _NULLABLE and default is not None:
            types, name = (*types, type(None)), f"{name} or null"
        if not isinstance(c[key], types) or (isinstance(c[key], bool) and bool not in types):
            raise ValueError(f"{where}: {key}={c[key]!r} is not {name}")
    return c


def _gpt2_config(hf: dict, where) -> ml_collections.ConfigDict:
    c = _typed(hf, _GPT2_DEFAULTS, where)
    if c["activation_function"] not in _GELU_TANH:
        raise ValueError(
            f"{where}: activation_function={c['activation_function']!r} is not supported; "
            f"allowed: {list(_GELU_TANH)} (GELU, tanh approximation)"
        )
    for key, want in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if bool(c[key]) != want:
            raise ValueError(f"{where}: {key}={c[key]!r} is not supported; allowed: {want}")
    return _model_cfg(
        where,
        kind="gpt2",
        vocab_size=int(c["vocab_size"]),
        d_model=int(c["n_embd"]),
        n_layers=int(c["n_layer"]),
        n_heads=int(c["n_head"]),
        n_kv_heads=int(c["n_head"]),
        d_ff=int(c["n_inner"] or 4 * c["n_embd"]),
        max_seq_len=int(c["n_positions"]),
        norm_eps=float(c["layer_norm_epsilon"]),
        tie_embeddings=bool(c["tie_word_embeddings"]),
        init_std=float(c["initializer_range"]),
    )


def _rope(c: dict, where) -> tuple[float, dict]:
    """(rope_theta, lpt rope_scaling) from ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5); like
    transformers, rope_scaling wins when both are set."""
    section = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    rope = c.get(section) or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{where}: {section}={rope!r} is not a JSON object")
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{where}: per-layer-type rope parameters {sorted(rope)} are not supported")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(kind, str) or kind not in _ROPE_TYPES:
        raise ValueError(f"{where}: rope type {kind!r} is not supported; allowed: {list(_ROPE_TYPES)}")

    def number(key: str, default=None) -> float:  # rope[key] (missing or null: default), a JSON number
        v = default if rope.get(key) is None else rope[key]
        if v is None:
            raise ValueError(f"{where}: {section} of rope type {kind!r} has no {key}")
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"{where}: {section}.{key}={v!r} is not a number")
        return float(v)

    theta = number("rope_theta", c["rope_theta"])
    if number("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"{where}: partial_rotary_factor={rope['partial_rotary_factor']!r} is not supported; allowed: 1.0"
        )
    out = {"type": _ROPE_TYPES[kind]}
    if kind in ("linear", "llama3"):
        out["factor"] = number("factor")
    if kind == "llama3":
        out["low_freq_factor"] = number("low_freq_factor")
        out["high_freq_factor"] = number("high_freq_factor")
        out["original_max_len"] = int(number("original_max_position_embeddings", c["max_position_embeddings"]))
    return theta, out


def _check_no_window(hf: dict, c: dict, where, family: str) -> None:
    """ValueError when a Qwen2, Qwen3 or Mistral config.json has a layer that attends through a sliding window
    shorter than ``max_position_embeddings`` (as transformers reads them: Mistral's ``sliding_window`` applies to
    every layer; Qwen's only with ``use_sliding_window`` true, to the layers ``layer_types`` names
    "sliding_attention" or, without ``layer_types``, to the layers from ``max_window_layers`` on). A window at least
    ``max_position_embeddings`` long masks no key of any sequence the model accepts."""
    window = c["sliding_window"]
    if window is None or window >= c["max_position_embeddings"]:
        return
    if family == "mistral":
        raise ValueError(
            f"{where}: sliding_window={window} < max_position_embeddings={c['max_position_embeddings']} is not "
            "supported (lpt has no sliding-window attention)"
        )
    if not c["use_sliding_window"]:
        return
    types = hf.get("layer_types")
    if types is None:
        sliding = c["num_hidden_layers"] > c["max_window_layers"]
    elif isinstance(types, list) and all(t in ("full_attention", "sliding_attention") for t in types):
        sliding = "sliding_attention" in types
    else:
        raise ValueError(f"{where}: layer_types={types!r} is not a list of 'full_attention' / 'sliding_attention'")
    if sliding:
        raise ValueError(
            f"{where}: use_sliding_window=true with sliding_window={window} < max_position_embeddings="
            f"{c['max_position_embeddings']} is not supported (lpt has no sliding-window attention)"
        )


def _llama_config(hf: dict, where, family: str) -> ml_collections.ConfigDict:
    """``config.model`` of a Llama, Qwen2, Qwen3 or Mistral config.json (kind "llama"; Qwen2: ``qkv_bias``, Qwen3:
    ``qk_norm``)."""
    c = _typed(hf, _DEFAULTS[family], where)
    if c["hidden_act"] != "silu":
        raise ValueError(f"{where}: hidden_act={c['hidden_act']!r} is not supported; allowed: ['silu']")
    if c.get("attention_bias"):
        raise ValueError(
            f"{where}: attention_bias={c['attention_bias']!r} is not supported (lpt has no bias on o_proj); "
            "allowed: false"
        )
    if c.get("mlp_bias"):
        raise ValueError(
            f"{where}: mlp_bias={c['mlp_bias']!r} is not supported (lpt's MLP has no biases); allowed: false"
        )
    if family != "llama":
        _check_no_window(hf, c, where, family)
    d, h, head_dim = int(c["hidden_size"]), int(c["num_attention_heads"]), c["head_dim"]
    if head_dim is not None and head_dim <= 0:
        raise ValueError(f"{where}: head_dim={head_dim} must be a positive integer")
    if head_dim is not None and h > 0 and d == h * head_dim:  # h <= 0: refused by _model_cfg
        head_dim = None  # lpt's head_dim=0: d / h
    theta, scaling = _rope(c, where)
    return _model_cfg(
        where,
        kind="llama",
        vocab_size=int(c["vocab_size"]),
        d_model=d,
        n_layers=int(c["num_hidden_layers"]),
        n_heads=h,
        n_kv_heads=int(c["num_key_value_heads"] or h),
        head_dim=int(head_dim or 0),
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        d_ff=int(c["intermediate_size"]),
        max_seq_len=int(c["max_position_embeddings"]),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(c["rms_norm_eps"]),
        tie_embeddings=bool(c["tie_word_embeddings"]),
        init_std=float(c["initializer_range"]),
    )


def read_config(path: str | Path) -> ml_collections.ConfigDict:
    """The lpt ``config.model`` of a Hugging Face model directory's ``config.json`` (every key of
    configs/tiny_cpu.py's ``c.model``; ``scan_layers`` and ``remat`` False).

    GPT-2: ``n_embd``, ``n_layer``, ``n_head``, ``n_inner`` (None: 4 n_embd), ``n_positions``,
    ``layer_norm_epsilon``, ``tie_word_embeddings``, ``initializer_range``; ``activation_function`` must be a tanh
    GELU. Llama, Qwen2, Qwen3, Mistral: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim`` (0 in lpt when it is hidden_size / num_attention_heads),
    ``intermediate_size``, ``max_position_embeddings``, ``rms_norm_eps``, ``tie_word_embeddings``, ``rope_theta`` and
    ``rope_scaling`` / ``rope_parameters`` (type default, linear or llama3); ``hidden_act`` must be silu,
    ``attention_bias`` / ``mlp_bias`` false; Qwen2 sets ``qkv_bias``, Qwen3 ``qk_norm``; a Qwen2 / Qwen3 / Mistral
    layer with a sliding window shorter than ``max_position_embeddings`` is refused. Keys a config.json leaves out take
    transformers' defaults. Anything else, or a file that is not a JSON object or holds a value of another type than
    transformers' default (a string for an integer, ...): a one-line ValueError naming the file.
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(
            f"{path} has no config.json (a Hugging Face model directory holds config.json and model.safetensors)"
        )
    hf = read_json(file)
    family = model_family(hf, file)
    return _gpt2_config(hf, file) if family == "gpt2" else _llama_config(hf, file, family)


def check_token_ids(token_ids: dict, where, vocab_size: int | None = None) -> dict:
    """``token_ids`` (keys of :data:`TOKEN_KEYS`; values None, an id >= 0 or, for ``eos_token_id``, a non-empty list
    of ids) without its None values; with ``vocab_size`` each id must be below it. ValueError naming ``where``, the
    key and what is allowed."""
    out = {}
    for key, v in token_ids.items():
        if key not in TOKEN_KEYS:
            raise ValueError(f"{where}: unknown key {key!r}; allowed: {list(TOKEN_KEYS)}")
        if v is None:
            continue
        many = key == "eos_token_id" and isinstance(v, list) and v
        if not (_is_id(v) or (many and all(map(_is_id, v)))):
            also = " or a non-empty list of them" if key == "eos_token_id" else ""
            raise ValueError(f"{where}: {key}={v!r} is not a token id (an integer >= 0){also}")
        if vocab_size is not None and any(i >= vocab_size for i in (v if many else [v])):
            raise ValueError(f"{where}: {key}={v!r} is outside the model's vocabulary [0, {vocab_size})")
        out[key] = v
    return out


def read_token_ids(path: str | Path) -> dict:
    """The special token ids a Hugging Face model directory sets: ``bos_token_id``, ``eos_token_id`` (an id or a list
    of ids), ``pad_token_id`` from its ``generation_config.json``, else its ``config.json``; keys that both leave
    out or set to null are absent. ValueError naming the file for a value that is not a token id."""
    out = {}
    for name in ("config.json", "generation_config.json"):  # the second one wins
        file = Path(path) / name
        if file.is_file():
            obj = read_json(file)
            out.update(check_token_ids({k: obj.get(k) for k in TOKEN_KEYS}, file))
    return out


def tokenizer_token_ids(file: str | Path) -> dict:
    """``{bos_token_id, eos_token_id, pad_token_id}`` of a model trained by lpt with the tokenizer.json ``file``: all
    three are the separator lpt packs between documents (the first of :data:`END_TOKENS` the file has, else id 0, as
    :func:`lpt.data.load_tokenizer` picks it). The model saw it before every document but the first and learned to
    emit it where a document ends. ValueError naming the file when ``tokenizers`` cannot read it."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        raise ValueError(f"tokenizer_file={str(file)!r} is not a Hugging Face tokenizer.json ({first})") from None
    ids = [tok.token_to_id(t) for t in END_TOKENS]
    return dict.fromkeys(TOKEN_KEYS, next((i for i in ids if i is not None), 0))


def generation_config(token_ids: dict) -> dict:
    """The ``generation_config.json`` dict of ``token_ids``: the ids it sets (None values left out), which
    ``transformers.generate`` starts (bos), stops (eos) and pads (pad) with."""
    return {k: token_ids[k] for k in TOKEN_KEYS if token_ids.get(k) is not None}


def hf_family(model_cfg) -> str:
    """The Hugging Face family that writes ``config.model``: "gpt2"; for kind "llama" "qwen2" with ``qkv_bias``,
    "qwen3" with ``qk_norm``, else "llama" (a Mistral read by :func:`read_config` is written as the Llama it is).
    ValueError for a model no architecture holds: ``qkv_bias`` and ``qk_norm`` together, or a Llama whose
    ``d_model`` is not divisible by ``n_heads``."""
    s = model_spec(model_cfg)
    if s.kind == "gpt2":
        return "gpt2"
    if s.qkv_bias and s.qk_norm:
        raise ValueError(
            "config.model.qkv_bias=True and qk_norm=True have no Hugging Face architecture (Qwen2: qkv_bias, "
            "Qwen3: qk_norm)"
        )
    if s.qkv_bias or s.qk_norm:
        return "qwen2" if s.qkv_bias else "qwen3"
    if s.d_model % s.n_heads:
        raise ValueError(
            f"config.model.d_model={s.d_model} is not divisible by n_heads={s.n_heads}: LlamaForCausalLM needs "
            "hidden_size divisible by num_attention_heads (whatever head_dim)"
        )
    return "llama"


def hf_config(model_cfg, *, dtype: str = "float32", token_ids: dict | None = None) -> dict:
    """The ``config.json`` dict of ``config.model`` (the inverse of :func:`read_config`), for the architecture of
    :func:`hf_family`. Llama's, Qwen2's and Qwen3's RoPE goes both into ``rope_theta`` / ``rope_scaling``
    (transformers 4) and ``rope_parameters`` (transformers 5). ``token_ids``: the ``bos_token_id`` /
    ``eos_token_id`` / ``pad_token_id`` to write (null for the ones it leaves out)."""
    s, family = model_spec(model_cfg), hf_family(model_cfg)
    ids = token_ids or {}
    common = {
        "vocab_size": s.vocab_size,
        "initializer_range": s.init_std,
        "tie_word_embeddings": s.tie_embeddings,
        **{k: ids.get(k) for k in TOKEN_KEYS},
        "dtype": dtype,
    }
    if s.kind == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_embd": s.d_model,
            "n_layer": s.n_layers,
            "n_head": s.n_heads,
            "n_inner": s.d_ff,
            "n_positions": s.max_seq_len,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": s.norm_eps,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            **common,
        }
    rs = s.rope_scaling
    rope = {
        "rope_type": {"none": "default", "linear": "linear", "llama3": "llama3"}[rs.type],
        "rope_theta": s.rope_theta,
    }
    if rs.type != "none":
        rope["factor"] = rs.factor
    if rs.type == "llama3":
        rope.update(
            low_freq_factor=rs.low_freq_factor,
            high_freq_factor=rs.high_freq_factor,
            original_max_position_embeddings=rs.original_max_len,
        )
    scaling = None if rs.type == "none" else {k: v for k, v in rope.items() if k != "rope_theta"}
    if family == "llama":
        extra = {"attention_bias": False, "mlp_bias": False}
    else:  # Qwen2 (biases on q, k, v: always) and Qwen3 (q_norm, k_norm: always), without sliding windows
        bias = {"attention_bias": False} if family == "qwen3" else {}
        extra = {**bias, "use_sliding_window": False, "sliding_window": None, "max_window_layers": s.n_layers}
    return {
        "architectures": [_CLASSES[family]],
        "model_type": family,
        "hidden_size": s.d_model,
        "num_hidden_layers": s.n_layers,
        "num_attention_heads": s.n_heads,
        "num_key_value_heads": s.n_kv_heads,
        "head_dim": s.head_width,
        "intermediate_size": s.d_ff,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_seq_len,
        "rms_norm_eps": s.norm_eps,
        "rope_theta": s.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope,
        **extra,
        "attention_dropout": 0.0,
        **common,
    }
