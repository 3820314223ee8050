"""Sliding-window attention in the flash kernels (query i sees keys i − w < j <= i): both structures ("grid":
Mosaic, "loop": Triton) interpreted against the XLA twin, forward and backward, at T = 64 > w with windows that are
not multiples of the blocks; the block ranges of lpt.kernels.flash_attention.tiles against brute force; and the
kernels visit exactly the blocks that meet the window (counted in the kernel, not read off the range function)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED
from test_flash_attention_kernel import BK, BQ, D, T, _assert_f32_order_close

from lpt.kernels.flash_attention import kernel as fk
from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention import reference as fr
from lpt.kernels.flash_attention import tiles
from lpt.kernels.flash_attention import tpu as tpu
from lpt.kernels.flash_attention.options import FlashOptions


def _visible_blocks(t: int, bq: int, bk: int, window: int) -> set[tuple[int, int]]:
    """(query block, key block) pairs holding at least one (query, key) pair the window shows: brute force."""
    pos = np.arange(t)
    seen = np.asarray(fm.position_mask(pos[:, None], pos[None, :], True, window))
    return {
        (i, j)
        for i in range(t // bq)
        for j in range(t // bk)
        if seen[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any()
    }


@pytest.mark.parametrize("bq, bk", [(8, 4), (4, 8), (8, 8)])
@pytest.mark.parametrize("window", [0, 1, 3, 11, 40])
def test_block_ranges_are_the_blocks_that_meet_the_window(bq, bk, window):
    """key_blocks(i) is exactly the run of key blocks with a visible pair for query block i, query_blocks(j) the run
    of query blocks for key block j, for Python ints and traced int32 alike; widest is the longest run."""
    t = 64
    nq, nk = t // bq, t // bk
    visible = _visible_blocks(t, bq, bk, window)
    kw = dict(bq=bq, bk=bk, causal=True, window=window)
    keys = [sorted(j for a, j in visible if a == i) for i in range(nq)]
    want = [(run[0], run[-1] + 1) for run in keys]
    assert all(len(run) == end - first for run, (first, end) in zip(keys, want, strict=True))  # contiguous
    assert [tiles.key_blocks(i, nk=nk, **kw) for i in range(nq)] == want
    traced = jax.jit(jax.vmap(lambda i: tiles.key_blocks(i, nk=nk, **kw)))(jnp.arange(nq, dtype=jnp.int32))
    assert list(zip(*map(np.asarray, traced), strict=True)) == want
    queries = [sorted(i for i, b in visible if b == j) for j in range(nk)]
    want = [(run[0], run[-1] + 1) for run in queries]
    assert [tiles.query_blocks(j, nq=nq, **kw) for j in range(nk)] == want
    traced = jax.jit(jax.vmap(lambda j: tiles.query_blocks(j, nq=nq, **kw)))(jnp.arange(nk, dtype=jnp.int32))
    assert list(zip(*map(np.asarray, traced), strict=True)) == want
    assert tiles.widest(lambda i: tiles.key_blocks(i, nk=nk, **kw), nq) == max(map(len, keys))


def _inputs():
    """bf16 q, k, v, dO of one row (H = 2, Hkv = 1: GQA) and its segments: two packed sequences (queries and keys
    40 on are the second), key 5 padding."""
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (
        jax.random.normal(r, (1, h, T, D)).astype(jnp.bfloat16)  # f32 -> bf16
        for r, h in zip(ks, (2, 1, 1, 2), strict=True)
    )
    q_seg = jnp.zeros((1, T), jnp.int32).at[0, 40:].set(1)
    return q, k, v, do, q_seg, q_seg.at[0, 5].set(-1)


@pytest.mark.parametrize("window", [5, 20])
def test_both_structures_match_reference_with_window(window):
    """Interpreted "grid" and "loop" kernels vs the XLA twin (default policy) with a sliding window (5: within two
    key blocks of 8; 20: spans query blocks of 16 and key blocks of 8, a multiple of neither), with packed and padded
    segments. The kernels skip the blocks the twin masks; a fully masked block leaves the twin's running state
    unchanged, so both sum the same terms in the same block order: O, lse, dq, dk, dv within 16 f32 ulps of their
    largest magnitude (XLA:CPU's per-program FMA and dot choices; see test_flash_attention_kernel). The window
    changes O by O(1), so a kernel that ignored it would fail."""
    policy = fm.default_policy()
    q, k, v, do, q_seg, kv_seg = _inputs()
    twin = FlashOptions(causal=True, scale=0.25, policy=policy, window=window, block_q=BQ, block_k=BK)
    o_r, lse_r = jax.jit(
        lambda: fr.reference_forward(q, k, v, q_seg, kv_seg, options=twin), compiler_options=UNOPTIMIZED
    )()
    full = dataclasses.replace(twin, window=0)
    o_full, _ = jax.jit(
        lambda: fr.reference_forward(q, k, v, q_seg, kv_seg, options=full), compiler_options=UNOPTIMIZED
    )()
    assert float(jnp.max(jnp.abs(o_full - o_r))) > 0.3
    delta = jnp.sum(do.astype(jnp.float32) * o_r, axis=-1)  # bf16 -> f32 (exact products)
    backward = lambda: fr.reference_backward(q, k, v, q_seg, kv_seg, lse_r, do, delta, options=twin)
    g_r = jax.jit(backward, compiler_options=UNOPTIMIZED)()
    for structure in ("grid", "loop"):
        run = dataclasses.replace(twin, interpret=True, structure=structure)
        o, lse = jax.jit(lambda s=run: fk.forward(q, k, v, q_seg, kv_seg, options=s), compiler_options=UNOPTIMIZED)()
        backward = lambda s=run: fk.backward(q, k, v, q_seg, kv_seg, lse_r, do, delta, options=s)
        dq, dk, dv = jax.jit(backward, compiler_options=UNOPTIMIZED)()
        for x, ref in zip((o, lse, dq, dk, dv), (o_r, lse_r, *g_r), strict=True):
            _assert_f32_order_close(x, ref)


@pytest.mark.parametrize("structure, bq, bk, window", [("grid", 8, 4, 11), ("loop", 4, 8, 6), ("grid", 4, 8, 6)])
def test_kernels_visit_only_the_blocks_in_the_window(structure, bq, bk, window, monkeypatch):
    """Each kernel's block step builds its mask with valid_mask; a wrapper records (query block, key block) from
    inside the interpreted kernel. Forward, dQ and dK/dV each visit exactly the blocks with a visible pair, once:
    O(T·w) blocks (a kernel that walked every key block, or every causal one, and masked would record more)."""
    visits = []
    real = tiles.valid_mask

    def counting(q_seg, kv_seg, q_start, k_start, shape, causal, window=0):
        jax.debug.callback(lambda i, j: visits.append((int(i), int(j))), q_start // shape[0], k_start // shape[1])
        return real(q_seg, kv_seg, q_start, k_start, shape, causal, window)

    # the Triton kernels call tiles.valid_mask, the TPU kernels their own import of it
    monkeypatch.setattr(tiles if structure == "loop" else tpu, "valid_mask", counting)
    t = 64
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 1, t, 8))
    seg = jnp.zeros((1, t), jnp.int32)
    kw = dict(causal=True, scale=1.0, block_q=bq, block_k=bk, window=window, interpret=True, structure=structure)
    options = FlashOptions(policy=fm.default_policy(), **kw)
    expected = sorted(_visible_blocks(t, bq, bk, window))
    o, lse = jax.jit(lambda: fk.forward(x, x, x, seg, seg, options=options), compiler_options=UNOPTIMIZED)()
    jax.effects_barrier()
    assert sorted(visits) == expected
    causal_blocks = _visible_blocks(t, bq, bk, t)  # a window of T keys masks nothing beyond causal
    assert len(expected) < 0.6 * len(causal_blocks)  # the window leaves out blocks a causal kernel visits
    visits.clear()
    jax.jit(lambda: fk.backward(x, x, x, seg, seg, lse, x, lse, options=options), compiler_options=UNOPTIMIZED)()
    jax.effects_barrier()
    assert sorted(visits) == sorted(expected * 2)  # dQ and dK/dV


def test_window_needs_causal_and_a_count():
    kw = dict(policy=fm.default_policy(), scale=1.0, block_q=BQ, block_k=BK, interpret=True)
    with pytest.raises(ValueError, match=r"^sliding window=4 needs causal attention"):
        FlashOptions(causal=False, window=4, **kw)
    with pytest.raises(ValueError, match=r"^sliding window=-1 must be an int >= 0 \(0: no window\)$"):
        FlashOptions(causal=True, window=-1, **kw)
