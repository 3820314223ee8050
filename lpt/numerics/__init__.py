"""lpt.numerics: float formats and rounding that survives ``jit``. Pure jnp; everything else stands on this.

* Formats (``formats.py``): :data:`FORMATS` and :func:`get_format` give the :class:`FloatFormat` (bits, eps, max,
  smallest normal and subnormal, ...) of every float lpt rounds into; :func:`ulp` its grid spacing at ``x``;
  :func:`exponent_of` (floor(log2|x|)) and :func:`pow2` (2^e), both on the f32 bits.
* Rounding (``rounding.py``): :func:`round_nearest`, :func:`round_stochastic`, :func:`round_to_bits`.
* Random bits (``random.py``): :func:`hash_bits`, the counter-based bits behind stochastic rounding, and
  :func:`random_bits` (``rng="hash"`` or ``"threefry"``).
"""

from lpt.numerics.formats import (
    FORMATS,
    FloatFormat,
    exponent_of,
    get_format,
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
    "pow2",
    "random_bits",
    "round_nearest",
    "round_stochastic",
    "round_to_bits",
    "ulp",
]
