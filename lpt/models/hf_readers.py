"""The per-family readers of a Hugging Face ``config.json``: transformers' defaults of GPT-2, Llama, Qwen2, Qwen3
and Mistral for the keys a file leaves out, the JSON type check of each value, and the mapping to lpt's
``config.model`` (RoPE scaling, Qwen2's q, k, v biases, Qwen3's q / k norms, sliding windows).

:func:`gpt2_config` and :func:`llama_config` are what :func:`lpt.models.hf_config.read_config` calls for a file of
that family; what lpt's models cannot express is a one-line ValueError naming the file.

Sliding windows, as transformers reads them (:func:`sliding_window`): Mistral's ``sliding_window`` applies to every
layer; Qwen2's and Qwen3's only with ``use_sliding_window`` true, to the layers ``layer_types`` names
"sliding_attention" or, without ``layer_types``, to the layers from ``max_window_layers`` on. A window that every
layer uses becomes ``config.model.sliding_window``; one that only some layers use is refused (lpt's layers share
one attention); one at least ``max_position_embeddings`` long masks no key of any sequence the model accepts and
becomes 0 (no window).
"""

from __future__ import annotations

from lpt.models.config import ModelSpec, model_spec

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


def model_cfg(where, **kw) -> ModelSpec:
    """``config.model``: ``kw`` over the model section's defaults, checked by lpt's own rules (divisibility, even
    head_dim, ...); their ValueError is prefixed with ``where``."""
    try:
        return model_spec(kw)
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


def typed(hf: dict, defaults: dict, where) -> dict:
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


def gpt2_config(hf: dict, where) -> ModelSpec:
    """``config.model`` of a GPT-2 config.json (kind "gpt2")."""
    c = typed(hf, _GPT2_DEFAULTS, where)
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
    return model_cfg(
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


def rope(c: dict, where) -> tuple[float, dict]:
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


def sliding_window(hf: dict, c: dict, where, family: str) -> int:
    """lpt's ``sliding_window`` of a Qwen2, Qwen3 or Mistral config.json (``c``: ``hf`` over the family's defaults;
    module docstring): the window every layer uses, or 0. ValueError for a window shorter than
    ``max_position_embeddings`` that only some layers use, a window < 1 or ``layer_types`` that is not a list of
    "full_attention" / "sliding_attention"."""
    window = c["sliding_window"]
    if window is None or window >= c["max_position_embeddings"]:
        return 0
    if window < 1:
        raise ValueError(f"{where}: sliding_window={window} must be a positive integer or null")
    if family == "mistral":
        return int(window)
    if not c["use_sliding_window"]:
        return 0
    types = hf.get("layer_types")
    if types is None:
        types = [
            "sliding_attention" if i >= c["max_window_layers"] else "full_attention"
            for i in range(c["num_hidden_layers"])
        ]
    elif not (isinstance(types, list) and all(t in ("full_attention", "sliding_attention") for t in types)):
        raise ValueError(f"{where}: layer_types={types!r} is not a list of 'full_attention' / 'sliding_attention'")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if not sliding:
        return 0
    if len(sliding) < len(types):
        raise ValueError(
            f"{where}: use_sliding_window=true with sliding_window={window} on layers {sliding} only (layer_types / "
            f"max_window_layers) is not supported: lpt's layers share one attention; allowed: every layer or none"
        )
    return int(window)


def llama_config(hf: dict, where, family: str) -> ModelSpec:
    """``config.model`` of a Llama, Qwen2, Qwen3 or Mistral config.json (kind "llama"; Qwen2: ``qkv_bias``, Qwen3:
    ``qk_norm``; Qwen2, Qwen3, Mistral: ``sliding_window``)."""
    c = typed(hf, _DEFAULTS[family], where)
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
    d, h, head_dim = int(c["hidden_size"]), int(c["num_attention_heads"]), c["head_dim"]
    if head_dim is not None and head_dim <= 0:
        raise ValueError(f"{where}: head_dim={head_dim} must be a positive integer")
    if head_dim is not None and h > 0 and d == h * head_dim:  # h <= 0: refused by model_cfg
        head_dim = None  # lpt's head_dim=0: d / h
    theta, scaling = rope(c, where)
    return model_cfg(
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
        sliding_window=0 if family == "llama" else sliding_window(hf, c, where, family),
        d_ff=int(c["intermediate_size"]),
        max_seq_len=int(c["max_position_embeddings"]),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(c["rms_norm_eps"]),
        tie_embeddings=bool(c["tie_word_embeddings"]),
        init_std=float(c["initializer_range"]),
    )
