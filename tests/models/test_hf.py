"""Hugging Face weights both ways (lpt.models.hf) against transformers' PyTorch models, built offline from config
objects: float32 logits agree within 1e-4 on a right-padded batch (every non-pad position), for GPT-2, Llama with GQA
(untied, tied), Llama with linear and llama3 RoPE scaling, Qwen2 (q, k, v biases, rope_theta 1e6; untied, tied) and
Qwen3 (q / k norms, head_dim != hidden_size / heads; untied, tied); greedy decoding of Qwen2 and Qwen3 through
lpt.generate (the KV cache) gives transformers' greedy tokens, one prompt at a time and as a left-padded batch;
lpt -> save_pretrained -> transformers gives the same logits and from_pretrained gives the same bits back (also for
a sliding window, written as Mistral and as Qwen2; loading windowed models: test_hf_sliding_window.py); BF16 and
sharded files load; bad files fail naming the tensor or the key.

The models are random with weights of order one (so the logits are too, and a wrong mapping shows)."""

import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (its CPU build is pinned for Python 3.11 only)")
import transformers  # noqa: E402
from flax import nnx  # noqa: E402
from hf_parity import greedy_both, lpt_logits, max_diff, padded_batch, torch_logits  # noqa: E402

import lpt.models as M  # noqa: E402
from lpt.models import hf  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4
V, D, L = 160, 64, 2
LLAMA = dict(vocab_size=V, hidden_size=D, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4)
GPT2 = dict(vocab_size=V, n_embd=D, n_layer=L, n_head=4, n_positions=64, bos_token_id=None, eos_token_id=None)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
QWEN = {**LLAMA, "num_key_value_heads": 2, "max_position_embeddings": 64, "rope_theta": 1e6}
CASES = {
    "gpt2": ("gpt2", GPT2, 40),
    "llama_gqa": ("llama", {**LLAMA, "num_key_value_heads": 2, "max_position_embeddings": 64}, 40),
    "llama_gqa_tied": ("llama", {**LLAMA, "num_key_value_heads": 1, "tie_word_embeddings": True}, 40),
    "llama_linear": ("llama", {**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 64),
    # wavelengths above 64 (the low-frequency dims) are stretched 8x: they matter at positions of tens
    "llama3": ("llama", {**LLAMA, "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 64}}, 128),
    "qwen2": ("qwen2", QWEN, 40),
    "qwen2_tied": ("qwen2", {**QWEN, "num_key_value_heads": 1, "tie_word_embeddings": True}, 40),
    "qwen3": ("qwen3", {**QWEN, "head_dim": 32}, 40),  # heads wider than hidden_size / heads = 16
    "qwen3_tied": ("qwen3", {**QWEN, "head_dim": 8, "tie_word_embeddings": True}, 40),  # and narrower
    # Mistral without a window shorter than max_position_embeddings: a Llama (with head_dim 32)
    "mistral": ("mistral", {**QWEN, "head_dim": 32, "sliding_window": None}, 40),
    "mistral_window_64": ("mistral", {**QWEN, "sliding_window": 64}, 64),  # the window covers every sequence
}
CLASSES = {
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}


def _torch_model(kind, cfg, seed=0):
    """A transformers model (``kind``: a family of :data:`CLASSES`) with random O(1) weights: matrices
    N(0, 1/fan_in), embeddings N(0, 1), norm scales 1 + N(0, 0.2²), biases N(0, 0.1²)."""
    config_cls, model_cls = CLASSES[kind]
    config = config_cls(**cfg, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and ("wte" in name or "wpe" in name or "embed_tokens" in name):
                p.normal_(0.0, 1.0)
            elif p.ndim == 2:
                fan_in = p.shape[0] if kind == "gpt2" and "lm_head" not in name else p.shape[1]  # Conv1D is [in, out]
                p.normal_(0.0, fan_in**-0.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def _save_torch(model, path, **kw):
    model.save_pretrained(path, **kw)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return _save_torch(_torch_model("llama", {**LLAMA, "num_key_value_heads": 2}), path / "hf")


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    kind, cfg, T = CASES[case]
    tm = _torch_model(kind, cfg)
    model, model_cfg = M.from_pretrained(_save_torch(tm, tmp_path / "hf"))
    assert model_cfg.kind == ("gpt2" if kind == "gpt2" else "llama") and model_cfg.n_layers == L
    assert not model_cfg.scan_layers
    assert jax.tree.leaves(nnx.state(model, nnx.Param))[0].dtype == np.float32
    tokens, mask = padded_batch(T, V)
    ref = torch_logits(tm, tokens, mask)
    got = lpt_logits(model, tokens)
    diff = max_diff(got, ref, mask)
    print(
        f"\n{case}: max |lpt - transformers| = {diff:.3g} over {int(mask.sum())} positions, max |logit| = "
        f"{np.abs(ref).max():.3g}"
    )
    assert np.abs(ref).max() > 1.0  # logits of order one: a wrong mapping could not hide below the tolerance
    assert diff <= TOL
    if kind == "mistral":  # written back as the Llama it is
        M.save_pretrained(model, tmp_path / "out")
        llama = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
        assert type(llama).__name__ == "LlamaForCausalLM"
        assert max_diff(torch_logits(llama.eval(), tokens, mask), ref, mask) <= TOL
    if case.endswith("_tied"):
        assert model.lm_head is None and model_cfg.tie_embeddings
    if kind in ("qwen2", "qwen3", "mistral"):  # one Llama block with options: Qwen2 q, k, v biases, Qwen3 q / k norms
        assert (model_cfg.qkv_bias, model_cfg.qk_norm) == (kind == "qwen2", kind == "qwen3")
        assert model_cfg.head_dim == cfg.get("head_dim", 0) and model_cfg.rope_theta == 1e6
        assert model.blocks[0].attn.q.kernel.shape == (D, 4 * (cfg.get("head_dim") or D // 4))
        # rope_theta 1e6 changes the logits: without it lpt would fail above
        plain_cfg = {**model_cfg.to_dict(), "rope_theta": 10000.0}
        plain = hf.model_from_params(plain_cfg, {}, hf.load_params(tmp_path / "hf", plain_cfg))
        effect = max_diff(lpt_logits(plain, tokens), ref, mask)
        print(f"{case}: the same weights with rope_theta 1e4 differ by {effect:.3g}")
        assert effect > 100 * TOL
    if case in ("llama_linear", "llama3"):  # the scaling changes the logits: without it lpt would fail above
        unscaled = {**model_cfg.to_dict(), "rope_scaling": {"type": "none"}}
        plain = hf.model_from_params(unscaled, {}, hf.load_params(tmp_path / "hf", unscaled))
        effect = max_diff(lpt_logits(plain, tokens), ref, mask)
        print(f"{case}: the same weights without rope scaling differ by {effect:.3g}")
        assert effect > 100 * TOL


@pytest.mark.parametrize("case", ["qwen2", "qwen3", "mistral"])
def test_greedy_decoding_matches_transformers(case, tmp_path):
    """lpt.generate's greedy tokens (the KV-cache path that ``--hf`` runs) equal transformers' ``generate``, for each
    prompt alone and for the three as one left-padded batch (rows of different lengths). Untied models: the tied
    ones, with their N(0, 1) embeddings, greedily repeat their last token."""
    kind, cfg, _ = CASES[case]
    tm = _torch_model(kind, cfg)
    model, _ = M.from_pretrained(_save_torch(tm, tmp_path / "hf"))
    prompts, n = [[5, 9, 100, 17, 3], [42, 7], [1, 2, 3, 4, 5, 6, 7]], 12
    batched, single, ref_batched, ref_single = greedy_both(tm, model, prompts, n)
    print(f"\n{case}: greedy tokens {batched}")
    assert batched == ref_batched and single == ref_single and batched == single
    assert all(len(row) == n for row in batched) and len({tuple(r) for r in batched}) == 3
    assert len(set(sum(batched, []))) > 8  # a path through many tokens, not one repeated


def _lpt_model(cfg, seed=0):
    """An lpt model of ``cfg`` whose weights are drawn here with numpy (no init program to compile), as build_model
    draws them: matrices and embeddings N(0, init_std²), the "out" and "down" projections N(0, init_std² / (2
    n_layers)); and, unlike build_model's zeros and ones, biases N(0, 0.3²) and norm scales 1 + N(0, 0.2²): a mapping
    that drops or swaps any of them changes the logits."""
    abstract = nnx.eval_shape(lambda: M.build_model(cfg, {}, rngs=nnx.Rngs(0)))
    rng = np.random.RandomState(seed)
    std, out_std = cfg["init_std"], cfg["init_std"] / np.sqrt(2 * cfg["n_layers"])

    def draw(path, x):
        keys = [getattr(k, "key", None) for k in path]
        z = rng.standard_normal(x.shape).astype(np.float32)
        if keys[-1] == "bias":
            return 0.3 * z
        if keys[-1] == "scale":
            return 1.0 + 0.2 * z
        return (out_std if "o" in keys or "down" in keys else std) * z

    params = jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
    return hf.model_from_params(cfg, {}, params)


def _architecture(cfg):
    """The Hugging Face class save_pretrained writes for an lpt ``config.model``."""
    if cfg["kind"] == "gpt2":
        return "GPT2LMHeadModel"
    if cfg.get("qkv_bias") or cfg.get("qk_norm"):
        return "Qwen2ForCausalLM" if cfg.get("qkv_bias") else "Qwen3ForCausalLM"
    return "MistralForCausalLM" if cfg.get("sliding_window") else "LlamaForCausalLM"


LPT_LLAMA = dict(
    kind="llama",
    vocab_size=V,
    d_model=D,
    n_layers=L,
    n_heads=4,
    n_kv_heads=2,
    d_ff=96,
    max_seq_len=64,
    init_std=0.15,
    rope_theta=500.0,
)
LPT_GPT2 = dict(
    kind="gpt2", vocab_size=V, d_model=D, n_layers=L, n_heads=4, d_ff=128, max_seq_len=48, init_std=0.15, norm_eps=1e-6
)


@pytest.mark.parametrize(
    "cfg",
    [
        {**LPT_LLAMA, "scan_layers": True, "tie_embeddings": True},
        {**LPT_LLAMA, "rope_scaling": {"type": "llama3", "factor": 4.0, "original_max_len": 32}},
        LPT_GPT2,
        {**LPT_GPT2, "tie_embeddings": True, "scan_layers": True},
        {**LPT_LLAMA, "head_dim": 32},
        {**LPT_LLAMA, "qkv_bias": True, "rope_theta": 1e6},
        {**LPT_LLAMA, "qkv_bias": True, "tie_embeddings": True, "scan_layers": True},
        {**LPT_LLAMA, "qk_norm": True, "head_dim": 32},
        {**LPT_LLAMA, "qk_norm": True, "head_dim": 8, "tie_embeddings": True, "scan_layers": True},
        {**LPT_LLAMA, "sliding_window": 8, "head_dim": 32},  # sequences of 64: the window masks
        {**LPT_LLAMA, "qkv_bias": True, "sliding_window": 8, "scan_layers": True},
    ],
    ids=[
        "llama_scan_tied",
        "llama3_untied",
        "gpt2_untied",
        "gpt2_scan_tied",
        "llama_head_dim",
        "qwen2_untied",
        "qwen2_scan_tied",
        "qwen3_head_dim",
        "qwen3_scan_tied",
        "mistral_window",
        "qwen2_window_scan",
    ],
)
def test_save_pretrained_round_trip(cfg, tmp_path, request):
    model = _lpt_model(cfg)
    M.save_pretrained(model, tmp_path / "hf")
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_cfg["architectures"] == [_architecture(cfg)]
    tm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert type(tm).__name__ == _architecture(cfg)
    assert tm.config.tie_word_embeddings == cfg.get("tie_embeddings", False)
    tokens, mask = padded_batch(cfg["max_seq_len"], V, seed=1)
    got, ref = lpt_logits(model, tokens), torch_logits(tm, tokens, mask)
    diff = max_diff(got, ref, mask)
    print(
        f"\n{request.node.callspec.id}: lpt -> transformers max |diff| = {diff:.3g}, max |logit| = "
        f"{np.abs(ref).max():.3g}"
    )
    assert np.abs(ref).max() > 1.0 and diff <= TOL
    # and back: the same bits, in the unrolled layout (from_pretrained) and in the model's own (load_params)
    back, back_cfg = M.from_pretrained(tmp_path / "hf")
    assert {k: getattr(back_cfg, k) for k in cfg if k not in ("scan_layers", "rope_scaling")} == {
        k: v for k, v in cfg.items() if k not in ("scan_layers", "rope_scaling")
    }
    original = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    same_layout = hf.load_params(tmp_path / "hf", {**back_cfg.to_dict(), "scan_layers": cfg.get("scan_layers", False)})
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b, strict=True), original, same_layout)
    if not cfg.get("scan_layers"):
        jax.tree.map(np.testing.assert_array_equal, original, nnx.to_pure_dict(nnx.state(back, nnx.Param)))


def test_read_config_has_every_key_of_tiny_cpu(llama_dir):
    from lpt.train import config as config_lib

    tiny = config_lib.load_config_file(ROOT / "configs" / "tiny_cpu.py").model.to_dict()
    got = hf.read_config(llama_dir).to_dict()
    assert set(got) == set(tiny) and set(got["rope_scaling"]) == set(tiny["rope_scaling"])
    assert got["remat"] is False and got["scan_layers"] is False and got["n_kv_heads"] == 2


def test_load_params_layouts_match_nnx_split(tmp_path):
    """load_params' tree equals nnx.split(model, nnx.Param, ...)'s params for scan_layers False and True."""
    path = _save_torch(_torch_model("llama", {**LLAMA, "num_key_value_heads": 2}), tmp_path / "hf")
    cfg = hf.read_config(path).to_dict()
    for scan in (False, True):
        c = {**cfg, "scan_layers": scan}
        abstract = nnx.eval_shape(lambda c=c: M.build_model(c, {}, rngs=nnx.Rngs(0)))
        _, params, _ = nnx.split(abstract, nnx.Param, ...)
        want = jax.tree.map(lambda x: (x.shape, np.dtype(np.float32)), nnx.to_pure_dict(params))
        got = hf.load_params(path, c)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), got) == want
    stacked = hf.load_params(path, {**cfg, "scan_layers": True})
    unrolled = hf.load_params(path, cfg)
    np.testing.assert_array_equal(
        stacked["blocks"]["attn"]["k"]["kernel"][1], unrolled["blocks"][1]["attn"]["k"]["kernel"]
    )


def test_bf16_files_load_and_save_as_bf16(tmp_path):
    tm = _torch_model("llama", {**LLAMA, "num_key_value_heads": 2}).to(torch.bfloat16)
    path = _save_torch(tm, tmp_path / "bf16")
    tensors = hf.read_tensors(path)
    assert tensors["model.norm.weight"].dtype == ml_dtypes.bfloat16
    want = (
        tm.model.layers[1].self_attn.k_proj.weight.detach().float().numpy().T
    )  # bf16 -> f32 exact, [out, in] -> [in, out]
    params = hf.load_params(path, hf.read_config(path))
    np.testing.assert_array_equal(params["blocks"][1]["attn"]["k"]["kernel"], want)
    model, _ = M.from_pretrained(path, param_dtype="bfloat16")
    kernel = model.blocks[1].attn.k.kernel[...]
    assert kernel.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(kernel, np.float32), want)  # stored in bf16: no rounding
    tokens, mask = padded_batch(32, V)
    got, ref = lpt_logits(model, tokens), torch_logits(tm.float(), tokens, mask)
    print(
        f"\nbf16 params and compute vs transformers f32 on the same bf16 weights: max |diff| = "
        f"{max_diff(got, ref, mask):.3g}"
    )
    assert np.isfinite(got).all() and max_diff(got, ref, mask) < 0.1 * np.abs(ref).max()
    M.save_pretrained(model, tmp_path / "out")
    from safetensors import safe_open

    with safe_open(tmp_path / "out" / "model.safetensors", "np") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    back = hf.read_tensors(tmp_path / "out")
    np.testing.assert_array_equal(back["model.layers.1.self_attn.k_proj.weight"].astype(np.float32), want.T)


def test_sharded_checkpoint_loads(tmp_path):
    tm = _torch_model("gpt2", GPT2)
    single = _save_torch(tm, tmp_path / "single")
    sharded = _save_torch(tm, tmp_path / "sharded", max_shard_size="100KB")
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, b = hf.load_params(single, hf.read_config(single)), hf.load_params(sharded, hf.read_config(sharded))
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y, strict=True), a, b)


def test_buffers_and_unprefixed_gpt2_names_load(tmp_path):
    """The original gpt2 upload: names without "transformer.", causal-mask buffers h.<i>.attn.bias beside the
    weights; Llama files with rotary_emb.inv_freq. Both load the same weights."""
    src = _save_torch(_torch_model("gpt2", GPT2), tmp_path / "gpt2")
    tensors = {k.removeprefix("transformer."): np.array(v) for k, v in hf.read_tensors(src).items()}
    tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
    old = _copy(src, tmp_path / "old", replace=tensors, drop=list(hf.read_tensors(src)))
    assert "transformer.wte.weight" not in hf.read_tensors(old)
    jax.tree.map(
        np.testing.assert_array_equal,
        hf.load_params(old, hf.read_config(old)),
        hf.load_params(src, hf.read_config(src)),
    )
    llama = _save_torch(_torch_model("llama", LLAMA), tmp_path / "llama")
    inv_freq = {"model.layers.1.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}
    with_buffer = _copy(llama, tmp_path / "llama_buf", replace=inv_freq)
    jax.tree.map(
        np.testing.assert_array_equal,
        hf.load_params(with_buffer, hf.read_config(llama)),
        hf.load_params(llama, hf.read_config(llama)),
    )


def test_our_safetensors_agree_with_the_library(tmp_path):
    """read_safetensors / write_safetensors against the safetensors package (torch side) for f32, bf16, f16."""
    import safetensors.torch

    src = {"a": torch.randn(3, 5), "b": torch.randn(7).bfloat16(), "c": torch.randn(2, 2, 2).half()}
    safetensors.torch.save_file(src, tmp_path / "t.safetensors")
    got = hf.read_safetensors(tmp_path / "t.safetensors")
    for k, v in src.items():
        np.testing.assert_array_equal(got[k].astype(np.float32), v.float().numpy())
    assert got["b"].dtype == ml_dtypes.bfloat16 and got["c"].dtype == np.float16
    hf.write_safetensors(tmp_path / "u.safetensors", got)
    back = safetensors.torch.load_file(tmp_path / "u.safetensors")
    for k, v in src.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)


def _copy(src, dst, *, drop=(), replace=None, config=None):
    """A copy of the HF directory ``src`` with tensors dropped / replaced and config.json keys changed."""
    shutil.copytree(src, dst)
    tensors = {k: np.array(v) for k, v in hf.read_tensors(src).items() if k not in drop}
    tensors.update(replace or {})
    hf.write_safetensors(dst / "model.safetensors", tensors)
    if config:
        c = json.loads((dst / "config.json").read_text())
        c.update(config)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            dict(drop=["model.layers.1.mlp.up_proj.weight"]),
            r"tensor 'model.layers.1.mlp.up_proj.weight' \(shape \(96, 64\)\) is missing",
        ),
        (
            dict(replace={"model.layers.0.self_attn.k_proj.weight": np.zeros((64, 64), np.float32)}),
            r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(64, 64\); expected \(32, 64\)",
        ),
        (
            dict(replace={"model.layers.2.mlp.up_proj.weight": np.zeros((96, 64), np.float32)}),
            r"unexpected tensor 'model.layers.2.mlp.up_proj.weight'",
        ),
        (
            dict(config={"architectures": ["BertForMaskedLM"]}),
            r"architectures=\['BertForMaskedLM'\] is not supported; allowed: \['GPT2LMHeadModel', 'LlamaForCausalLM', "
            r"'Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'MistralForCausalLM'\]",
        ),
        (
            dict(config={"architectures": None, "model_type": "gemma"}),
            r"model_type='gemma'.*allowed: \['gpt2', 'llama', 'qwen2', 'qwen3', 'mistral'\]",
        ),
        (
            dict(config={"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}),
            r"rope type 'yarn' is not supported; allowed: \['default', 'linear', 'llama3'\]",
        ),
        (dict(config={"hidden_act": "gelu"}), r"hidden_act='gelu' is not supported; allowed: \['silu'\]"),
        (dict(config={"attention_bias": True}), r"attention_bias=True is not supported"),
        (dict(config={"mlp_bias": True}), r"mlp_bias=True is not supported"),
        (  # head_dim is read: the file's q_proj, made for heads of 16, does not fit heads of 32
            dict(config={"head_dim": 32}),
            r"tensor 'model.layers.0.self_attn.q_proj.weight' has shape \(64, 64\); expected \(128, 64\)",
        ),
        (dict(config={"head_dim": 0}), r"head_dim=0 must be a positive integer"),
    ],
    ids=[
        "missing",
        "shape",
        "unexpected",
        "architecture",
        "model_type",
        "rope_type",
        "hidden_act",
        "attention_bias",
        "mlp_bias",
        "head_dim",
        "head_dim_0",
    ],
)
def test_bad_checkpoints_raise_one_line_errors(llama_dir, tmp_path, change, message):
    bad = _copy(llama_dir, tmp_path / "bad", **change)
    with pytest.raises(ValueError, match=message) as e:
        M.from_pretrained(bad)
    assert "\n" not in str(e.value)


def test_qwen_and_mistral_configs_load_or_raise_one_line_errors(tmp_path):
    """Qwen2 / Qwen3 / Mistral config.json keys: a sliding window shorter than max_position_embeddings that only
    some layers use is refused (lpt's layers share one attention); one that every layer uses is config.model's
    sliding_window (Mistral's own, its default 4096 of 131072 too, and Qwen's with every layer sliding); one that no
    layer uses or that never masks loads as no window; Qwen3's attention_bias (a bias on o_proj too) is refused;
    without architectures, model_type names the family; a Qwen2 directory read as a bias-free Llama names the bias
    it did not expect."""
    qwen2 = _save_torch(_torch_model("qwen2", QWEN), tmp_path / "qwen2")
    qwen3 = _save_torch(_torch_model("qwen3", {**QWEN, "head_dim": 32}), tmp_path / "qwen3")
    mistral = _save_torch(_torch_model("mistral", {**QWEN, "sliding_window": None}), tmp_path / "mistral")
    window = {"use_sliding_window": True, "sliding_window": 16}
    mistral_defaults = json.loads((mistral / "config.json").read_text())
    del mistral_defaults["sliding_window"], mistral_defaults["max_position_embeddings"]
    (tmp_path / "mistral_defaults").mkdir()
    shutil.copy(mistral / "model.safetensors", tmp_path / "mistral_defaults")
    (tmp_path / "mistral_defaults" / "config.json").write_text(json.dumps(mistral_defaults))
    refused = [
        (mistral, {"sliding_window": 0}, r"sliding_window=0 must be a positive integer or null$"),
        (
            qwen2,
            {**window, "layer_types": ["full_attention", "sliding_attention"]},
            r"use_sliding_window=true with sliding_window=16 on layers \[1\] only \(layer_types / max_window_layers\) "
            r"is not supported: lpt's layers share one attention; allowed: every layer or none$",
        ),
        (qwen3, {**window, "layer_types": None, "max_window_layers": 1}, r"on layers \[1\] only"),  # layers >= 1
        (qwen2, {**window, "layer_types": ["full_attention", "local"]}, r"layer_types=\['full_attention', 'local'\]"),
        (qwen3, {"attention_bias": True}, r"attention_bias=True is not supported \(lpt has no bias on o_proj\)"),
        (qwen2, {"num_key_value_heads": "2"}, r"num_key_value_heads='2' is not an integer or null"),
    ]
    for i, (src, config, message) in enumerate(refused):
        bad = _copy(src, tmp_path / f"bad{i}", config=config) if config else src
        with pytest.raises(ValueError, match=message) as e:
            M.from_pretrained(bad)
        assert "\n" not in str(e.value) and str(bad / "config.json") in str(e.value)
    want = hf.load_params(qwen2, hf.read_config(qwen2))
    for i, config in enumerate(
        [
            {**window, "layer_types": ["full_attention"] * L},  # no layer slides
            {**window, "layer_types": None, "max_window_layers": L},
            {**window, "sliding_window": 64},  # the window covers max_position_embeddings = 64
            {"architectures": None},  # model_type qwen2
        ]
    ):
        ok = _copy(qwen2, tmp_path / f"ok{i}", config=config)
        assert hf.read_config(ok) == hf.read_config(qwen2)
        jax.tree.map(np.testing.assert_array_equal, hf.load_params(ok, hf.read_config(ok)), want)
    windowed = [  # (directory, the one it copies, config.model keys other than sliding_window=16 that change)
        (_copy(qwen2, tmp_path / "w0", config={**window, "layer_types": ["sliding_attention"] * L}), qwen2, {}),
        (_copy(qwen3, tmp_path / "w1", config={**window, "layer_types": None, "max_window_layers": 0}), qwen3, {}),
        (_copy(mistral, tmp_path / "w2", config={"sliding_window": 16}), mistral, {}),
        (tmp_path / "mistral_defaults", mistral, {"sliding_window": 4096, "max_seq_len": 131072}),
    ]
    for path, src, changes in windowed:
        assert hf.read_config(path).to_dict() == {**hf.read_config(src).to_dict(), "sliding_window": 16, **changes}
    with pytest.raises(ValueError, match=r"unexpected tensor 'model.layers.0.self_attn.k_proj.bias' \(shape \(32,\)\)"):
        hf.load_params(qwen2, {**hf.read_config(qwen2).to_dict(), "qkv_bias": False})
    with pytest.raises(
        ValueError, match=r"tensor 'model.layers.0.self_attn.k_norm.weight' \(shape \(32,\)\) is missing"
    ):
        hf.load_params(
            _copy(qwen3, tmp_path / "no_norm", drop=["model.layers.0.self_attn.k_norm.weight"]), hf.read_config(qwen3)
        )


def test_models_without_an_architecture_are_not_saved(tmp_path):
    """save_pretrained refuses, before writing anything, a model no Hugging Face class holds: q, k, v biases with
    q / k norms, and a Llama whose d_model is not divisible by n_heads (transformers' LlamaConfig refuses it)."""
    for cfg, message in (
        ({**LPT_LLAMA, "qkv_bias": True, "qk_norm": True}, r"qkv_bias=True and qk_norm=True have no Hugging Face"),
        (
            {**LPT_LLAMA, "n_heads": 3, "n_kv_heads": 1, "head_dim": 16},
            r"d_model=64 is not divisible by n_heads=3: LlamaForCausalLM needs hidden_size divisible",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            M.save_pretrained(_lpt_model(cfg), tmp_path / "x")
        assert not (tmp_path / "x").exists()
    # the same heads with q / k norms are a Qwen3, which has no such rule
    M.save_pretrained(
        _lpt_model({**LPT_LLAMA, "n_heads": 3, "n_kv_heads": 1, "head_dim": 16, "qk_norm": True}), tmp_path / "q3"
    )
    tm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q3")
    assert type(tm).__name__ == "Qwen3ForCausalLM" and tm.config.head_dim == 16


def test_bad_arguments_raise(llama_dir, tmp_path):
    with pytest.raises(ValueError, match=r"param_dtype='float16' is not supported; allowed: \['float32', 'bfloat16'\]"):
        M.from_pretrained(llama_dir, param_dtype="float16")
    with pytest.raises(ValueError, match="has no config.json"):
        M.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="describes a llama model but config.model.kind='gpt2'"):
        hf.load_params(llama_dir, {**LPT_GPT2})
    with pytest.raises(ValueError, match="is not an existing tokenizer.json"):
        M.save_pretrained(_lpt_model(LPT_GPT2), tmp_path / "x", tokenizer_file=tmp_path / "nope.json")


def _word_tokenizer(path, n, end_id):
    """A tokenizer.json of ``n`` whole-word ids ``t<i>`` whose id ``end_id`` is ``<|endoftext|>`` (a special token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {("<|endoftext|>" if i == end_id else f"t{i}"): i for i in range(n)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0" if end_id else "t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path


def test_export_with_a_tokenizer_stops_transformers_generate_at_its_end_of_text(tmp_path):
    """save_pretrained with a tokenizer.json writes its end-of-text id as bos/eos/pad into config.json and
    generation_config.json, and transformers' greedy generate stops there. The end-of-text id is one that the
    random model's greedy path reaches at its 5th new token or later (found with an export without a tokenizer,
    whose generate runs the whole max_new_tokens)."""
    model, prompt, n = _lpt_model(LPT_LLAMA, seed=3), torch.tensor([[5, 17, 42]]), 16
    M.save_pretrained(model, tmp_path / "plain")
    assert not (tmp_path / "plain" / "generation_config.json").exists()
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()
    assert plain.generation_config.eos_token_id is None
    path = plain.generate(prompt, max_new_tokens=n, do_sample=False)[0, 3:].tolist()
    assert len(path) == n  # no end of text: the whole budget
    j = next(j for j in range(4, n - 1) if path[j] not in path[:j])  # a token the path reaches first at step j
    end = path[j]
    tok = _word_tokenizer(tmp_path / "tokenizer.json", V, end)
    M.save_pretrained(model, tmp_path / "hf", tokenizer_file=tok)
    ids = {"bos_token_id": end, "eos_token_id": end, "pad_token_id": end}
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == ids
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: config[k] for k in ids} == ids
    tm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert tm.generation_config.eos_token_id == end
    out = tm.generate(prompt, max_new_tokens=n, do_sample=False)[0, 3:].tolist()
    assert out == path[: j + 1] and out[-1] == end and len(out) < n  # stopped at the end of text
    # the tokenizer's own end of text, as transformers' tokenizer reads the copied file
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").convert_tokens_to_ids("<|endoftext|>") == end


def test_token_ids_come_from_the_source_directory_or_the_tokenizer(tmp_path):
    """read_token_ids: generation_config.json over config.json (eos as a list kept); save_pretrained carries them
    and fills the keys they leave out from the tokenizer; tokenizer_token_ids picks lpt's separator."""
    from lpt.data import load_tokenizer
    from lpt.data import tokenizer as tokenizer_lib
    from lpt.models import hf_config

    assert hf_config.END_TOKENS == tokenizer_lib._END_TOKENS  # one rule for lpt's separator and the exported eos
    src = _save_torch(
        _torch_model("gpt2", {**GPT2, "bos_token_id": 3, "eos_token_id": 4, "pad_token_id": 9}), tmp_path / "src"
    )
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 7], "pad_token_id": None}))
    carried = hf.read_token_ids(src)
    assert carried == {"bos_token_id": 3, "eos_token_id": [4, 7], "pad_token_id": 9}
    model, _ = M.from_pretrained(src)
    M.save_pretrained(model, tmp_path / "out", token_ids=carried)
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == carried
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == [4, 7]
    # a tokenizer.json whose </s> is id 11 (no <|endoftext|>): the keys token_ids leaves out take it
    tok = _word_tokenizer(tmp_path / "t.json", V, 11)
    tok.write_text(tok.read_text().replace("<|endoftext|>", "</s>"))
    assert hf_config.tokenizer_token_ids(tok) == dict.fromkeys(hf_config.TOKEN_KEYS, 11)
    assert load_tokenizer(tok).separator == 11
    M.save_pretrained(model, tmp_path / "both", tokenizer_file=tok, token_ids={"eos_token_id": [4, 7]})
    both = json.loads((tmp_path / "both" / "config.json").read_text())
    assert (both["bos_token_id"], both["eos_token_id"], both["pad_token_id"]) == (11, [4, 7], 11)
    # no tokenizer, no ids: null, and no generation_config.json (one from an earlier save into the directory goes)
    M.save_pretrained(model, tmp_path / "both")
    assert json.loads((tmp_path / "both" / "config.json").read_text())["eos_token_id"] is None
    assert not (tmp_path / "both" / "generation_config.json").exists()


@pytest.mark.parametrize(
    ("token_ids", "message"),
    [
        ({"eos_token_id": V}, rf"token_ids: eos_token_id={V} is outside the model's vocabulary \[0, {V}\)"),
        ({"eos_token_id": [1, -1]}, r"eos_token_id=\[1, -1\] is not a token id \(an integer >= 0\) or a non-empty"),
        ({"bos_token_id": True}, r"bos_token_id=True is not a token id \(an integer >= 0\)$"),
        (
            {"sep_token_id": 1},
            r"unknown key 'sep_token_id'; allowed: \['bos_token_id', 'eos_token_id', 'pad_token_id'\]",
        ),
    ],
)
def test_bad_token_ids_raise_before_anything_is_written(token_ids, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        M.save_pretrained(_lpt_model(LPT_GPT2), tmp_path / "x", token_ids=token_ids)
    assert not (tmp_path / "x").exists()
