"""The KV cache (lpt.models.decode): greedy decoding with the cache gives the tokens of recomputing the full forward
for every new token, with float32 logits equal up to rounding (two f32 programs of the same equations: within 12σ of
tests/float_bounds.py's rounding error model), for a batch of prompts of different lengths (left-padded),
Llama (GQA, RoPE at per-row positions) and GPT-2 (learned positions), scanned and unrolled layers; bf16 caches.

RoPE attention depends on position differences only, so for Llama the per-row position offset is seen in the last
bits only; GPT-2's learned positions make the tests fail if a row's positions do not start at its first real token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from float_bounds import assert_within, transformer_logits_sigma
from numpy_models import numpy_init

from lpt.models import decode

PROMPTS = [[5, 9, 200, 17, 3], [42, 7], [1, 2, 3, 4, 5, 6, 7]]  # lengths 5, 2, 7: rows 0 and 1 are left-padded
NEW = 6
CFGS = {
    "llama": dict(
        kind="llama", vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=16
    ),
    "gpt2": dict(kind="gpt2", vocab_size=256, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=16),
}


def _cfg(kind, scan):
    # init_std 0.3: peaked attention and well separated logits (a masking or position error shows up)
    return {**CFGS[kind], "scan_layers": scan, "init_std": 0.3}


def _model(kind, scan, compute="float32"):
    return numpy_init(_cfg(kind, scan), {"compute_dtype": compute})


def _sigma(model, seq):
    """(exact logits, σ) [len(seq), V] of one row: tests/float_bounds.py's rounding error model of an f32 forward.
    The cache's path and the full forward are two f32 programs of the same equations: each within 6σ of the exact
    logits (except with probability 2e-9 per logit), so the two within 12σ."""
    logits, sigma = transformer_logits_sigma(model, np.asarray([seq]))
    return logits[0], sigma[0]


def _cached_greedy(model, prompts, new):
    """(tokens [B, new], logits [new, B, V]) of greedy decoding with the cache (jitted prefill and step)."""
    graphdef, state = nnx.split(model)
    length = max(map(len, prompts)) + new - 1
    prefill = jax.jit(lambda st: decode.prefill(nnx.merge(graphdef, st), prompts, length))
    step = jax.jit(lambda st, t, c: decode.decode_step(nnx.merge(graphdef, st), t, c), donate_argnums=2)
    logits, cache = prefill(state)
    out_tokens, out_logits = [], []
    for i in range(new):
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # int -> int32
        out_tokens.append(np.asarray(tok))
        out_logits.append(np.asarray(logits))
        if i < new - 1:
            logits, cache = step(state, tok, cache)
    assert int(cache.index) == length
    return np.stack(out_tokens, 1), np.stack(out_logits)


def _full_forward_greedy(model, prompts, new):
    """The same without a cache: every step runs the ordinary forward over each row's whole (right-padded) sequence
    and reads the logits at its last real token (causal: the padding after it changes nothing)."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))
    lengths = [len(p) for p in prompts]
    buf = np.zeros((len(prompts), max(lengths) + new - 1), np.int32)
    for b, p in enumerate(prompts):
        buf[b, : len(p)] = p
    out_tokens, out_logits = [], []
    for i in range(new):
        logits_BTV = np.asarray(forward(state, jnp.asarray(buf)))
        logits = logits_BTV[np.arange(len(prompts)), np.array(lengths) + i - 1]
        tok = logits.argmax(-1)
        out_tokens.append(tok)
        out_logits.append(logits)
        if i < new - 1:
            buf[np.arange(len(prompts)), np.array(lengths) + i] = tok
    return np.stack(out_tokens, 1), np.stack(out_logits)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_cached_greedy_equals_full_forward(kind, scan):
    model = _model(kind, scan)
    tokens, logits = _cached_greedy(model, PROMPTS, NEW)
    ref_tokens, ref_logits = _full_forward_greedy(model, PROMPTS, NEW)
    exact, sigma = np.zeros_like(ref_logits, np.float64), np.zeros_like(ref_logits, np.float64)
    for b, p in enumerate(PROMPTS):
        e, s = _sigma(model, [*p, *ref_tokens[b, :-1]])
        exact[:, b], sigma[:, b] = e[len(p) - 1 :], s[len(p) - 1 :]
    # every step's exact top logit leads the runner-up by more than both programs' 6σ: each picks the exact argmax
    top2 = np.argsort(exact, -1)[..., -2:]
    gap = np.diff(np.take_along_axis(exact, top2, -1), axis=-1)[..., 0]
    assert np.all(gap > 6 * np.take_along_axis(sigma, top2, -1).sum(-1)), gap
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert_within(logits, ref_logits, 12 * sigma, "logits")
    assert len({tuple(t) for t in tokens}) == len(PROMPTS)  # the rows decode different things


def test_prefill_logits_equal_each_unpadded_prompt():
    """Every real slot of the left-padded prefill gives the logits of the row's own unpadded forward (positions from
    0 at the first real token; padding keys masked)."""
    model = _model("llama", False)
    tokens_BP, start_B = decode.left_pad(PROMPTS)
    cache = decode.init_cache(model, len(PROMPTS), tokens_BP.shape[1], start=start_B)
    graphdef, state = nnx.split(model)
    logits_BPV, cache = jax.jit(lambda st, t, c: nnx.merge(graphdef, st).decode(t, c))(state, tokens_BP, cache)
    forward = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))
    for b, p in enumerate(PROMPTS):
        want = np.asarray(forward(state, jnp.asarray([p], jnp.int32)))[0]
        assert_within(np.asarray(logits_BPV)[b, start_B[b] :], want, 12 * _sigma(model, p)[1])
    # the ordinary forward over the padded row (padding attended) gives other logits: the mask matters
    unmasked = np.asarray(forward(state, jnp.asarray(tokens_BP)))[1, -1]
    assert np.abs(unmasked - np.asarray(logits_BPV)[1, -1]).max() > 1e-2


def test_cache_layout_and_positions():
    model = _model("llama", True, "bfloat16")
    cache = decode.init_cache(model, 3, 10, start=[2, 0, 5])
    assert cache.k.shape == (2, 3, 10, 2, 8) and cache.k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(cache.positions(3), [[0, 0, 0], [0, 1, 2], [0, 0, 0]])
    cache = cache.replace(index=jnp.int32(6))
    np.testing.assert_array_equal(cache.positions(2), [[4, 5], [6, 7], [1, 2]])
    m = np.asarray(cache.mask(1))[:, 0]
    slots = np.arange(10)[None]
    np.testing.assert_array_equal(m, (slots <= 6) & (slots >= np.array([[2], [0], [5]])))


def test_bf16_decode_tracks_the_bf16_forward():
    """bf16 compute: the cache holds bf16 keys and values, and the cached logits stay close to the bf16 forward
    (not bit-equal: the forward's flash attention rounds its probabilities to bf16, the cache's softmax is f32)."""
    model = _model("gpt2", True, "bfloat16")
    _, logits = _cached_greedy(model, PROMPTS, 3)
    _, ref_logits = _full_forward_greedy(model, PROMPTS, 3)
    err = np.abs(logits - ref_logits).max()
    assert err < 0.1 * np.abs(ref_logits).max(), err


def test_errors():
    model = _model("llama", False)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        decode.init_cache(model, 1, 17)
    with pytest.raises(ValueError, match="non-empty"):
        decode.left_pad([[1, 2], []])
    with pytest.raises(ValueError, match="do not fit"):
        model.decode(jnp.zeros((2, 1), jnp.int32), decode.init_cache(model, 3, 4))
