"""Adam's moments in 8 bits: FP8 codes with one float32 scale per block of the last axis.

A moment ``x`` of a leaf is cut into blocks of ``block`` consecutive elements of its last axis (zero-padded to a
whole block; a leaf whose last axis is shorter than ``block`` is one block per row). Per block, in f32::

    y     = sqrt(x) if v_sqrt (second moment) else x
    scale = max(amax(|y|) / F_max, 2^-126), 1 if amax = 0    (lpt.numerics.block_scale; F_max 448 for e4m3)
    code  = Q_F(y / scale)                                   (stochastic or nearest rounding into F, saturating)
    y'    = code · scale                 x' = y'^2 if v_sqrt else y'

The block's largest element maps onto ``F_max`` and keeps the format's full relative precision; an element more than
the format's dynamic range below it (e4m3: 2^17.8, e5m2: 2^31.8) underflows to 0. The f32 scale follows the block's
common decay exactly, so an EMA whose elements decay together (``b2·v`` with no new gradient) keeps its codes and only
the scale moves. Storing ``sqrt(v)`` halves ``v``'s dynamic range in the exponent (``v`` is ``g²``), so ``sqrt(v)``
spans the decades ``m`` does. ``m`` still reacts faster than ``v``, so a coordinate's ``sqrt(v)`` can underflow in
its block while its ``m`` does not; the Adam updates therefore read ``v`` at least ``(m / C)²``, the Cauchy–Schwarz
bound of the two EMAs (:func:`lpt.kernels.adamw_kahan.math.v_floor`), instead of dividing ``m`` by ``eps``.

A block never spans two shards when the last axis is split into pieces that are whole multiples of ``block``: the
scales have the param's rank (``shape[:-1] + (blocks,)``) and shard with the param's own PartitionSpec (the trainer
keeps a mesh axis on a dim of the scales only where it divides it).

State per element: two uint8 codes (``kahan_adamw`` packs them into one ``uint16``) and ``8 / block`` bytes of
scales (m's and v's as one ``complex64`` per block): 2.0625 bytes/param at ``block = 128``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from lpt.kernels.fp8_codes_math import decode_blocks, encode_blocks
from lpt.numerics import hash_bits


@dataclasses.dataclass(frozen=True)
class Moment8:
    """How both Adam moments are stored in 8 bits (module doc). ``name`` is the ``moment_dtype`` that selects it."""

    name: str
    m_format: str = "float8_e4m3fn"
    v_format: str = "float8_e4m3fn"
    v_sqrt: bool = True
    block: int = 128

    def blocks(self, shape) -> tuple[int, ...]:
        """The scales' shape for a leaf of ``shape``: ``shape[:-1] + (ceil(shape[-1] / block),)`` (``(1,)`` for a
        scalar)."""
        if not shape:
            return (1,)
        return (*shape[:-1], -(-shape[-1] // self.block_of(shape)))

    def block_of(self, shape) -> int:
        return max(1, min(self.block, shape[-1])) if shape else 1

    def bytes_per_param(self, shape) -> float:
        """State bytes per element of a leaf of ``shape``: the uint16 codes plus its share of the complex64 scales."""
        n = max(1, math.prod(shape))
        return (2 * n + 8 * math.prod(self.blocks(shape))) / n


# ``moment_dtype`` names of 8-bit moments. "float8_e4m3fn": e4m3 for m and for sqrt(v) (docs/results.md: the lab's
# comparison); the others are the lab's alternatives.
MOMENT8 = {
    m.name: m
    for m in (
        Moment8("float8_e4m3fn"),
        Moment8("float8_e5m2", "float8_e5m2", "float8_e5m2"),
        Moment8("e4m3_v_direct", v_sqrt=False),
        Moment8("e4m3_m_e5m2_v_direct", v_format="float8_e5m2", v_sqrt=False),
    )
}


def _blocked(x, block: int):
    """``(..., L) -> (..., ceil(L/block), block)``, zero-padded (a scalar becomes ``(1, 1)``)."""
    if x.ndim == 0:
        return x.reshape(1, 1)
    pad = -x.shape[-1] % block
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _unblocked(xb, shape):
    if not shape:
        return xb.reshape(())
    flat = xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])
    return flat[..., : shape[-1]]


def encode(x32, fmt: str, block: int, *, sqrt: bool, key=None):
    """f32 moment -> ``(codes uint8, scales f32)``; stochastic rounding with ``key``, nearest without.

    The block math is :func:`lpt.kernels.fp8_codes_math.encode_blocks` (the fused kernel's too); stochastic
    rounding draws ``hash_bits(key, blocked shape)``: one word per element of the zero-padded ``(..., blocks,
    block)`` array, numbered by its flat index (a leaf's own flat index when its last axis is a multiple of
    ``block``), the bits ``lpt.numerics.round_stochastic(z, fmt, key)`` draws.

    Args:
      x32: the f32 moment (any shape).
      fmt: the FP8 format of the codes ("float8_e4m3fn" or "float8_e5m2").
      block: elements per block of the last axis.
      sqrt: encode ``sqrt(x32)`` (the second moment).
      key: PRNG key of the stochastic rounding; None: nearest.
    """
    y = jnp.sqrt(x32) if sqrt else x32
    yb = _blocked(y, block)
    codes, scale = encode_blocks(yb, fmt, None if key is None else hash_bits(key, yb.shape))
    return _unblocked(codes, x32.shape).astype(jnp.uint8), scale[..., 0]  # u32 -> u8 (codes < 256)


def decode(codes, scales, fmt: str, block: int, *, sqrt: bool):
    """Inverse of :func:`encode` (up to its rounding): ``(codes uint8, scales f32) -> f32``.

    Args:
      codes: uint8 codes of :func:`encode`.
      scales: their f32 scales, one per block.
      fmt, block, sqrt: as given to :func:`encode`.
    """
    codes32 = _blocked(codes.astype(jnp.uint32), block)  # u8 -> u32
    y = _unblocked(decode_blocks(codes32, scales[..., None], fmt), codes.shape)
    return y * y if sqrt else y


def pack_codes(m_codes, v_codes):
    """Two uint8 code arrays -> one uint16 per element (m's code high)."""
    return (m_codes.astype(jnp.uint16) << jnp.uint16(8)) | v_codes.astype(jnp.uint16)  # u8 -> u16, widened


def unpack_codes(codes):
    """Inverse of :func:`pack_codes`: ``(m_codes, v_codes)`` as uint8."""
    return (codes >> jnp.uint16(8)).astype(jnp.uint8), codes.astype(jnp.uint8)  # high byte; low byte (truncating)


def store(spec: Moment8, m32, v32, *, km=None, kv=None):
    """Both f32 moments -> ``(m_codes, v_codes, scales)``: uint8 codes like the moments, and one complex64 per block
    (m's scale real, v's imaginary). Keys ``km``/``kv`` give stochastic rounding, none nearest.

    Args:
      spec: the :class:`Moment8` (formats, ``v_sqrt``, block).
      m32, v32: the f32 first and second moments, one shape.
      km, kv: PRNG keys of m's and v's stochastic rounding; None: nearest.
    """
    b = spec.block_of(m32.shape)
    mc, ms = encode(m32, spec.m_format, b, sqrt=False, key=km)
    vc, vs = encode(v32, spec.v_format, b, sqrt=spec.v_sqrt, key=kv)
    return mc, vc, lax.complex(ms, vs)  # f32 -> complex64 (m + i·v)


def load(spec: Moment8, m_codes, v_codes, scales):
    """Inverse of :func:`store` (up to its rounding): both moments as f32."""
    b = spec.block_of(m_codes.shape)
    m = decode(m_codes, jnp.real(scales), spec.m_format, b, sqrt=False)
    return m, decode(v_codes, jnp.imag(scales), spec.v_format, b, sqrt=spec.v_sqrt)


def zeros(spec: Moment8, shape):
    """The initial state of a leaf of ``shape``: zero codes (uint8, like the leaf) and zero scales (complex64)."""
    return jnp.zeros(shape, jnp.uint8), jnp.zeros(spec.blocks(shape), jnp.complex64)


def block_health(spec: Moment8, m_codes, v_codes, scales) -> dict[str, jax.Array]:
    """Fractions over a leaf's elements whose 8-bit code underflowed to 0 in a block that is not all zero, per
    moment (what the lab reports as scale underflow), and of blocks whose scale is zero or not finite."""
    b = spec.block_of(m_codes.shape)
    out = {}
    for name, c, s in (("m", m_codes, jnp.real(scales)), ("v", v_codes, jnp.imag(scales))):
        zero = (_blocked(c & jnp.uint8(0x7F), b) == 0) & (s[..., None] > 0)  # magnitude bits 0: a zero code
        out[f"{name}_underflow"] = jnp.mean(_unblocked(zero, c.shape).astype(jnp.float32))  # bool -> f32
        out[f"{name}_bad_scale"] = jnp.mean((~jnp.isfinite(s)).astype(jnp.float32))  # bool -> f32
    return out


__all__ = [
    "MOMENT8",
    "Moment8",
    "block_health",
    "decode",
    "encode",
    "load",
    "pack_codes",
    "store",
    "unpack_codes",
    "zeros",
]
