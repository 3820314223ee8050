"""The fused AdamW math (lpt.kernels.adamw_kahan.math), which the Pallas kernel (interpreted, compiled) and the XLA
path share: its inline bf16 stochastic rounding equals lpt.numerics.round_stochastic bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np

from lpt.kernels.adamw_kahan.math import stochastic_bf16
from lpt.numerics import hash_bits, round_stochastic


def test_inline_stochastic_rounding_equals_round_stochastic():
    """The kernel's bf16 stochastic rounding (inline: Triton cannot lower hash_bits' key handling) is
    lpt.numerics.round_stochastic bit for bit on random f32 bit patterns and the specials (±inf, NaN payloads, the
    largest bf16 and values that overflow past it, signed zeros, subnormals)."""
    bits = np.random.default_rng(5).integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    specials = [0x7F800000, 0xFF800000, 0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F7F0000, 0x7F7FFFFF, 0xFF7FFFFF]
    specials += [0, 0x80000000, 1, 0x807FFFFF]  # ±0, subnormals
    bits[: len(specials)] = np.asarray(specials, np.uint32)
    x = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.float32)
    key = jnp.asarray([7, 9], jnp.uint32)
    inline = jax.jit(lambda x: stochastic_bf16(x, hash_bits(key, x.shape) >> 16))(x)
    ref = jax.jit(lambda x: round_stochastic(x, jnp.bfloat16, key, out_dtype=jnp.float32))(x)
    a, b = np.asarray(inline), np.asarray(ref)
    same = (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))
    assert same.all(), bits[~same][:5]
    assert np.isinf(a[6]) and np.isinf(a[7])  # 0x7F7FFFFF rounds past the largest bf16 with probability ~1
