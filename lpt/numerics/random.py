"""Cheap counter-based random bits for stochastic rounding.

``jax.random.bits`` runs threefry-2x32 (20 rounds per pair of words), which on XLA:CPU costs many times a rounding
pass (measured in docs/results.md) and would make every stochastically rounded update compute-bound. Stochastic
rounding needs uniform, independent-looking bits, not cryptographic ones, so :func:`hash_bits` hashes the element's
global index with the key: ``h((i ^ m1) + m0)`` with the ``lowbias32`` integer mixer ``h`` (Wellons' two
xor-shift-multiply finalizer, avalanche bias ~1.7e-4), where ``(m0, m1)`` are the key words ``(k0, k1)`` run through
the mixer first::

    m1 = h(k1 ^ 0x9E3779B9)
    m0 = h(k0 + m1)

(a bijection of the 64-bit key, so distinct keys keep distinct mixer offsets). The key words must be mixed because
raw keys are far from uniform: ``jax.random.key(s)`` has key data ``[0, s]``, and with ``m1 = s`` every seed
``s < 2^k`` would XOR the indices of a 2^k-element array onto the same set ``[0, 2^k)``: the same multiset of words,
and so the same rounding bias, for every such seed. Mixed, the keys of different seeds (raw, or derived by
``fold_in`` / ``split``) give mixer inputs at unrelated offsets, and for a fixed element the keys of successive steps
give independent uniform words (the mixer is a bijection). Within one array the inputs are consecutive integers,
whose 16-bit histograms are ~3 sigma from uniform over 2^22 draws (a second mixer call per element would remove that;
it does not bias a rounding). Being a function of (key, global index) only, it is identical for every sharding and
process count; its statistics are tested (bit balance, lag-1 and cross-key correlation, bias across raw seeds) in
tests/numerics.
Arrays with more than 2^32 elements would repeat their pattern every 2^32 elements.
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_RNGS = ("hash", "threefry")


def _mix(x: jax.Array) -> jax.Array:
    x = x ^ (x >> jnp.uint32(16))
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> jnp.uint32(15))
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> jnp.uint32(16))


def key_words(key) -> jax.Array:
    """The raw words of a JAX PRNG key (typed, or raw key data) as uint32[n >= 2]: what the hash mixes."""
    kd = jax.random.key_data(key) if jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key) else key
    kd = jnp.asarray(kd).astype(jnp.uint32).reshape(-1)  # key data -> u32 words
    if kd.shape[0] < 2:
        raise ValueError(f"expected a JAX PRNG key (typed, or raw uint32[2]); got key data of shape {kd.shape}")
    return kd


def _key_words(key) -> tuple[jax.Array, jax.Array]:
    kd = key_words(key)
    return kd[0], kd[1]


_KEY_XOR = 0x9E3779B9  # 2^32 / golden ratio: h(0) = 0, so the all-zero key gets a non-zero offset


def mix_key_words(k0: jax.Array, k1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(m0, m1)`` from the raw u32 key words (module docstring): scalar work, done once per call or kernel block."""
    m1 = _mix(k1 ^ jnp.uint32(_KEY_XOR))
    return _mix(k0 + m1), m1


def hash_index(idx: jax.Array, k0: jax.Array, k1: jax.Array) -> jax.Array:
    """The keyed hash behind :func:`hash_bits`: uint32 element indices and raw key words -> uniform uint32 bits.

    Mixes the key words (:func:`mix_key_words`), then hashes each index. Public so that kernels can number their
    elements themselves (e.g. a Pallas block at a global offset) and still draw exactly the bits ``hash_bits`` gives
    for the whole array."""
    m0, m1 = mix_key_words(k0, k1)
    return _mix((idx ^ m1) + m0)


def hash_bits(key, shape) -> jax.Array:
    """Uniform uint32 bits of ``shape`` from ``key`` (typed or raw uint32[2] key) and the global element index."""
    k0, k1 = _key_words(key)
    n = math.prod(shape)
    idx = lax.iota(jnp.uint32, n).reshape(shape)
    return hash_index(idx, k0, k1)


def random_bits(key, shape, rng: str = "hash") -> jax.Array:
    """uint32 bits from ``key``: ``rng="hash"`` (fast, :func:`hash_bits`) or ``"threefry"`` (``jax.random.bits``)."""
    if rng == "hash":
        return hash_bits(key, shape)
    if rng == "threefry":
        return jax.random.bits(key, shape, jnp.uint32)
    raise ValueError(f"unknown rng {rng!r}; choose one of {_RNGS}")


def path_id(path, *, bits: int = 32) -> np.uint32:
    """A stable id of a leaf or layer path: the low ``bits`` bits of the crc32 of its UTF-8 text, the same in every
    process and Python run (unlike ``hash``); what lpt folds into a PRNG key per parameter leaf or layer.

    ``path`` is a str or a sequence of str / int (joined by "/"). PQT layer keys use all 32 bits; the optimizer's
    per-leaf keys use 31 (``bits=31``). Both are fixed: every stochastic rounding and weight-noise stream depends on
    them."""
    if isinstance(path, str):
        text = path
    else:
        try:
            text = "/".join(str(p) for p in path)
        except TypeError as e:
            raise ValueError(f"path must be a str or a sequence of str/int, got {path!r}") from e
    if bits not in (31, 32):
        raise ValueError(f"bits={bits!r} is not allowed; choose 31 or 32")
    return np.uint32(zlib.crc32(text.encode("utf-8")) & ((1 << bits) - 1))
