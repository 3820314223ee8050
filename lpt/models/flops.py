"""Parameter counts and training FLOPs per token.

``flops_per_token = 6 N + 12 · n_layers · n_heads · head_dim · seq_len`` (PaLM appendix B convention): ``N`` counts
every weight that takes part in a matmul (attention and MLP projections and the LM head — counted even when tied,
since the head matmul is done either way), not the embedding lookups, norms or biases; the second term is the
QKᵀ and P·V matmuls (forward + backward, without discounting the causal mask), over ``min(seq_len,
sliding_window)`` keys per query with a sliding window. ``head_dim`` is the width of each head: ``d_model /
n_heads`` unless ``config.model.head_dim`` sets another.
"""

from __future__ import annotations

from lpt.models.config import ModelSpec, model_spec


def matmul_params(model_cfg: ModelSpec) -> int:
    """Weights that enter a matmul (see module docstring)."""
    s = model_spec(model_cfg)
    attn = s.d_model * s.head_width * (2 * s.n_heads + 2 * s.n_kv_heads)  # q, o + k, v
    mlp = (3 if s.kind == "llama" else 2) * s.d_model * s.d_ff
    return s.n_layers * (attn + mlp) + s.d_model * s.vocab_size


def param_count(model_cfg: ModelSpec) -> int:
    """All trainable parameters of ``build_model(model_cfg, ...)`` without PQT bitwidths."""
    s = model_spec(model_cfg)
    D = s.d_model
    n = matmul_params(model_cfg) - (D * s.vocab_size if s.tie_embeddings else 0) + s.vocab_size * D
    qkv_width = s.head_width * (s.n_heads + 2 * s.n_kv_heads)
    if s.kind == "llama":
        n += (2 * s.n_layers + 1) * D  # RMSNorm scales
        n += s.n_layers * ((qkv_width if s.qkv_bias else 0) + (2 * s.head_width if s.qk_norm else 0))  # Qwen2, Qwen3
    else:
        n += s.max_seq_len * D + (2 * s.n_layers + 1) * 2 * D  # positions, LayerNorm scale+bias
        n += s.n_layers * (qkv_width + D + s.d_ff + D)  # linear biases
    return n


def flops_per_token(model_cfg: ModelSpec, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at ``seq_len``: ``6 N + 12 L H Dh T`` (T: ``seq_len``, or the
    sliding window when it is shorter)."""
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len={seq_len!r} must be a positive int")
    s = model_spec(model_cfg)
    keys = min(seq_len, s.sliding_window) if s.sliding_window else seq_len  # keys each query attends
    return float(6 * matmul_params(model_cfg) + 12 * s.n_layers * s.n_heads * s.head_width * keys)
