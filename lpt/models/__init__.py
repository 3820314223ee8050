"""lpt.models: the NNX decoder-only transformer with a per-layer precision recipe.

Public API
----------
``build_model(model_cfg, precision_cfg, *, rngs) -> Transformer``
    ``model(tokens_BT, *, key=None) -> logits_BTV`` (float32). ``key`` is the per-step key; PQT layers fold in their
    static layer id; ``key=None`` = evaluation (no weight noise).
``model.decode(tokens_BT, cache, *, last_only=False) -> (logits_BTV, cache)``
    the forward over T new tokens per row with a KV cache (generation; no weight noise). :mod:`lpt.models.decode`:
    ``KVCache`` (``k, v[L, B, S, K, Dh]`` in the compute dtype, ``index``, per-row ``start``), ``init_cache(model,
    batch, length, *, start=None)``, ``prefill(model, prompts, length) -> (logits_BV, cache)`` (left-padded token
    lists), ``decode_step(model, tokens_B, cache) -> (logits_BV, cache)``. See docs/generation.md.
``model.aux_loss() -> f32 scalar``
    bitwidth loss of Ahn & Yoo (GaussWS, Eq. 12) ``λ Σ_layers mean_tiles |b_t − b_target|`` (0 without PQT); add it to
    the training loss.
``diagnostics(model) -> dict[str, f32 scalar]``
    Jittable (call on a merged model inside the step). With PQT: ``pqt/all/bt_mean``, ``pqt/all/frac_le{5,9,12}``,
    ``pqt/bt_min``, ``pqt/bt_max``, ``pqt/bt_mean/<kind>`` (kind in qkv/out/up/down). With fp8 ``param_dtype``:
    ``params/fp8_saturated_frac``, ``params/fp8_zero_frac``. Empty dict otherwise.
``activation_diagnostics(model, tokens_BT, *, key=None) -> dict[str, f32 scalar]``
    Jittable forward pass with the layers' probes on (:mod:`lpt.models.probes`): ``attn/repeated_max_frac``,
    ``attn/repeated_max_frac_max`` and, per layer kind, what its matmul format's probe records
    (:mod:`lpt.models.matmul_formats`; an "fp8" matmul: ``fp8/<kind>/x_underflow_frac``, ``x_subnormal_frac``,
    ``w_underflow_frac``, ``w_subnormal_frac``, ``x_scale_range_log2``, ``snr_db``). The trainer runs it every
    ``train.diagnostics_every`` steps; without it the layers add no operation.
``flops_per_token(model_cfg, seq_len) -> float``, ``param_count(model_cfg)``, ``matmul_params(model_cfg)``
``attention_impl(model_cfg, precision_cfg, mesh=None) -> str``
    the attention implementation the model runs on the mesh's devices (``"auto"`` resolved; the compile report's
    ``attention_impl``).
``partitioning``: ``param_partition_specs(state, rules)``, ``param_shardings(state, mesh, rules)``,
    ``place(model, mesh)``: the NNX side of sharding; the rules table, ``axis_rules`` and ``constrain`` are in
    :mod:`lpt.sharding`.
``matmul_formats``: the registry of matmul formats (``get``, ``register``, ``names``): each format's GEMM, shape
    check, diagnostics probe and lab view in one object.
``ModelSpec`` / ``Precision``: the typed ``model`` and ``precision`` sections (type, default, allowed values and
    doc of every key). ``Precision`` is the whole precision recipe: dtypes, each projection's matmul format,
    attention, PQT, and the optimizer's update rule, from which the parameters' storage follows (``store_dtype``);
    ``model_spec(mapping)`` and ``lpt.options.build(Precision, mapping)`` build them from a partial mapping
    (ValueError naming a bad key).
``from_pretrained(path, *, param_dtype="float32") -> (model, model_cfg)``
    a Hugging Face GPT-2 / Llama / Qwen2 / Qwen3 / Mistral directory (config.json + safetensors) as an lpt model
    (f32 params and compute, or bf16 params and compute) and its ``config.model``; lower-level pieces in
    :mod:`lpt.models.hf`.
``save_pretrained(model, path, *, tokenizer_file=None)``
    the model as a Hugging Face directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads. See
    docs/huggingface.md.

``config.model`` switches: ``remat`` (``nnx.remat`` per block) and ``scan_layers`` (parameters stacked on a leading
"layers" axis, ``nnx.scan`` over them); both default False. Llama's attention options: ``qkv_bias`` (Qwen2),
``qk_norm`` (Qwen3), ``head_dim`` (0: ``d_model / n_heads``), ``sliding_window`` (Mistral; 0: none).
See docs/models_and_data.md for the precision recipe.
"""

from lpt.models import matmul_formats, partitioning, probes
from lpt.models.attention_block import attention_impl
from lpt.models.config import ModelSpec, Precision, model_spec
from lpt.models.decode import KVCache, decode_step, init_cache, prefill
from lpt.models.diagnostics import activation_diagnostics, diagnostics
from lpt.models.flops import flops_per_token, matmul_params, param_count
from lpt.models.hf import from_pretrained, save_pretrained
from lpt.models.transformer import Transformer, build_model

__all__ = [
    "attention_impl",
    "KVCache",
    "ModelSpec",
    "Precision",
    "Transformer",
    "activation_diagnostics",
    "build_model",
    "decode_step",
    "diagnostics",
    "flops_per_token",
    "from_pretrained",
    "init_cache",
    "matmul_formats",
    "matmul_params",
    "model_spec",
    "param_count",
    "partitioning",
    "prefill",
    "probes",
    "save_pretrained",
]
