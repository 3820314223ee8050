"""``dot_product_attention(..., sliding_window=w)``: every impl (XLA twin, interpreted Pallas kernel, plain softmax)
against masked f32 softmax written out from the definition (query i sees keys i − w < j <= i), forward and
gradients, with GQA, a padded row and T not a multiple of the blocks; a window as long as the sequence changes
nothing; the repeated-maximum diagnostic counts only the logits a window shows; bad windows fail in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED

from lpt.attention import dot_product_attention, repeated_max_fraction

B, T, H, HKV, D, W = 2, 37, 4, 2, 16, 10  # T pads to 48: blocks of 16 queries, 8 keys
KV_MASK = jnp.arange(T)[None, :] >= jnp.array([[0], [3]])  # row 1: keys 0..2 are padding


def _inputs():
    """q, k, v and a cotangent for O: standard normal f32, drawn with numpy (no program to compile)."""
    rng = np.random.default_rng(3)
    return tuple(jnp.asarray(rng.standard_normal((B, T, h, D), np.float32)) for h in (H, HKV, HKV, H))


def _dense(q, k, v):
    """f32 softmax over the keys i − W < j <= i that are not padding (rows without any: 0), from the definition."""
    pos = jnp.arange(T)
    seen = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - W)  # [Tq, Tk]
    seen = seen[None, None] & KV_MASK[:, None, None, :]  # [B, 1, Tq, Tk]
    kh, vh = (jnp.repeat(x, H // HKV, axis=2) for x in (k, v))  # GQA: query head h reads kv head h // 2
    s = jnp.where(seen, jnp.einsum("bqhd,bkhd->bhqk", q, kh) / jnp.sqrt(jnp.float32(D)), -jnp.inf)
    p = jnp.where(seen, jax.nn.softmax(s, axis=-1), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vh)


def _out_and_grads(fn, q, k, v, w):
    """O and (dq, dk, dv) as one program compiled with LLVM's optimizations off: they are checked against bounds
    far above f32 round-off."""

    def both(q, k, v):
        o, vjp = jax.vjp(fn, q, k, v)
        return o, vjp(w)

    return jax.jit(both).lower(q, k, v).compile(UNOPTIMIZED)(q, k, v)


@pytest.mark.parametrize("impl", ["xla", "pallas", "softmax"])
def test_window_matches_masked_softmax(impl):
    """O within 2^-18·max|O| and dq, dk, dv within 2e-5·max of the dense truth (two f32 programs summing in
    different orders); the window moves O by O(1), so an impl that ignored it would fail."""
    q, k, v, w = _inputs()
    kw = dict(causal=True, kv_mask=KV_MASK, block_q=16, block_k=8)
    if impl == "pallas":
        kw["interpret"] = True
    f = lambda q, k, v: dot_product_attention(q, k, v, sliding_window=W, impl=impl, **kw)
    o, grads = _out_and_grads(f, q, k, v, w)
    o_t, grads_t = _out_and_grads(_dense, q, k, v, w)
    causal = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, kv_mask=KV_MASK, impl="softmax"))
    o_causal = causal.lower(q, k, v).compile(UNOPTIMIZED)(q, k, v)  # checked only to differ from O by > 0.3
    assert float(jnp.max(jnp.abs(o_causal - o_t))) > 0.3
    np.testing.assert_allclose(o, o_t, atol=2.0**-18 * float(jnp.max(jnp.abs(o_t))), rtol=0)
    for g, g_t in zip(grads, grads_t, strict=True):
        np.testing.assert_allclose(g, g_t, atol=2e-5 * float(jnp.max(jnp.abs(g_t))), rtol=0)


def test_window_of_the_whole_sequence_masks_nothing():
    """A window of T keys leaves every causal key visible: the XLA twin's output is bit for bit the causal one."""
    q, k, v, _ = _inputs()
    run = jax.jit(lambda q, k, v, w: dot_product_attention(q, k, v, sliding_window=w, block_k=8), static_argnums=3)
    np.testing.assert_array_equal(run(q, k, v, T), run(q, k, v, 0))


def test_repeated_max_fraction_sees_only_the_window():
    """Equal keys make every visible logit of a row a maximum: a row repeats its maximum iff it sees >= 2 keys. All
    rows but the first do causally; with a window of 1 key none does, with 2 all but the first again."""
    q, k, _, _ = _inputs()
    k = jnp.broadcast_to(k[:, :1], k.shape)
    frac = {w: float(repeated_max_fraction(q, k, sliding_window=w)) for w in (0, 1, 2)}
    assert frac == {0: np.float32((T - 1) / T), 1: 0.0, 2: np.float32((T - 1) / T)}  # f32 ratios


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sliding_window=-1), r"^sliding_window=-1 must be an int >= 0 \(0: no window\)$"),
        (dict(sliding_window=2.5), r"^sliding_window=2\.5 must be an int >= 0"),
        (dict(sliding_window=True), r"^sliding_window=True must be an int >= 0"),
        (dict(sliding_window=4, causal=False), r"^sliding_window=4 needs causal=True$"),
    ],
)
def test_bad_window_raises(kwargs, match):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=match):
        dot_product_attention(q, k, v, **kwargs)
