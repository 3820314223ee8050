"""Hugging Face checkpoints in and out: GPT-2 (``GPT2LMHeadModel``), Llama (``LlamaForCausalLM``), Qwen2
(``Qwen2ForCausalLM``), Qwen3 (``Qwen3ForCausalLM``) and Mistral (``MistralForCausalLM``: a Llama with a sliding
window; one whose window masks nothing is written back as ``LlamaForCausalLM``) directories.

A Hugging Face model directory holds ``config.json`` and the weights as ``model.safetensors`` (or shards listed by
``model.safetensors.index.json``). The weights never pass through PyTorch: :mod:`lpt.models.hf_files` reads and
writes the safetensors files with numpy, and :mod:`lpt.models.hf_config` maps config.json to and from
``config.model``; their functions are importable from here too. This module maps the tensors to lpt's parameters.

Tensor names, lpt parameter paths (``blocks/<i>/...``; ``scan_layers`` stacks the blocks on a leading axis):

* Llama: ``model.embed_tokens.weight`` = ``embed/embedding``; per layer ``model.layers.<i>.``
  ``input_layernorm.weight`` = ``norm1/scale``, ``self_attn.{q,k,v,o}_proj.weight`` = ``attn/{q,k,v,o}/kernel``ᵀ,
  ``post_attention_layernorm.weight`` = ``norm2/scale``, ``mlp.{gate,up,down}_proj.weight`` =
  ``mlp/{gate,up,down}/kernel``ᵀ; ``model.norm.weight`` = ``final_norm/scale``; ``lm_head.weight`` =
  ``lm_head/kernel``ᵀ (absent when tied). torch ``Linear`` stores [out, in], lpt [in, out]: hence the transposes.
  Hugging Face's Llama weights are already in the rotate-half RoPE layout that lpt uses.
* Qwen2, Qwen3 and Mistral: Llama's names, and Qwen2's ``self_attn.{q,k,v}_proj.bias`` = ``attn/{q,k,v}/bias``
  (``qkv_bias``), Qwen3's ``self_attn.{q,k}_norm.weight`` = ``attn/{q,k}_norm/scale`` (``qk_norm``).
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
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from lpt import numerics
from lpt.models.config import ModelSpec, Precision, model_spec
from lpt.models.hf_config import (
    ARCHITECTURES,
    check_token_ids,
    generation_config,
    hf_config,
    model_kind,
    read_config,
    read_token_ids,
    tokenizer_token_ids,
)
from lpt.models.hf_files import FLOAT_CODES, ST_CODES, read_json, read_safetensors, read_tensors, write_safetensors
from lpt.models.transformer import Transformer
from lpt.options import build

__all__ = [
    "ARCHITECTURES",
    "from_pretrained",
    "hf_config",
    "load_params",
    "model_from_params",
    "read_config",
    "read_safetensors",
    "read_tensors",
    "read_token_ids",
    "save_params",
    "save_pretrained",
    "write_safetensors",
]

# dtypes written as they are stored; others (float8) are widened to float32 (exactly) on save
_SAVE_DTYPES = {
    np.dtype(np.float32): "float32",
    np.dtype(ml_dtypes.bfloat16): "bfloat16",
    np.dtype(np.float16): "float16",
}

# from_pretrained's precision recipes: f32 params and compute, or bf16 params (stored in bf16) and bf16 compute;
# both with the XLA attention and Qiu & Yao's stable row-max shift
_PRECISIONS = {
    "float32": {"param_dtype": "float32", "compute_dtype": "float32"},
    "bfloat16": {"param_dtype": "bfloat16", "compute_dtype": "bfloat16", "update_rule": "nearest"},  # stored in bf16
}

# non-weight tensors some checkpoints carry: skipped on load
_SKIPPED = re.compile(
    r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$|^model\.layers\.\d+\.self_attn\.rotary_emb\."
)


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
            for j in "qkv" if spec.qkv_bias else "":
                m.append((p + f"self_attn.{j}_proj.bias", (b + f"attn/{j}/bias",), "id"))
            for j in "qk" if spec.qk_norm else "":
                m.append((p + f"self_attn.{j}_norm.weight", (b + f"attn/{j}_norm/scale",), "id"))
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
    model = nnx.eval_shape(lambda: Transformer(unrolled, Precision(), rngs=nnx.Rngs(0)))
    flat = _flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {k: tuple(v.shape) for k, v in flat.items()}


def _check_shapes(got: dict, want: dict[str, tuple[int, ...]]) -> None:
    """ValueError naming the first lpt parameter (``"a/b/c"``) that ``got`` lacks, has extra or has in another shape
    than ``want``."""
    for k in sorted(set(want) | set(got)):
        if k not in got:
            raise ValueError(f"lpt parameter {k!r} (shape {want[k]}) is missing from params")
        if k not in want:
            raise ValueError(f"unexpected lpt parameter {k!r} (shape {tuple(np.shape(got[k]))}) for config.model")
        if tuple(np.shape(got[k])) != want[k]:
            raise ValueError(f"lpt parameter {k!r} has shape {tuple(np.shape(got[k]))}; expected {want[k]}")


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
    """The nested dict of ``{"a/b/c": leaf}``; block indices become int keys (as in ``nnx.to_pure_dict``)."""
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


def load_params(path: str | Path, model_cfg: ModelSpec) -> dict:
    """The weights of a Hugging Face model directory as lpt parameters for ``model_cfg``: a nested dict of float32
    numpy arrays shaped like ``nnx.to_pure_dict`` of ``nnx.split(model, nnx.Param, ...)``'s params for that config
    (block indices as int keys; with ``scan_layers`` the blocks stacked on a leading axis). No PQT bitwidths.

    The file's dtypes (F32, F16, BF16, ...) are widened to float32 exactly. The directory's config.json must name
    the architecture of ``model_cfg.kind``. ValueError (one line, naming the tensor) on a missing tensor, an
    unexpected tensor or a shape that does not match ``model_cfg``.
    """
    spec = model_spec(model_cfg)
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"{path} has no config.json")
    kind = model_kind(read_json(file), file)
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
        if ST_CODES[tensors[name].dtype] not in FLOAT_CODES:
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


def model_from_params(model_cfg: ModelSpec, precision_cfg: Precision, params: dict) -> Transformer:
    """The lpt model of ``model_cfg`` / ``precision_cfg`` with ``params`` (a pure dict as from :func:`load_params`)
    stored in the recipe's storage dtype: float32 -> storage by round-to-nearest-even (exact when the values came
    from a file in that dtype). Nothing is drawn at random."""
    spec, prec = model_spec(model_cfg), build(Precision, precision_cfg)
    abstract = nnx.eval_shape(lambda: Transformer(spec, prec, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    want = _flatten(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
    got = _flatten(params)
    _check_shapes(got, {k: tuple(v.shape) for k, v in want.items()})

    def store(x, v):
        w_f32 = jnp.asarray(x, jnp.float32)  # given dtype -> f32 (exact widening for f32/bf16/f16/fp8)
        return w_f32 if v.dtype == jnp.float32 else numerics.round_nearest(w_f32, v.dtype)  # f32 -> storage, RNE

    values = _nest({k: store(got[k], want[k]) for k in want})
    state = jax.tree.map(lambda x: x, state)  # fresh Variables to fill
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def from_pretrained(path: str | Path, *, param_dtype: str = "float32") -> tuple[Transformer, ModelSpec]:
    """``(model, model_cfg)``: an lpt :class:`~lpt.models.Transformer` with the weights of the Hugging Face model
    directory ``path`` (GPT-2, Llama, Qwen2, Qwen3 or Mistral; see :func:`read_config`), and its ``config.model``.

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


def save_params(
    path: str | Path,
    params: dict,
    model_cfg: ModelSpec,
    *,
    tokenizer_file: str | Path | None = None,
    token_ids: dict | None = None,
) -> None:
    """Write ``params`` (an lpt pure dict for ``model_cfg``, e.g. a checkpoint's) as a Hugging Face model directory:
    ``config.json`` (:func:`hf_config`), ``model.safetensors`` and, given ``tokenizer_file`` (a tokenizer.json), a copy
    of it as ``tokenizer.json`` with a ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``.

    Special tokens: ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` go into config.json and
    ``generation_config.json``, so that ``transformers.generate`` stops at the end of a text. They come from
    ``token_ids`` (e.g. :func:`read_token_ids` of the directory the model was loaded from; eos may be a list), and
    for the keys it leaves out from ``tokenizer_file`` (all three the separator lpt trains with,
    :func:`lpt.models.hf_config.tokenizer_token_ids`). With neither, they are null and no generation_config.json is
    written.

    The tensors keep the parameters' dtype when they all share float32, bfloat16 or float16; otherwise (float8
    storage, mixed dtypes) they are widened to float32 exactly. PQT bitwidths (``.../bitwidth``) are not written;
    a tied model writes no ``lm_head.weight``. ValueError on a missing or mis-shaped parameter, naming it, on a
    token id that is not an id of the model's vocabulary and on a model no architecture holds
    (:func:`lpt.models.hf_config.hf_family`); nothing is written then.

    Args:
      path: the directory to write.
      params: an lpt pure dict of parameters for ``model_cfg``.
      model_cfg: the model's :class:`lpt.models.config.ModelSpec` (or a partial mapping of its keys).
      tokenizer_file: a tokenizer.json to copy, or None.
      token_ids: special token ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id``; eos may be a list), or None.
    """
    spec = model_spec(model_cfg)
    ids = {}
    if tokenizer_file is not None:
        tok = Path(tokenizer_file)
        if not tok.is_file() or tok.suffix != ".json":
            raise ValueError(f"tokenizer_file={str(tokenizer_file)!r} is not an existing tokenizer.json file")
        ids = tokenizer_token_ids(tok)
    ids = check_token_ids({**ids, **(token_ids or {})}, "token_ids", spec.vocab_size)  # a None in token_ids: null
    flat = {k: np.asarray(v) for k, v in _flatten(params).items() if not k.endswith("/bitwidth")}
    if spec.scan_layers:
        flat = _unstack_blocks(flat, spec.n_layers)
    _check_shapes(flat, _lpt_shapes(spec))
    dtypes = {v.dtype for v in flat.values()}
    dtype = next(iter(dtypes)) if len(dtypes) == 1 and next(iter(dtypes)) in _SAVE_DTYPES else np.dtype(np.float32)
    tensors = {}
    for name, paths, op in _mapping(spec):
        xs = [flat[p].astype(dtype) for p in paths]  # stored dtype -> dtype (the same, or exact widening to f32)
        tensors[name] = np.ascontiguousarray(xs[0].T if op == "T" else np.concatenate(xs, -1) if op == "cat" else xs[0])
    config = hf_config(model_cfg, dtype=_SAVE_DTYPES[dtype], token_ids=ids)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if ids:
        (out / "generation_config.json").write_text(json.dumps(generation_config(ids), indent=2) + "\n")
    else:
        (out / "generation_config.json").unlink(missing_ok=True)  # none from an earlier save into this directory
    write_safetensors(out / "model.safetensors", tensors)
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n")


def save_pretrained(
    model: Transformer,
    path: str | Path,
    *,
    tokenizer_file: str | Path | None = None,
    token_ids: dict | None = None,
) -> None:
    """Write ``model`` as a Hugging Face model directory that ``transformers.AutoModelForCausalLM.from_pretrained``
    loads (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` with ``qkv_bias``,
    ``Qwen3ForCausalLM`` with ``qk_norm`` or ``MistralForCausalLM`` with a ``sliding_window``;
    :func:`lpt.models.hf_config.hf_family`): see :func:`save_params`. The stored parameters are written (float32
    masters under ``f32_master``, not their ``param_dtype`` view). A model from :func:`from_pretrained` keeps its
    directory's special tokens with ``token_ids=read_token_ids(that directory)``."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params = jax.tree.map(np.asarray, params)  # device -> host, stored dtype
    save_params(path, params, _spec_cfg(model.spec), tokenizer_file=tokenizer_file, token_ids=token_ids)


def _spec_cfg(spec: ModelSpec) -> dict:
    """``config.model`` (a dict) of a :class:`ModelSpec`."""
    d = dataclasses.asdict(spec)
    rs = d.pop("rope_scaling")
    return {**d, "rope_scaling": rs}
