"""Pseudo-quantization noise R from random bits (Ahn & Yoo, Section 3.4, Eq. 10) and DiffQ's uniform R.

GaussWS needs R ≈ round(N(0, 1) / 2) with values in {0, ±1, ±2}. Ahn & Yoo build it from independent random bits
with AND / OR only (P(A∧B) = P(A)·P(B), P(A∨B) = P(A) + P(B) − P(A)·P(B), Eq. 9), never Box-Muller. We use 16 bits
per sample, two samples per 32-bit word of ``jax.random.bits`` (:func:`_random_words`; bit i of a
sample's 16 bits is called u_i):

* magnitude 2:  M2 = (u_0 ∧ … ∧ u_7) ∧ (u_8 ∨ u_9)                    P(M2) = 2⁻⁸ · 3/4
* magnitude 1:  M1 = (u_10 ∨ u_11) ∧ (u_12 ∨ u_13) ∧ u_14 ∧ ¬M2        P(M1) = (3/4)² · 2⁻¹ · (1 − P(M2))
* sign:         u_15, applied only when the magnitude is non-zero      (so R never holds −0)

which gives exactly Eq. 10 (every probability is a multiple of 2⁻¹⁶):

    Pr(R = ±2) = 3/4 · 2⁻⁹                        = 96/65536   ≈ 1/682.7   (each sign)
    Pr(R = ±1) = (3/4)² · 2⁻² · (1 − Pr(|R| = 2)) = 9189/65536 ≈ 1/7.13    (each sign)
    Pr(R = 0)  = 1 − Pr(|R| = 1) − Pr(|R| = 2)    = 46966/65536 ≈ 0.7166

Reading of Eq. 10: the paper's "(1 − Pr(±2))" is the probability of *not* drawing magnitude 2 (both signs,
3/4 · 2⁻⁸); with that reading its Pr(0) ≈ 0.717 comes out, while the per-sign reading would give 0.716.
(For comparison round(N(0,1)/2) has Pr(0) = 0.683, Pr(±1) = 0.157, Pr(±2) = 0.0060.)

The sign–magnitude code is turned into bf16 directly from bits (sign << 15 | exponent/mantissa of 1.0 or 2.0), so
no float arithmetic is involved. Ahn & Yoo additionally pack 8 such 4-bit codes per uint32 between their separate
Triton kernels; under XLA the generation fuses into its consumer and the backward regenerates R from the key, so
R is never stored (``benchmarks/pqt_overhead.py`` measures the trade-off; numbers in docs/results.md).

DiffQ's baseline R ~ U(−0.5, 0.5) in bf16 is :func:`symmetric_uniform`: 8 random bits per sample (four per
32-bit word), a sign bit and a 7-bit k, R = ±(2k + 1) / 512. That is the uniform distribution on the 256
midpoints of a 1/256 grid of (−0.5, 0.5): exactly representable in bf16 (8 significant bits), symmetric,
mean exactly 0, variance 1/12 − 1/(12·256²). (``jax.random.uniform(..., dtype=bfloat16)`` would give
k/128 − 0.5, whose mean is −1/256: a biased PQN.)
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

# Exact probabilities of Eq. 10 as produced by the construction above (numerators over 2^16).
_ROUNDED_NORMAL_VALUES = (-2, -1, 0, 1, 2)
_ROUNDED_NORMAL_COUNTS_65536 = (96, 9189, 46966, 9189, 96)
ROUNDED_NORMAL_PMF = {v: c / 65536 for v, c in zip(_ROUNDED_NORMAL_VALUES, _ROUNDED_NORMAL_COUNTS_65536, strict=True)}

_BF16_ONE_BITS = 0x3F80  # bf16 bit pattern of 1.0
_BF16_TWO_BITS = 0x4000  # bf16 bit pattern of 2.0
_SIGN_BIT = 0x8000


def _check_shape(shape) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError as e:
        raise ValueError(f"shape must be a sequence of non-negative ints, got {shape!r}") from e
    if any(s < 0 for s in shape):
        raise ValueError(f"shape must be a sequence of non-negative ints, got {shape!r}")
    return shape


def rounded_normal_from_bits(u: jax.Array) -> jax.Array:
    """Map 16 random bits per element (uint16) to R ∈ {0, ±1, ±2} as bf16 (see the module docstring).

    Pure bit operations; exposed so that tests can enumerate all 2¹⁶ words and check Eq. 10 exactly.
    """
    if u.dtype != jnp.uint16:
        raise ValueError(f"rounded_normal_from_bits expects uint16 words, got dtype {u.dtype}")
    one = jnp.uint16(1)
    all_low8 = (u & jnp.uint16(0xFF)) == jnp.uint16(0xFF)  # u_0 ∧ … ∧ u_7: P = 2^-8
    m2 = all_low8 & ((u & jnp.uint16(0x0300)) != 0)  # ∧ (u_8 ∨ u_9): P = 3/4 · 2^-8
    m1 = (
        ((u & jnp.uint16(0x0C00)) != 0)  # u_10 ∨ u_11: 3/4
        & ((u & jnp.uint16(0x3000)) != 0)  # u_12 ∨ u_13: 3/4
        & (((u >> 14) & one) == one)  # u_14: 1/2
        & ~m2
    )
    magnitude = jnp.where(m2, jnp.uint16(_BF16_TWO_BITS), jnp.where(m1, jnp.uint16(_BF16_ONE_BITS), jnp.uint16(0)))
    sign = jnp.where(magnitude != 0, u & jnp.uint16(_SIGN_BIT), jnp.uint16(0))  # u_15, no −0
    return jax.lax.bitcast_convert_type(magnitude | sign, jnp.bfloat16)  # uint16 bits -> bf16 (no arithmetic)


def _random_words(key: jax.Array, shape: tuple[int, ...], bits: int) -> jax.Array:
    """Uniform random ``uint{bits}`` array of ``shape`` (bits ∈ {8, 16}), cut from 32-bit PRNG words.

    JAX's default (partitionable) threefry spends one threefry2x32 evaluation per output element whatever its
    width, so asking ``jax.random.bits`` for uint16 directly wastes half of every word (uint8: three quarters).
    We draw uint32 words and split each into 32/bits consecutive samples along the last axis (or along the
    flattened array when the last axis is not a multiple of 32/bits). Deterministic in (key, shape).
    """
    per_word = 32 // bits
    dtype = jnp.uint16 if bits == 16 else jnp.uint8
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
    if shape and shape[-1] % per_word == 0:
        words = jax.random.bits(key, shape[:-1] + (shape[-1] // per_word,), jnp.uint32)
        parts = (words[..., None] >> shifts).astype(dtype)  # uint32 -> uint{bits}: keeps the low bits
        return parts.reshape(shape)
    size = math.prod(shape)
    words = jax.random.bits(key, (-(-size // per_word),), jnp.uint32)
    parts = (words[:, None] >> shifts).astype(dtype)  # uint32 -> uint{bits}: keeps the low bits
    return parts.reshape(-1)[:size].reshape(shape)


@functools.partial(jax.jit, static_argnums=1)
def _rounded_normal(key, shape):
    return rounded_normal_from_bits(_random_words(key, shape, 16))


@functools.partial(jax.jit, static_argnums=1)
def _symmetric_uniform(key, shape):
    u = _random_words(key, shape, 8)
    k = (u & jnp.uint8(0x7F)).astype(jnp.int32)  # uint8 -> int32 (exact)
    mag_f32 = (2 * k + 1).astype(jnp.float32) * np.float32(1.0 / 512.0)  # int32 -> f32, exact: ≤ 8 significant bits
    signed_f32 = jnp.where((u & jnp.uint8(0x80)) != 0, -mag_f32, mag_f32)
    return signed_f32.astype(jnp.bfloat16)  # f32 -> bf16, exact (every value has ≤ 8 significant bits)


def rounded_normal(key: jax.Array, shape) -> jax.Array:
    """R ≈ round(N(0, 1) / 2) of Ahn & Yoo (GaussWS), Eq. 10, as bf16 with values in {0, ±1, ±2}.

    Pr(±2) = 3/4·2⁻⁹ each, Pr(±1) = (3/4)²·2⁻²·(1 − 3/4·2⁻⁸) each, Pr(0) ≈ 0.7166; built from 16 random bits
    per element with AND / OR (module docstring). Values are exact in every float dtype, so cast freely.

    Args:
      key: a JAX PRNG key (typed or raw uint32).
      shape: output shape.
    """
    return _rounded_normal(key, _check_shape(shape))


def symmetric_uniform(key: jax.Array, shape) -> jax.Array:
    """DiffQ's R ~ U(−0.5, 0.5) in bf16: ±(2k + 1)/512 with k uniform in 0..127 and a random sign.

    Exact in bf16, symmetric (mean exactly 0), variance 1/12 − 1/(12·256²). 8 random bits per element.
    """
    return _symmetric_uniform(key, _check_shape(shape))


__all__ = [
    "ROUNDED_NORMAL_PMF",
    "rounded_normal",
    "rounded_normal_from_bits",
    "symmetric_uniform",
]
