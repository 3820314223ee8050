"""Random Hadamard transforms on blocks of an axis (NVFP4's transform of the weight-gradient GEMM's inputs).

For a block length ``n`` (a power of two; 16 in NVIDIA's NVFP4 recipe) the transform is ``R = H · diag(s)``, with
``H`` the normalized Sylvester-Hadamard matrix (entries ``±1/sqrt(n)``, ``H Hᵀ = I``) and ``s`` a vector of random
signs drawn from a key, so ``R`` is orthogonal. :func:`block_hadamard` replaces each block ``a_b`` of ``n``
consecutive entries along an axis by ``R a_b``. Applied with the same ``R`` to both operands of a product along the
contracted axis it cancels: ``(R a)ᵀ (R b) = aᵀ Rᵀ R b = aᵀ b``; in between, each transformed block mixes its ``n``
entries, which spreads a block's outliers over it before a block-scaled quantization.

The signs come from :func:`lpt.numerics.hash_bits` (bit 31 of the keyed hash of the index 0 … n-1), so they are a
function of the key alone, the same on every platform and for every sharding. The products run in f32 with
``Precision.HIGHEST`` (no TF32 or bf16 passes on GPU or TPU); for ``n = 16`` the entries ``±1/4`` are exact.
:func:`random_hadamard` and :func:`block_hadamard` check their arguments in Python, then run as one jitted program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lpt.numerics import hash_bits

__all__ = ["HADAMARD_BLOCK", "block_hadamard", "hadamard_matrix", "random_hadamard"]

HADAMARD_BLOCK = 16


def _check_block(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1 or n & (n - 1):
        raise ValueError(f"the Hadamard block length must be a power of two, got {n!r}")
    return int(n)


def hadamard_matrix(n: int = HADAMARD_BLOCK) -> np.ndarray:
    """The normalized Sylvester-Hadamard matrix of order ``n`` (a power of two) as f32: ``H Hᵀ = I``, symmetric."""
    n = _check_block(n)
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)  # f64 -> f32 (exact for n a power of 4)


def random_hadamard(key, n: int = HADAMARD_BLOCK) -> jax.Array:
    """``R = H · diag(s)`` (f32 ``[n, n]``, orthogonal) with the random signs ``s`` drawn from ``key`` (a JAX PRNG
    key, typed or raw uint32)."""
    return _random_hadamard(key, _check_block(n))


@functools.partial(jax.jit, static_argnames="n")
def _random_hadamard(key, n: int) -> jax.Array:
    top = hash_bits(key, (n,)) >> jnp.uint32(31)  # u32: the top bit of each index's hash
    s = jnp.float32(1.0) - jnp.float32(2.0) * top.astype(jnp.float32)  # u32 {0, 1} -> f32 {+1, -1}
    return jnp.asarray(hadamard_matrix(n)) * s[None, :]  # f32: scales column j by s_j (exact)


def block_hadamard(a, r, axis: int = 0) -> jax.Array:
    """``a`` (computed in f32) with every block of ``len(r)`` consecutive entries along ``axis`` replaced by
    ``r @ block``; f32 out. ``a.shape[axis]`` must be a multiple of the block length."""
    a = jnp.asarray(a)
    r = jnp.asarray(r)
    n = r.shape[0]
    if r.shape != (n, n):
        raise ValueError(f"r must be a square [n, n] matrix, got shape {r.shape}")
    if not -a.ndim <= axis < a.ndim:
        raise ValueError(f"axis={axis!r} is out of range for an array of shape {a.shape}")
    axis %= a.ndim
    if a.shape[axis] % n:
        raise ValueError(f"a.shape[{axis}]={a.shape[axis]} is not a multiple of the Hadamard block length {n}")
    return _block_hadamard(a, r, int(axis))


@functools.partial(jax.jit, static_argnames="axis")
def _block_hadamard(a, r, axis: int) -> jax.Array:
    r = r.astype(jnp.float32)  # any real -> f32
    n = r.shape[0]
    a32 = jnp.moveaxis(a.astype(jnp.float32), axis, 0)  # any float -> f32
    rest = a32.shape[1:]
    blocks = a32.reshape(a32.shape[0] // n, n, -1)
    out = jnp.einsum("ij,bjr->bir", r, blocks, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return jnp.moveaxis(out.reshape(a32.shape[0], *rest), 0, axis)
