"""lpt.numerics: float formats and rounding that survives ``jit``. Pure jnp; everything else stands on this.

* Formats (``formats.py``): :data:`FORMATS` and :func:`get_format` give the :class:`FloatFormat` (bits, eps, max,
  smallest normal and subnormal, ...) of every float lpt rounds into; :func:`ulp` its grid spacing at ``x``;
  :func:`exponent_of` (floor(log2|x|)) and :func:`pow2` (2^e), both on the f32 bits.
* Rounding (``rounding.py``): :func:`round_nearest`, :func:`round_stochastic`, :func:`round_to_bits`; for update
  rules, the dtype of a parameter's change (:func:`update_dtype`) and the change itself (:func:`change_to`).
* Block scales (``scaling.py``): :func:`block_scale`, the f32 or power-of-two scale of a block stored in a narrow
  float (blockwise FP8, 8-bit Adam moments).
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
from lpt.numerics.rounding import change_to, round_nearest, round_stochastic, round_to_bits, update_dtype
from lpt.numerics.scaling import block_scale

__all__ = [
    "FORMATS",
    "FloatFormat",
    "block_scale",
    "change_to",
    "exponent_of",
    "get_format",
    "hash_bits",
    "pow2",
    "random_bits",
    "round_nearest",
    "round_stochastic",
    "round_to_bits",
    "ulp",
    "update_dtype",
]
