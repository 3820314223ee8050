"""The floating-point formats lpt rounds into, and their constants.

Every number here is derived from ``ml_dtypes.finfo`` (or ``numpy.finfo`` for the IEEE types), never typed in by
hand, so the table cannot drift from the dtypes JAX actually uses.

A format with ``p = mantissa_bits`` explicit mantissa bits has, for a normal value ``2^e · 1.f``, the spacing
``ulp = 2^(e - p)``; below ``smallest_normal = 2^emin`` the spacing is the constant ``smallest_subnormal =
2^(emin - p)``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """Constants of one floating-point format (all Python floats / ints, usable as static jit constants)."""

    name: str
    dtype: np.dtype
    bits: int  # storage bits
    exponent_bits: int
    mantissa_bits: int  # explicit (stored) mantissa bits, p
    emin: int  # exponent of the smallest normal number
    emax: int  # exponent of the largest finite number
    eps: float  # 2^-p: spacing just above 1.0
    max: float  # largest finite value
    smallest_normal: float  # 2^emin
    smallest_subnormal: float  # 2^(emin - p)
    has_inf: bool
    has_nan: bool
    xla_storable: bool  # False: XLA cannot hold arrays of it; lpt returns its values as f32 on its grid

    def __str__(self) -> str:
        return self.name


def _make(dtype) -> FloatFormat:
    dt = np.dtype(dtype)
    fi = ml_dtypes.finfo(dt) if dt.kind == "V" or dt.name not in ("float16", "float32", "float64") else np.finfo(dt)
    p = int(fi.nmant)
    sub = float(fi.smallest_subnormal)
    normal = float(fi.smallest_normal)
    with np.errstate(over="ignore", invalid="ignore"):
        inf_cast = np.array(np.inf, np.float32).astype(dt).astype(np.float32)
        nan_cast = np.array(np.nan, np.float32).astype(dt).astype(np.float32)
    return FloatFormat(
        name=dt.name,
        dtype=dt,
        bits=dt.itemsize * 8 if dt.name not in _SUBBYTE_BITS else _SUBBYTE_BITS[dt.name],
        exponent_bits=int(fi.nexp),
        mantissa_bits=p,
        emin=int(round(math.log2(normal))),
        emax=int(math.floor(math.log2(float(fi.max)))),
        eps=float(2.0**-p),
        max=float(fi.max),
        smallest_normal=normal,
        smallest_subnormal=sub,
        has_inf=bool(np.isinf(inf_cast)),
        has_nan=bool(np.isnan(nan_cast)),
        xla_storable=dt.name not in _NOT_XLA_STORABLE,
    )


# ml_dtypes stores fp6/fp4 values in one byte each; their format has fewer bits.
_SUBBYTE_BITS = {"float6_e2m3fn": 6, "float6_e3m2fn": 6, "float4_e2m1fn": 4}
# XLA (jax 0.10) rejects arrays of the fp6 types ("Invalid XLA PrimitiveType"); float4_e2m1fn works.
_NOT_XLA_STORABLE = {"float6_e2m3fn", "float6_e3m2fn"}

_DTYPES = [
    jnp.float32,
    jnp.bfloat16,
    jnp.float16,
    jnp.float8_e4m3fn,
    jnp.float8_e5m2,
    ml_dtypes.float6_e2m3fn,
    ml_dtypes.float6_e3m2fn,
    ml_dtypes.float4_e2m1fn,
]

FORMATS: dict[str, FloatFormat] = {f.name: f for f in (_make(d) for d in _DTYPES)}
"""Every format lpt rounds into, by dtype name (``float32`` is listed so that f32 leaves can pass through)."""


def get_format(dtype) -> FloatFormat:
    """The :class:`FloatFormat` of ``dtype`` (a dtype, a dtype name, or a ``FloatFormat``).

    Raises ``ValueError`` naming the dtype and the supported ones if lpt does not know it.
    """
    if isinstance(dtype, FloatFormat):
        return dtype
    try:
        name = np.dtype(dtype).name
    except TypeError as e:
        raise ValueError(f"not a dtype: {dtype!r}; supported float formats: {sorted(FORMATS)}") from e
    if name not in FORMATS:
        raise ValueError(f"unsupported dtype {name!r}; supported float formats: {sorted(FORMATS)}")
    return FORMATS[name]


def exponent_of(x_f32: jax.Array) -> jax.Array:
    """floor(log2|x|) of f32 values as int32, read from the bits (f32 subnormals and 0 report -126)."""
    bits = jax.lax.bitcast_convert_type(x_f32.astype(jnp.float32), jnp.uint32)  # f32 -> u32 bits
    biased = ((bits >> 23) & 0xFF).astype(jnp.int32)  # u32 -> i32
    return jnp.maximum(biased, 1) - 127


def pow2(e: jax.Array) -> jax.Array:
    """2^e as f32 for int32 e in [-126, 127], built from the bits (exact; no transcendental)."""
    biased = (e.astype(jnp.int32) + 127).astype(jnp.uint32)  # i32 -> u32
    return jax.lax.bitcast_convert_type(biased << 23, jnp.float32)  # u32 bits -> f32


def ulp(x, dtype) -> jax.Array:
    """Spacing of ``dtype``'s grid at ``x``, as f32: the gap from |x| to the next larger representable magnitude.

    For a normal value with exponent e this is ``2^(e - p)``; in the subnormal range it is ``smallest_subnormal``.
    At an exact power of two it is the gap *above* (the gap below is half of it).
    """
    fmt = get_format(dtype)
    x32 = jnp.asarray(x).astype(jnp.float32)  # any float -> f32 (exact)
    e = jnp.maximum(exponent_of(x32), fmt.emin)
    if fmt.emin - fmt.mantissa_bits >= -126:
        return pow2(e - fmt.mantissa_bits)
    # bf16 (and f32) subnormal spacing is itself an f32 subnormal: scale in two exact steps.
    return pow2(e - fmt.mantissa_bits + 64) * jnp.float32(2.0**-64)
