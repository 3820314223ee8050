"""A Hugging Face ``config.json`` (GPT-2, Llama, Qwen2, Qwen3 or Mistral) <-> lpt's ``config.model``.

Llama, Qwen2, Qwen3 and Mistral are all lpt's ``kind="llama"``: Qwen2 is a Llama with ``qkv_bias``, Qwen3 one with
``qk_norm`` and (usually) a ``head_dim`` other than ``hidden_size / num_attention_heads``, Mistral one with
``sliding_window`` (0 when its window is null or covers ``max_position_embeddings``: then it is a plain Llama).

:func:`read_config` maps a directory's config.json to ``config.model`` with the per-family readers of
:mod:`lpt.models.hf_readers` (keys the file leaves out take transformers' defaults; what lpt's models cannot express
is a one-line ValueError); :func:`hf_config` is its inverse. The
special token ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) that ``transformers.generate`` starts,
stops and pads with: :func:`read_token_ids` reads a directory's, :func:`tokenizer_token_ids` derives them from a
tokenizer.json, :func:`generation_config` is the ``generation_config.json`` that carries them.
"""

from __future__ import annotations

from pathlib import Path

from lpt.models.config import ModelSpec, model_spec
from lpt.models.hf_files import _is_index as _is_id
from lpt.models.hf_files import read_json
from lpt.models.hf_readers import gpt2_config, llama_config

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


def _model_family(hf: dict, where) -> str:
    """The family of a config.json dict ("gpt2", "llama", "qwen2", "qwen3", "mistral"), from ``architectures`` or else
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
    """lpt's ``config.model.kind`` ("gpt2" or "llama") of a config.json dict (:func:`_model_family`)."""
    return "gpt2" if _model_family(hf, where) == "gpt2" else "llama"


def read_config(path: str | Path) -> ModelSpec:
    """The lpt ``config.model`` of a Hugging Face model directory's ``config.json`` (every key of
    configs/tiny_cpu.py's ``c.model``; ``scan_layers`` and ``remat`` False).

    GPT-2: ``n_embd``, ``n_layer``, ``n_head``, ``n_inner`` (None: 4 n_embd), ``n_positions``,
    ``layer_norm_epsilon``, ``tie_word_embeddings``, ``initializer_range``; ``activation_function`` must be a tanh
    GELU. Llama, Qwen2, Qwen3, Mistral: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim`` (0 in lpt when it is hidden_size / num_attention_heads),
    ``intermediate_size``, ``max_position_embeddings``, ``rms_norm_eps``, ``tie_word_embeddings``, ``rope_theta`` and
    ``rope_scaling`` / ``rope_parameters`` (type default, linear or llama3); ``hidden_act`` must be silu,
    ``attention_bias`` / ``mlp_bias`` false; Qwen2 sets ``qkv_bias``, Qwen3 ``qk_norm``; Mistral's
    ``sliding_window``, and Qwen2's / Qwen3's with ``use_sliding_window`` when every layer slides, set
    ``sliding_window`` (:func:`lpt.models.hf_readers.sliding_window`). Keys a config.json leaves out take
    transformers' defaults. Anything else, or a file that is not a JSON object or holds a value of another type than
    transformers' default (a string for an integer, ...): a one-line ValueError naming the file.
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(
            f"{path} has no config.json (a Hugging Face model directory holds config.json and model.safetensors)"
        )
    hf = read_json(file)
    family = _model_family(hf, file)
    return gpt2_config(hf, file) if family == "gpt2" else llama_config(hf, file, family)


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


def hf_family(model_cfg: ModelSpec) -> str:
    """The Hugging Face family that writes ``config.model``: "gpt2"; for kind "llama" "qwen2" with ``qkv_bias``,
    "qwen3" with ``qk_norm``, else "mistral" with a ``sliding_window`` and "llama" without (a Mistral whose window
    masks nothing is written as the Llama it is). ValueError for a model no architecture holds: ``qkv_bias`` and
    ``qk_norm`` together, or a Llama whose ``d_model`` is not divisible by ``n_heads``."""
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
    if s.sliding_window:
        return "mistral"
    if s.d_model % s.n_heads:
        raise ValueError(
            f"config.model.d_model={s.d_model} is not divisible by n_heads={s.n_heads}: LlamaForCausalLM needs "
            "hidden_size divisible by num_attention_heads (whatever head_dim)"
        )
    return "llama"


def hf_config(model_cfg: ModelSpec, *, dtype: str = "float32", token_ids: dict | None = None) -> dict:
    """The ``config.json`` dict of ``config.model`` (the inverse of :func:`read_config`), for the architecture of
    :func:`hf_family`. The RoPE goes both into ``rope_theta`` / ``rope_scaling`` (transformers 4) and
    ``rope_parameters`` (transformers 5); ``sliding_window`` into Mistral's ``sliding_window`` and Qwen's
    ``use_sliding_window`` / ``sliding_window`` / ``max_window_layers`` / ``layer_types`` (every layer slides).
    ``token_ids``: the ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` to write (null for the ones it leaves
    out)."""
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
    window = s.sliding_window or None  # 0: null, no window
    if family == "llama":
        extra = {"attention_bias": False, "mlp_bias": False}
    elif family == "mistral":
        extra = {"sliding_window": window}
    else:  # Qwen2 (biases on q, k, v: always) and Qwen3 (q_norm, k_norm: always); a window slides in every layer
        bias = {"attention_bias": False} if family == "qwen3" else {}
        extra = {
            **bias,
            "use_sliding_window": window is not None,
            "sliding_window": window,
            "max_window_layers": 0 if window else s.n_layers,
            "layer_types": [f"{'sliding' if window else 'full'}_attention"] * s.n_layers,
        }
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
