"""Sliding-window models from Hugging Face against transformers' PyTorch models, built offline here (window 8,
sequences of 40 tokens): a Mistral (``MistralForCausalLM``) and a Qwen2 whose every layer slides
(``use_sliding_window``) load with ``config.model.sliding_window = 8``; float32 logits agree within 1e-4 with the
XLA attention and with the Pallas kernel (interpreted); greedy decoding through lpt.generate (the KV cache) gives
transformers' tokens, alone and as a left-padded batch, over 20 new tokens; save_pretrained writes the class and the
window back, transformers' logits from the export equal the original's, and from_pretrained reads the same bits.
Without the window the same weights give logits far outside the tolerance, so each comparison needs it.

The models are random with weights of order one (so the logits are too, and a wrong mask shows)."""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (its CPU build is pinned for Python 3.11 only)")
import transformers  # noqa: E402
from flax import nnx  # noqa: E402
from hf_parity import greedy_both, lpt_logits, max_diff, padded_batch, torch_logits  # noqa: E402

import lpt.models as M  # noqa: E402
from lpt.models import hf  # noqa: E402

TOL = 1e-4
V, T, WINDOW = 160, 40, 8
BASE = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=1e6,
    bos_token_id=None,
    eos_token_id=None,  # MistralConfig's eos 2 would stop transformers' generate where lpt's goes on
)
CASES = {
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": WINDOW}),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 0},  # layers >= 0 slide
    ),
}


def _torch_model(case):
    """A transformers model with random O(1) weights: matrices N(0, 1/fan_in), embeddings N(0, 1), norm scales
    1 + N(0, 0.2²), biases N(0, 0.1²)."""
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    model = model_cls(config_cls(**BASE, **extra, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.0 if "embed_tokens" in name else p.shape[1] ** -0.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_and_export_round_trip(case, tmp_path):
    tm = _torch_model(case)
    tm.save_pretrained(tmp_path / "hf")
    model, model_cfg = M.from_pretrained(tmp_path / "hf")
    assert model_cfg.sliding_window == WINDOW and model_cfg.qkv_bias == (case == "qwen2")
    tokens, mask = padded_batch(T, V)
    ref = torch_logits(tm, tokens, mask)
    diff = max_diff(lpt_logits(model, tokens), ref, mask)
    params = hf.load_params(tmp_path / "hf", model_cfg)
    pallas = hf.model_from_params(model_cfg, {"attention": {"impl": "pallas"}}, params)  # interpreted on CPU
    diff_pallas = max_diff(lpt_logits(pallas, tokens), ref, mask)
    no_window = {**model_cfg.to_dict(), "sliding_window": 0}
    effect = max_diff(lpt_logits(hf.model_from_params(no_window, {}, params), tokens), ref, mask)
    print(
        f"\n{case}: max |lpt - transformers| = {diff:.3g} (xla), {diff_pallas:.3g} (pallas) over {int(mask.sum())} "
        f"positions, max |logit| = {np.abs(ref).max():.3g}; without the window {effect:.3g}"
    )
    assert np.abs(ref).max() > 1.0 and diff <= TOL and diff_pallas <= TOL
    assert effect > 100 * TOL
    # export: the class and the window written back; transformers reads the same function, lpt the same bits
    M.save_pretrained(model, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == [type(tm).__name__] and written["sliding_window"] == WINDOW
    back_tm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert type(back_tm).__name__ == type(tm).__name__
    assert max_diff(torch_logits(back_tm.eval(), tokens, mask), ref, mask) <= TOL
    back, back_cfg = M.from_pretrained(tmp_path / "out")
    assert back_cfg == model_cfg
    original = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, original, nnx.to_pure_dict(nnx.state(back, nnx.Param)))


def test_mistral_greedy_decoding_matches_transformers(tmp_path):
    """lpt.generate's greedy tokens (KV cache with the window mask) equal transformers' generate for prompts of 5, 2
    and 12 tokens and 20 new ones (sequences up to 32 = 4 windows), each alone and as one left-padded batch."""
    tm = _torch_model("mistral")
    tm.save_pretrained(tmp_path / "hf")
    model, _ = M.from_pretrained(tmp_path / "hf")
    prompts, n = [[5, 9, 100, 17, 3], [42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]], 20
    batched, single, ref_batched, ref_single = greedy_both(tm, model, prompts, n)
    print(f"\nmistral window {WINDOW}: greedy tokens {batched}")
    assert batched == ref_batched and single == ref_single and batched == single
    assert all(len(row) == n for row in batched) and len(set(sum(batched, []))) > 8
