"""``model.sliding_window``: the KV-cache path (lpt.models.decode) masks the keys a window leaves out exactly as the
forward does. Greedy decoding with the cache gives the tokens of recomputing the full forward for every new token,
with float32 logits within 1e-5 of it, for left-padded prompts whose sequences outgrow the window (T up to 19,
window 4); the window changes the logits, so a cache that ignored it would fail. FLOPs per token count the window's
keys; bad values fail in one line."""

import jax.numpy as jnp
import numpy as np
import pytest
from numpy_models import numpy_init
from test_decode import _cached_greedy, _full_forward_greedy

import lpt.models as M
from lpt.models import decode

PROMPTS = [[5, 9, 200, 17, 3, 8, 1, 90, 4], [42, 7, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
NEW, WINDOW = 8, 4
CFG = dict(kind="llama", vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=32)


def _model(window, kind="llama", scan=False):
    cfg = {**CFG, "kind": kind, "sliding_window": window, "scan_layers": scan}
    if kind == "gpt2":
        cfg["n_kv_heads"] = cfg["n_heads"]
    cfg["init_std"] = 0.3  # peaked attention: a masking error shows
    return numpy_init(cfg, {"compute_dtype": "float32"})


def test_cached_greedy_equals_full_forward_with_window():
    """Scanned layers: one mask for every layer (it is computed once, outside the layers)."""
    model = _model(WINDOW, scan=True)
    tokens, logits = _cached_greedy(model, PROMPTS, NEW)
    ref_tokens, ref_logits = _full_forward_greedy(model, PROMPTS, NEW)
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=0)
    _, unwindowed = _full_forward_greedy(_model(0, scan=True), PROMPTS, NEW)  # the same weights
    assert np.abs(unwindowed - ref_logits).max() > 0.1  # the window matters at these lengths


def test_cache_mask_with_window():
    """Slots start_b <= s <= index + j and s > index + j − w: the window counts slots back from the query's own."""
    cache = decode.init_cache(_model(WINDOW), 2, 12, start=[3, 0])
    cache = cache.replace(index=jnp.int32(8))
    m = np.asarray(cache.mask(2, WINDOW))
    slots = np.arange(12)
    for j, query in enumerate((8, 9)):
        want = (slots <= query) & (slots > query - WINDOW) & (slots[None] >= np.array([[3], [0]]))
        np.testing.assert_array_equal(m[:, j], want)
    assert np.asarray(cache.mask(2, 0)).sum() > m.sum()


@pytest.mark.parametrize(
    "kind, window, match",
    [
        ("llama", -1, r"^config key model\.sliding_window=-1 must be >= 0 \(0 = no window\)$"),
        ("gpt2", 4, r"^config key model\.sliding_window=4 is a llama option; gpt2 allows 0$"),
    ],
)
def test_bad_window_raises(kind, window, match):
    with pytest.raises(ValueError, match=match):
        _model(window, kind)


def test_flops_per_token_count_the_window():
    """The attention term 12·L·H·Dh·keys counts min(seq_len, window) keys per query."""
    cfg = {**CFG, "vocab_size": 256}
    attention = 12 * 2 * 4 * 8  # L, H, Dh = 32 / 4
    full = M.flops_per_token(cfg, 32)
    assert full - M.flops_per_token({**cfg, "sliding_window": 4}, 32) == attention * (32 - 4)
    assert M.flops_per_token({**cfg, "sliding_window": 64}, 32) == full
