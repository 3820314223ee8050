"""Raw small-integer keys: ``jax.random.key(s)`` has key data ``[0, s]``; hash_bits mixes the key words first, so
seeds below the array size do not all draw the same multiset of words (and the same rounding bias)."""

import jax
import jax.numpy as jnp
import numpy as np

import lpt.numerics as N


def _up_counts(seeds, n):
    """Stochastic rounding into bf16 of ``n`` copies of 1 + ulp/3, one raw key per seed: round-ups per seed."""
    x = np.full(n, np.float32(1 + 2.0**-7 / 3), np.float32)
    p = (x.view(np.uint32)[0] & 0xFFFF) / 65536.0  # exact probability of rounding up (16 dropped bits)
    f = jax.jit(lambda x, k: N.round_stochastic(x, jnp.bfloat16, k, out_dtype=jnp.float32))
    return np.array([int(np.sum(np.asarray(f(x, jax.random.key(s))) > 1)) for s in seeds]), p


def test_raw_seeds_give_independent_rounding_bias():
    n = 1 << 12
    ups, p = _up_counts(range(32), n)
    total = 32 * n
    z = (ups.sum() - total * p) / np.sqrt(total * p * (1 - p))
    print(f"round-ups per seed {ups[:6]}..., z = {z:.2f}")
    assert abs(z) < 3  # unmixed keys: every seed gives the same count (1322 of 4096), z = -8.1
    assert len(set(ups.tolist())) > 16  # the seeds draw different words
    # the per-seed counts spread like independent binomials (unmixed: zero spread)
    assert 0.5 < np.std(ups) / np.sqrt(n * p * (1 - p)) < 1.6


def test_key_mixing_is_a_bijection_of_each_word_and_hash_bits_uses_it():
    from lpt.numerics.random import hash_index, mix_key_words

    k1 = jnp.arange(1 << 16, dtype=jnp.uint32)
    m0, m1 = jax.jit(mix_key_words)(jnp.zeros_like(k1), k1)
    assert len(np.unique(np.asarray(m1))) == 1 << 16  # distinct k1 -> distinct m1
    m0b, _ = jax.jit(mix_key_words)(k1, jnp.zeros_like(k1))
    assert len(np.unique(np.asarray(m0b))) == 1 << 16  # distinct k0 (same k1) -> distinct m0
    key = jax.random.key(5)
    k0, k1 = (jnp.uint32(w) for w in np.asarray(jax.random.key_data(key), np.uint32))
    idx = jnp.arange(1000, dtype=jnp.uint32)
    np.testing.assert_array_equal(np.asarray(N.hash_bits(key, (1000,))), np.asarray(hash_index(idx, k0, k1)))
    np.testing.assert_array_equal(
        np.asarray(N.hash_bits(jnp.stack([k0, k1]), (1000,))), np.asarray(N.hash_bits(key, (1000,)))
    )
