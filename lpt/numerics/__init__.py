"""lpt.numerics: float formats and rounding that survives ``jit``. Pure jnp; everything else stands on this."""

from lpt.numerics.formats import (
    FORMATS,
    FloatFormat,
    exponent_of,
    get_format,
    is_low_precision,
    pow2,
    ulp,
)
from lpt.numerics.random import hash_bits, random_bits
from lpt.numerics.rounding import round_nearest, round_stochastic, round_to_bits

__all__ = [
    "FORMATS",
    "FloatFormat",
    "exponent_of",
    "get_format",
    "hash_bits",
    "is_low_precision",
    "pow2",
    "random_bits",
    "round_nearest",
    "round_stochastic",
    "round_to_bits",
    "ulp",
]
