"""The f32 square root rounded to nearest, from operations that every backend computes alike.

``lax.sqrt`` is not one function on a GPU: XLA:GPU and Triton emit ``sqrt.rn.f32`` (IEEE), while a Mosaic GPU kernel
gets ``sqrt.approx.f32`` (its PTX shows it; PTX documents a relative error up to 2^-23, so the result may be a
neighbour of the rounded root). :func:`sqrt_rn` takes whatever ``lax.sqrt`` gives and moves it to the correctly
rounded root with a test that uses only u32 integer arithmetic, exact by construction:

For ``x = X·2^ex`` and a candidate ``y = Y·2^ky`` (``X, Y`` the 24-bit significands), the root rounds to ``y`` iff
it lies between the midpoints to ``y``'s neighbours, i.e. iff ``M−² < x < M+²`` with ``M+ = (2Y+1)·2^(ky−1)`` and
``M− = (2Y−1)·2^(ky−1)`` (at a power of two ``Y = 2^23`` the lower neighbour is half an ulp away:
``M− = (4Y−1)·2^(ky−2)``). Both sides are integers times powers of two, compared as 64-bit integers held in two u32
words: ``X·2^s`` against ``A²`` for ``A < 2^25``. No root lies on a midpoint (``A²`` is odd with more than 24
significant bits), so there are no ties. A step moves ``y`` by one ulp towards the root; :func:`correct_sqrt` takes
two, enough for any start within two ulps. Subnormal ``x`` is scaled by 2^24 first (its root by 2^12, both exact;
XLA:CPU flushes subnormal operands to zero, so there they are 0 in the twin and here alike); 0, inf, NaN and negative
``x`` keep ``lax.sqrt``'s value.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["correct_sqrt", "sqrt_rn"]

_MANTISSA = 0x7FFFFF
_HIDDEN = 0x800000  # the implicit leading one of a normal f32 significand (2^23)


def sqrt_rn(x32):
    """``sqrt(x)`` of f32 ``x``, rounded to nearest even on every backend (:func:`correct_sqrt` of ``lax.sqrt``)."""
    return correct_sqrt(x32, jnp.sqrt(x32))


def correct_sqrt(x32, y32):
    """The correctly rounded ``sqrt(x)`` from ``y``, an approximation of it within two f32 ulps (f32 arrays of one
    shape); elements with x <= 0, inf or NaN return ``y`` unchanged (see the module doc)."""
    small = x32 < jnp.float32(2.0**-126)  # subnormal (or zero, negative: masked below)
    xs = jnp.where(small, x32 * jnp.float32(2.0**24), x32)  # exact: a power of two into the normal range
    ys = jnp.where(small, y32 * jnp.float32(2.0**12), y32)  # sqrt scales by 2^12, exactly
    for _ in range(2):
        ys = _step(xs, ys)
    ys = jnp.where(small, ys * jnp.float32(2.0**-12), ys)  # back, exact: the root of a subnormal is normal
    ok = (x32 > 0) & (x32 < jnp.float32(jnp.inf))
    return jnp.where(ok, ys, y32)


def _parts(v32):
    """(significand with its hidden bit, exponent) of positive normal f32 ``v``: ``v = S·2^e``, as u32 and i32."""
    bits = lax.bitcast_convert_type(v32, jnp.uint32)
    sig = (bits & jnp.uint32(_MANTISSA)) | jnp.uint32(_HIDDEN)
    exp = (bits >> 23).astype(jnp.int32) - 150  # u32 -> i32 (< 256)
    return sig, exp


def _square(a):
    """``a²`` for u32 ``a < 2^25`` as (high, low) u32 words: ``a = h·2^13 + l``, ``a² = h²·2^26 + h·l·2^14 + l²``."""
    h, low = a >> 13, a & jnp.uint32(0x1FFF)
    hh, hl, ll = h * h, h * low, low * low  # < 2^24, 2^25, 2^26: exact in u32
    lo1, lo2 = hh << 26, hl << 14
    lo = lo1 + lo2
    carry1 = (lo < lo1).astype(jnp.uint32)  # bool -> u32
    lo_all = lo + ll
    carry2 = (lo_all < lo).astype(jnp.uint32)  # bool -> u32
    return (hh >> 6) + (hl >> 18) + carry1 + carry2, lo_all


def _shifted(sig, s):
    """``sig·2^s`` for u32 ``sig < 2^24`` and 0 < s < 32 as (high, low) u32 words."""
    s_u = s.astype(jnp.uint32)  # i32 -> u32, in (0, 32)
    return sig >> (jnp.uint32(32) - s_u), sig << s_u


def _greater(a, b):
    """``a > b`` for (high, low) u32 pairs."""
    return (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] > b[1]))


def _step(x32, y32):
    """``y`` moved one ulp towards ``sqrt(x)`` if the root lies beyond a midpoint to a neighbour (x, y positive
    normal; elsewhere the result is discarded by the caller)."""
    xsig, ex = _parts(x32)
    ysig, ey = _parts(y32)
    s = jnp.clip(ex - 2 * ey + 2, 1, 31)  # x / 2^(2ey−2) = X·2^s; about 24..27 when y is near the root
    power = ysig == jnp.uint32(_HIDDEN)  # y = 2^k: its lower neighbour is half an ulp away
    below = jnp.where(power, 4 * ysig - 1, 2 * ysig - 1)
    s_below = jnp.clip(s + jnp.where(power, 2, 0), 1, 31)
    up = _greater(_shifted(xsig, s), _square(2 * ysig + 1))  # x > M+²: the root is above y's upper midpoint
    down = _greater(_square(below), _shifted(xsig, s_below))  # x < M−²
    bits = lax.bitcast_convert_type(y32, jnp.uint32)
    bits = bits + up.astype(jnp.uint32) - down.astype(jnp.uint32)  # bool -> u32: the next f32 up or down
    return lax.bitcast_convert_type(bits, jnp.float32)
