"""``emulated_dot``: a matmul whose running sum lives in an emulated limited-precision register (the FP8 accumulation
tutorial's table).

For ``a[..., K] @ b[K, N]`` each output keeps a register ``r`` and, if ``promote_every = P`` is set, an f32
accumulator ``s``::

    for k in 0 .. K-1:
        r = round_to_bits(r + a[.., k] * b[k, :], accumulator_bits, max_abs)   # product exact in f32 for FP8 inputs
        if P and (k + 1) % P == 0:  s = s + r;  r = 0                          # promotion to f32 (CUDA cores)
    result = s + r

``accumulator_bits`` counts explicit mantissa bits (f32's exponent range is kept): 3 with ``max_abs=448`` is an
FP8 e4m3 accumulator (its limited exponent range below 2^-6 is not modelled), ~13-14 the Hopper WGMMA register as
measured by DeepSeek-V3, 23 a plain f32 sequential sum. Products are computed in f32: exact when both inputs have
<= 11 significant bits (FP8, FP6, FP4, and bf16 x FP8); otherwise rounded once. The loop is a ``lax.scan`` over K
(sequential, as the register is): use it for research-sized shapes, not for training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lpt.numerics import round_to_bits

__all__ = ["emulated_dot"]


def emulated_dot(
    a, b, *, accumulator_bits: int, promote_every: int | None = None, max_abs: float | None = None
) -> jax.Array:
    """Emulated-accumulator matmul ``a[..., K] @ b[K, N]`` (or ``b[K]``) returning f32; see module docstring.

    Args:
      a, b: floating-point operands (computed in f32).
      accumulator_bits: explicit mantissa bits of the running-sum register, int in [0, 23].
      promote_every: flush the register into an f32 accumulator after every this many products (None: never).
      max_abs: saturate the register at this magnitude (448 for an e4m3 accumulator); None: no saturation.
    """
    a = jnp.asarray(a)
    b = jnp.asarray(b)
    for name, v in (("a", a), ("b", b)):
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating-point array, got dtype {v.dtype}")
    if not isinstance(accumulator_bits, int) or not 0 <= accumulator_bits <= 23:
        raise ValueError(f"accumulator_bits must be an int in [0, 23], got {accumulator_bits!r}")
    if promote_every is not None and (not isinstance(promote_every, int) or promote_every <= 0):
        raise ValueError(f"promote_every must be a positive int or None, got {promote_every!r}")
    if a.ndim < 1 or b.ndim not in (1, 2) or a.shape[-1] != b.shape[0]:
        raise ValueError(f"need a[..., K] and b[K] or b[K, N] with equal K; got {a.shape} and {b.shape}")
    vec = b.ndim == 1
    k = b.shape[0]
    a2 = a.reshape(-1, k).astype(jnp.float32)  # any float -> f32
    b2 = (b[:, None] if vec else b).astype(jnp.float32)  # any float -> f32
    p = k if promote_every is None else promote_every
    nchunks = -(-k // p)
    pad = nchunks * p - k  # zero products leave an on-grid register unchanged: padding is exact
    a_c = jnp.pad(a2, ((0, 0), (0, pad))).T.reshape(nchunks, p, a2.shape[0])  # [chunks, P, M]
    b_c = jnp.pad(b2, ((0, pad), (0, 0))).reshape(nchunks, p, b2.shape[1])  # [chunks, P, N]

    def add(r, ab):
        a_k, b_k = ab
        prod = a_k[:, None] * b_k[None, :]  # f32 outer product, exact for FP8 inputs
        return round_to_bits(r + prod, accumulator_bits, max_abs), None

    def chunk(s, ab):
        r0 = jnp.zeros_like(s)
        r, _ = lax.scan(add, r0, ab)
        return s + r, None  # promotion: f32 add

    s0 = jnp.zeros((a2.shape[0], b2.shape[1]), jnp.float32)
    s, _ = lax.scan(chunk, s0, (a_c, b_c))
    out_shape = a.shape[:-1] + (() if vec else (b.shape[1],))
    return s.reshape(out_shape)
