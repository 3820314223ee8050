"""Hugging Face checkpoints in and out: GPT-2 (``GPT2LMHeadModel``) and Llama (``LlamaForCausalLM``) directories.

A Hugging Face model directory holds ``config.json`` and the weights as ``model.safetensors`` (or shards listed by
``model.safetensors.index.json``). The weights never pass through PyTorch: this module reads and writes the
safetensors format itself with numpy (an 8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}``, then the raw little-endian bytes), because not every ``safetensors``
release that lpt allows reads BF16 into numpy; BF16 and FP8 arrays are ``ml_dtypes`` arrays.

Tensor names, lpt parameter paths (``blocks/<i>/...``; ``scan_layers`` stacks the blocks on a leading axis):

* Llama: ``model.embed_tokens.weight`` = ``embed/embedding``; per layer ``model.layers.<i>.``
  ``input_layernorm.weight`` = ``norm1/scale``, ``self_attn.{q,k,v,o}_proj.weight`` = ``attn/{q,k,v,o}/kernel``ᵀ,
  ``post_attention_layernorm.weight`` = ``norm2/scale``, ``mlp.{gate,up,down}_proj.weight`` =
  ``mlp/{gate,up,down}/kernel``ᵀ; ``model.norm.weight`` = ``final_norm/scale``; ``lm_head.weight`` =
  ``lm_head/kernel``ᵀ (absent when tied). torch ``Linear`` stores [out, in], lpt [in, out]: hence the transposes.
  Hugging Face's Llama weights are already in the rotate-half RoPE layout that lpt uses.
* GPT-2: ``transformer.wte.weight`` = ``embed/embedding``, ``transformer.wpe.weight`` = ``pos_embed/embedding``; per
  layer ``transformer.h.<i>.`` ``ln_1`` = ``norm1``, ``attn.c_attn`` = ``attn/{q,k,v}`` concatenated on the output
  axis, ``attn.c_proj`` = ``attn/o``, ``ln_2`` = ``norm2``, ``mlp.c_fc`` = ``mlp/up``, ``mlp.c_proj`` = ``mlp/down``
  (``.weight`` = ``kernel``, or ``scale`` for the norms; ``.bias`` = ``bias``); ``transformer.ln_f`` =
  ``final_norm``; ``lm_head.weight`` = ``lm_head/kernel``ᵀ when untied. GPT-2's ``Conv1D`` already stores [in, out].
  Files without the ``transformer.`` prefix (the original ``gpt2`` upload) load too.

Tensors that are not weights are skipped on load: GPT-2's causal-mask buffers ``h.<i>.attn.bias`` /
``attn.masked_bias`` and Llama's ``rotary_emb.inv_freq``; ``lm_head.weight`` of a tied model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import ml_dtypes
import numpy as np
from flax import nnx

from lpt import numerics
from lpt.models.config import ModelSpec, model_spec, precision_spec
from lpt.models.transformer import Transformer

ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama"}
_MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama"}

# safetensors dtype codes <-> numpy dtypes (bfloat16 and float8 from ml_dtypes)
_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_CODES = {v: k for k, v in _ST_DTYPES.items()}
_FLOAT_CODES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
# dtypes written as they are stored; others (float8) are widened to float32 (exactly) on save
_SAVE_DTYPES = {
    np.dtype(np.float32): "float32",
    np.dtype(ml_dtypes.bfloat16): "bfloat16",
    np.dtype(np.float16): "float16",
}

# from_pretrained's precision recipes: f32 params and compute, or bf16 params (stored in bf16) and bf16 compute;
# both with the XLA attention and Qiu & Yao's stable row-max shift
_PRECISIONS = {
    "float32": {"param_dtype": "float32", "compute_dtype": "float32", "update_rule": "f32_master"},
    "bfloat16": {"param_dtype": "bfloat16", "compute_dtype": "bfloat16", "update_rule": "nearest"},
}

# defaults of transformers' GPT2Config / LlamaConfig, for keys a config.json leaves out
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
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # GELU with the tanh approximation (lpt's GPT-2 MLP)
_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}  # Hugging Face rope_type -> lpt's

# non-weight tensors some checkpoints carry: skipped on load
_SKIPPED = re.compile(
    r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$|^model\.layers\.\d+\.self_attn\.rotary_emb\."
)


# --------------------------------------------------------------------------------------------------------------------
# safetensors with numpy


def read_safetensors(file: str | Path) -> dict[str, np.ndarray]:
    """``{name: array}`` of one ``.safetensors`` file, memory-mapped (read-only), in the file's dtypes (BF16 and FP8
    as ``ml_dtypes`` arrays). ValueError on a malformed header or a dtype outside F64/F32/F16/BF16/F8/I*/U8/BOOL."""
    file = Path(file)
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{file} is not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} is not a safetensors file (its header is not JSON: {e})") from None
    header.pop("__metadata__", None)
    size = file.stat().st_size - 8 - n
    if size < 0:
        raise ValueError(f"{file} is truncated: its header says {n} bytes, the file holds {size + n}")
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + n, shape=(size,)) if size else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        code, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        if code not in _ST_DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has dtype {code}; supported: {sorted(_ST_DTYPES)}")
        dtype = _ST_DTYPES[code]
        if end - start != math.prod(shape) * dtype.itemsize or end > size:
            raise ValueError(
                f"{file}: tensor {name!r} ({code}, shape {shape}) has a byte range {start}..{end} "
                f"that does not fit its shape or the file's {size} data bytes"
            )
        out[name] = data[start:end].view(dtype).reshape(shape)  # little-endian bytes; lpt runs on little-endian hosts
    return out


def write_safetensors(file: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    """Write ``{name: array}`` as one ``.safetensors`` file (little-endian, tensors in name order, the header padded
    with spaces to a multiple of 8 bytes). ``metadata`` defaults to ``{"format": "pt"}``, which transformers asks
    for. The file is written under a temporary name and renamed into place, so a reader never sees half a file and
    arrays memory-mapped from the file it replaces (:func:`read_safetensors`) stay valid."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        if a.dtype not in _ST_CODES:
            raise ValueError(f"tensor {name!r} has dtype {a.dtype}; supported: {sorted(map(str, _ST_CODES))}")
        a = np.ascontiguousarray(a)
        header[name] = {
            "dtype": _ST_CODES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        arrays.append(a)
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = Path(f"{file}.tmp-{os.getpid()}")  # renamed into place: readers of the old file (memory maps) keep it
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, file)


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face model directory: ``model.safetensors``, or the shards named by
    ``model.safetensors.index.json`` (each tensor must be in the shard the index names). File dtypes, memory-mapped."""
    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return read_safetensors(single)
    if not index.is_file():
        found = sorted(p.name for p in path.iterdir()) if path.is_dir() else "not a directory"
        raise ValueError(f"{path} holds neither model.safetensors nor model.safetensors.index.json (found: {found})")
    weight_map = json.loads(index.read_text())["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        tensors = read_safetensors(path / shard)
        for name in tensors:
            if weight_map.get(name) != shard:
                raise ValueError(f"{path / shard}: tensor {name!r} is not listed for this shard in {index.name}")
        out.update(tensors)
    missing = sorted(set(weight_map) - set(out))
    if missing:
        raise ValueError(f"{index}: tensor {missing[0]!r} is listed but absent from {weight_map[missing[0]]}")
    return out


# --------------------------------------------------------------------------------------------------------------------
# config.json <-> config.model


def _kind(hf: dict, where) -> str:
    archs = hf.get("architectures") or []
    if archs:
        known = [a for a in archs if a in ARCHITECTURES]
        if not known:
            raise ValueError(f"{where}: architectures={archs} is not supported; allowed: {list(ARCHITECTURES)}")
        return ARCHITECTURES[known[0]]
    model_type = hf.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ValueError(
            f"{where}: model_type={model_type!r} (no architectures) is not supported; allowed: {list(_MODEL_TYPES)}"
        )
    return _MODEL_TYPES[model_type]


def _model_cfg(**kw) -> ml_collections.ConfigDict:
    """``config.model`` with every key of configs/tiny_cpu.py (remat and scan_layers False)."""
    rs = {"type": "none", "factor": 1.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_len": 8192}
    rs.update(kw.pop("rope_scaling", {}))
    d = {"rope_theta": 10000.0, **kw, "rope_scaling": rs, "remat": False, "scan_layers": False}
    cfg = ml_collections.ConfigDict(d)
    model_spec(cfg)  # lpt's own checks (divisibility, even head_dim, ...)
    return cfg


def _gpt2_config(hf: dict, where) -> ml_collections.ConfigDict:
    c = {**_GPT2_DEFAULTS, **hf}
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
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{where}: per-layer-type rope parameters {sorted(rope)} are not supported")
    theta = float(rope.get("rope_theta", c["rope_theta"]))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ValueError(f"{where}: rope type {kind!r} is not supported; allowed: {list(_ROPE_TYPES)}")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(
            f"{where}: partial_rotary_factor={rope['partial_rotary_factor']!r} is not supported; allowed: 1.0"
        )
    out = {"type": _ROPE_TYPES[kind]}
    if kind in ("linear", "llama3"):
        out["factor"] = float(rope["factor"])
    if kind == "llama3":
        out["low_freq_factor"] = float(rope["low_freq_factor"])
        out["high_freq_factor"] = float(rope["high_freq_factor"])
        out["original_max_len"] = int(rope.get("original_max_position_embeddings") or c["max_position_embeddings"])
    return theta, out


def _llama_config(hf: dict, where) -> ml_collections.ConfigDict:
    c = {**_LLAMA_DEFAULTS, **hf}
    if c["hidden_act"] != "silu":
        raise ValueError(f"{where}: hidden_act={c['hidden_act']!r} is not supported; allowed: ['silu']")
    for key in ("attention_bias", "mlp_bias"):
        if c[key]:
            raise ValueError(f"{where}: {key}={c[key]!r} is not supported (lpt's Llama has no biases); allowed: false")
    d, h = int(c["hidden_size"]), int(c["num_attention_heads"])
    if c["head_dim"] is not None and int(c["head_dim"]) != d // h:
        raise ValueError(
            f"{where}: head_dim={c['head_dim']} is not supported; lpt needs head_dim = hidden_size / "
            f"num_attention_heads = {d // h}"
        )
    theta, scaling = _rope(c, where)
    return _model_cfg(
        kind="llama",
        vocab_size=int(c["vocab_size"]),
        d_model=d,
        n_layers=int(c["num_hidden_layers"]),
        n_heads=h,
        n_kv_heads=int(c["num_key_value_heads"] or h),
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
    GELU. Llama: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
    ``intermediate_size``, ``max_position_embeddings``, ``rms_norm_eps``, ``tie_word_embeddings``, ``rope_theta`` and
    ``rope_scaling`` / ``rope_parameters`` (type default, linear or llama3); ``hidden_act`` must be silu,
    ``attention_bias`` / ``mlp_bias`` false, ``head_dim`` (if given) hidden_size / num_attention_heads. Keys a
    config.json leaves out take transformers' defaults. Anything else: a one-line ValueError.
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(
            f"{path} has no config.json (a Hugging Face model directory holds config.json and model.safetensors)"
        )
    hf = json.loads(file.read_text())
    return _gpt2_config(hf, file) if _kind(hf, file) == "gpt2" else _llama_config(hf, file)


def hf_config(model_cfg, *, dtype: str = "float32") -> dict:
    """The ``config.json`` dict of ``config.model`` (the inverse of :func:`read_config`). Llama's RoPE goes both into
    ``rope_theta`` / ``rope_scaling`` (transformers 4) and ``rope_parameters`` (transformers 5)."""
    s = model_spec(model_cfg)
    common = {
        "vocab_size": s.vocab_size,
        "initializer_range": s.init_std,
        "tie_word_embeddings": s.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
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
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s.d_model,
        "num_hidden_layers": s.n_layers,
        "num_attention_heads": s.n_heads,
        "num_key_value_heads": s.n_kv_heads,
        "head_dim": s.head_dim,
        "intermediate_size": s.d_ff,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_seq_len,
        "rms_norm_eps": s.norm_eps,
        "rope_theta": s.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        **common,
    }


# --------------------------------------------------------------------------------------------------------------------
# tensor names <-> lpt parameter paths


def _mapping(spec: ModelSpec) -> list[tuple[str, tuple[str, ...], str]]:
    """``(hf name, lpt leaf paths "a/b/c", op)`` per Hugging Face tensor, lpt's unrolled layout. op "id": equal;
    "T": hf = lpt transposed; "cat": hf = the lpt leaves concatenated on their last axis."""
    m = []
    if spec.kind == "llama":
        m.append(("model.embed_tokens.weight", ("embed/embedding",), "id"))
        for i in range(spec.n_layers):
            p, b = f"model.layers.{i}.", f"blocks/{i}/"
            m.append((p + "input_layernorm.weight", (b + "norm1/scale",), "id"))
            for j in "qkvo":
                m.append((p + f"self_attn.{j}_proj.weight", (b + f"attn/{j}/kernel",), "T"))
            m.append((p + "post_attention_layernorm.weight", (b + "norm2/scale",), "id"))
            for j in ("gate", "up", "down"):
                m.append((p + f"mlp.{j}_proj.weight", (b + f"mlp/{j}/kernel",), "T"))
        m.append(("model.norm.weight", ("final_norm/scale",), "id"))
    else:
        m.append(("transformer.wte.weight", ("embed/embedding",), "id"))
        m.append(("transformer.wpe.weight", ("pos_embed/embedding",), "id"))
        for i in range(spec.n_layers):
            p, b = f"transformer.h.{i}.", f"blocks/{i}/"
            for hf_leaf, lpt_leaf in (("weight", "kernel"), ("bias", "bias")):
                m.append((p + f"attn.c_attn.{hf_leaf}", tuple(b + f"attn/{j}/{lpt_leaf}" for j in "qkv"), "cat"))
                m.append((p + f"attn.c_proj.{hf_leaf}", (b + f"attn/o/{lpt_leaf}",), "id"))
                m.append((p + f"mlp.c_fc.{hf_leaf}", (b + f"mlp/up/{lpt_leaf}",), "id"))
                m.append((p + f"mlp.c_proj.{hf_leaf}", (b + f"mlp/down/{lpt_leaf}",), "id"))
            for hf_ln, lpt_ln in (("ln_1", "norm1"), ("ln_2", "norm2")):
                m.append((p + f"{hf_ln}.weight", (b + f"{lpt_ln}/scale",), "id"))
                m.append((p + f"{hf_ln}.bias", (b + f"{lpt_ln}/bias",), "id"))
        m.append(("transformer.ln_f.weight", ("final_norm/scale",), "id"))
        m.append(("transformer.ln_f.bias", ("final_norm/bias",), "id"))
    if not spec.tie_embeddings:
        m.append(("lm_head.weight", ("lm_head/kernel",), "T"))
    return m


def _lpt_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """``{"a/b/c": shape}`` of the model's parameters in the unrolled layout (abstract: nothing is computed)."""
    unrolled = dataclasses.replace(spec, scan_layers=False, remat=False)
    model = nnx.eval_shape(lambda: Transformer(unrolled, precision_spec({}), rngs=nnx.Rngs(0)))
    flat = _flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {k: tuple(v.shape) for k, v in flat.items()}


def _hf_shape(shapes: list[tuple[int, ...]], op: str) -> tuple[int, ...]:
    if op == "T":
        return shapes[0][::-1]
    if op == "cat":
        return (*shapes[0][:-1], sum(s[-1] for s in shapes))
    return shapes[0]


def _flatten(tree, prefix: str = "") -> dict:
    """``{"a/b/c": leaf}`` of a nested dict (or list; orbax restores some dicts as lists); keys as strings."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list | tuple) else None
    if items is None:
        return {prefix: tree}
    out = {}
    for k, v in items:
        out.update(_flatten(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def _nest(flat: dict) -> dict:
    """The nested dict of ``{"a/b/c": leaf}``; block indices become int keys (as in ``State.to_pure_dict()``)."""
    out: dict = {}
    for path, leaf in flat.items():
        node = out
        *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return out


def _stack_blocks(flat: dict, n_layers: int) -> dict:
    """Unrolled ``blocks/<i>/x`` leaves -> scan layout ``blocks/x`` stacked on a leading axis."""
    out = {k: v for k, v in flat.items() if not k.startswith("blocks/")}
    names = sorted({k.split("/", 2)[2] for k in flat if k.startswith("blocks/")})
    for name in names:
        out[f"blocks/{name}"] = np.stack([flat[f"blocks/{i}/{name}"] for i in range(n_layers)])
    return out


def _unstack_blocks(flat: dict, n_layers: int) -> dict:
    """Scan layout ``blocks/x`` [n_layers, ...] -> ``blocks/<i>/x``."""
    out = {k: v for k, v in flat.items() if not k.startswith("blocks/")}
    for k, v in flat.items():
        if k.startswith("blocks/"):
            if v.shape[:1] != (n_layers,):
                raise ValueError(
                    f"lpt parameter {k!r} has shape {v.shape}; expected a leading layer axis of "
                    f"{n_layers} (config.model.scan_layers=True)"
                )
            for i in range(n_layers):
                out[f"blocks/{i}/{k[len('blocks/') :]}"] = v[i]
    return out


def _gpt2_name(name: str) -> str:
    """GPT-2 tensor names with the ``transformer.`` prefix (the original gpt2 upload has none)."""
    return name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"


# --------------------------------------------------------------------------------------------------------------------
# loading


def load_params(path: str | Path, model_cfg) -> dict:
    """The weights of a Hugging Face model directory as lpt parameters for ``model_cfg``: a nested dict of float32
    numpy arrays shaped like ``nnx.split(model, nnx.Param, ...)``'s params ``.to_pure_dict()`` for that config
    (block indices as int keys; with ``scan_layers`` the blocks stacked on a leading axis). No PQT bitwidths.

    The file's dtypes (F32, F16, BF16, ...) are widened to float32 exactly. The directory's config.json must name
    the architecture of ``model_cfg.kind``. ValueError (one line, naming the tensor) on a missing tensor, an
    unexpected tensor or a shape that does not match ``model_cfg``.
    """
    spec = model_spec(model_cfg)
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"{path} has no config.json")
    kind = _kind(json.loads(file.read_text()), file)
    if kind != spec.kind:
        raise ValueError(f"{file} describes a {kind} model but config.model.kind={spec.kind!r}")
    tensors = read_tensors(path)
    if kind == "gpt2":
        tensors = {_gpt2_name(k): v for k, v in tensors.items()}
    mapping, lpt_shapes = _mapping(spec), _lpt_shapes(spec)
    expected = {name: _hf_shape([lpt_shapes[p] for p in paths], op) for name, paths, op in mapping}
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"{path}: tensor {name!r} (shape {shape}) is missing")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}; expected {shape} for config.model"
            )
        if _ST_CODES[tensors[name].dtype] not in _FLOAT_CODES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {tensors[name].dtype}; expected a float")
    for name in sorted(tensors):
        tied_head = name == "lm_head.weight" and spec.tie_embeddings
        if name not in expected and not tied_head and not _SKIPPED.match(name):
            raise ValueError(
                f"{path}: unexpected tensor {name!r} (shape {tuple(tensors[name].shape)}) for a "
                f"{spec.kind} model with {spec.n_layers} layers, tie_embeddings={spec.tie_embeddings}"
            )
    flat = {}
    for name, paths, op in mapping:
        w_f32 = np.asarray(tensors[name], dtype=np.float32)  # file dtype -> f32 (exact widening)
        if op == "T":
            flat[paths[0]] = np.ascontiguousarray(w_f32.T)
        elif op == "cat":
            cuts = np.cumsum([lpt_shapes[p][-1] for p in paths])[:-1]
            flat.update(zip(paths, (np.ascontiguousarray(x) for x in np.split(w_f32, cuts, axis=-1)), strict=True))
        else:
            flat[paths[0]] = np.array(w_f32)  # a copy: never a view of the memory-mapped file
    if spec.scan_layers:
        flat = _stack_blocks(flat, spec.n_layers)
    return _nest(flat)


def model_from_params(model_cfg, precision_cfg, params: dict) -> Transformer:
    """The lpt model of ``model_cfg`` / ``precision_cfg`` with ``params`` (a pure dict as from :func:`load_params`)
    stored in the recipe's storage dtype: float32 -> storage by round-to-nearest-even (exact when the values came
    from a file in that dtype). Nothing is drawn at random."""
    spec, prec = model_spec(model_cfg), precision_spec(precision_cfg)
    abstract = nnx.eval_shape(lambda: Transformer(spec, prec, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    want = _flatten(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
    got = _flatten(params)
    for k in sorted(set(want) | set(got)):
        if k not in got:
            raise ValueError(f"lpt parameter {k!r} (shape {tuple(want[k].shape)}) is missing from params")
        if k not in want:
            raise ValueError(f"unexpected lpt parameter {k!r} for config.model")
        if tuple(np.shape(got[k])) != tuple(want[k].shape):
            raise ValueError(
                f"lpt parameter {k!r} has shape {tuple(np.shape(got[k]))}; expected {tuple(want[k].shape)}"
            )

    def store(x, v):
        w_f32 = jnp.asarray(x, jnp.float32)  # given dtype -> f32 (exact widening for f32/bf16/f16/fp8)
        return w_f32 if v.dtype == jnp.float32 else numerics.round_nearest(w_f32, v.dtype)  # f32 -> storage, RNE

    values = _nest({k: store(got[k], want[k]) for k in want})
    state = jax.tree.map(lambda x: x, state)  # fresh Variables to fill
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def from_pretrained(path: str | Path, *, param_dtype: str = "float32") -> tuple[Transformer, ml_collections.ConfigDict]:
    """``(model, model_cfg)``: an lpt :class:`~lpt.models.Transformer` with the weights of the Hugging Face model
    directory ``path`` (GPT-2 or Llama; see :func:`read_config`), and its ``config.model``.

    Precision of the returned model: ``param_dtype="float32"``: float32 parameters and float32 compute (the weights
    widened exactly from the file's dtype); ``"bfloat16"``: parameters stored in bfloat16 (rounded to nearest even
    from the file's dtype; exact for a BF16 file) and bfloat16 compute. Both use the XLA attention with Qiu & Yao's
    stable row-max shift; logits are float32 either way. ``model(tokens_BT) -> logits_BTV``.
    """
    if param_dtype not in _PRECISIONS:
        raise ValueError(f"param_dtype={param_dtype!r} is not supported; allowed: {list(_PRECISIONS)}")
    model_cfg = read_config(path)
    params = load_params(path, model_cfg)
    precision = {**_PRECISIONS[param_dtype], "attention": {"impl": "xla", "stable": True}}
    return model_from_params(model_cfg, precision, params), model_cfg


# --------------------------------------------------------------------------------------------------------------------
# saving


def save_params(path: str | Path, params: dict, model_cfg, *, tokenizer_file: str | Path | None = None) -> None:
    """Write ``params`` (an lpt pure dict for ``model_cfg``, e.g. a checkpoint's) as a Hugging Face model directory:
    ``config.json`` (:func:`hf_config`), ``model.safetensors`` and, given ``tokenizer_file`` (a tokenizer.json), a copy
    of it as ``tokenizer.json`` with a ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``.

    The tensors keep the parameters' dtype when they all share float32, bfloat16 or float16; otherwise (float8
    storage, mixed dtypes) they are widened to float32 exactly. PQT bitwidths (``.../bitwidth``) are not written;
    a tied model writes no ``lm_head.weight``. ValueError on a missing or mis-shaped parameter, naming it.
    """
    spec = model_spec(model_cfg)
    flat = {k: np.asarray(v) for k, v in _flatten(params).items() if not k.endswith("/bitwidth")}
    if spec.scan_layers:
        flat = _unstack_blocks(flat, spec.n_layers)
    lpt_shapes = _lpt_shapes(spec)
    for k in sorted(set(lpt_shapes) | set(flat)):
        if k not in flat:
            raise ValueError(f"lpt parameter {k!r} (shape {lpt_shapes[k]}) is missing from params")
        if k not in lpt_shapes:
            raise ValueError(f"unexpected lpt parameter {k!r} (shape {flat[k].shape}) for config.model")
        if tuple(flat[k].shape) != lpt_shapes[k]:
            raise ValueError(f"lpt parameter {k!r} has shape {tuple(flat[k].shape)}; expected {lpt_shapes[k]}")
    dtypes = {v.dtype for v in flat.values()}
    dtype = next(iter(dtypes)) if len(dtypes) == 1 and next(iter(dtypes)) in _SAVE_DTYPES else np.dtype(np.float32)
    tensors = {}
    for name, paths, op in _mapping(spec):
        xs = [flat[p].astype(dtype) for p in paths]  # stored dtype -> dtype (the same, or exact widening to f32)
        tensors[name] = np.ascontiguousarray(xs[0].T if op == "T" else np.concatenate(xs, -1) if op == "cat" else xs[0])
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(model_cfg, dtype=_SAVE_DTYPES[dtype]), indent=2) + "\n")
    write_safetensors(out / "model.safetensors", tensors)
    if tokenizer_file is not None:
        tok = Path(tokenizer_file)
        if not tok.is_file() or tok.suffix != ".json":
            raise ValueError(f"tokenizer_file={str(tokenizer_file)!r} is not an existing tokenizer.json file")
        shutil.copyfile(tok, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n")


def save_pretrained(model: Transformer, path: str | Path, *, tokenizer_file: str | Path | None = None) -> None:
    """Write ``model`` as a Hugging Face model directory that ``transformers.AutoModelForCausalLM.from_pretrained``
    loads (``GPT2LMHeadModel`` or ``LlamaForCausalLM``): see :func:`save_params`. The stored parameters are written
    (float32 masters under ``f32_master``, not their ``param_dtype`` view)."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params = jax.tree.map(np.asarray, params)  # device -> host, stored dtype
    save_params(path, params, _spec_cfg(model.spec), tokenizer_file=tokenizer_file)


def _spec_cfg(spec: ModelSpec) -> dict:
    """``config.model`` (a dict) of a :class:`ModelSpec`."""
    d = dataclasses.asdict(spec)
    rs = d.pop("rope_scaling")
    return {**d, "rope_scaling": rs}
