"""lpt.pqt: pseudo-quantization training by Gaussian weight sampling (Ahn & Yoo, Gaussian Weight Sampling) and the
DiffQ baseline.

* :func:`rounded_normal` — R ≈ round(N(0,1)/2) of Eq. 10 from random bits with AND / OR (``noise.py``).
* :func:`gaussws` / :func:`diffq` — ŵ = w + R ⊙ broadcast(max₃₂ₓ₃₂|w| · 2^(1−b_t)) with a ``custom_vjp`` that
  regenerates R from the key in the backward (Eq. 3, Eq. 4) (``gaussws.py``).
* :func:`pqt_key` / :func:`step_key` / :func:`layer_key` — noise keys from (seed, step, layer path) (``keys.py``).
* :class:`PQTBitwidth`, :func:`init_bitwidth`, :func:`effective_bitwidth` (Eq. 11), :func:`bitwidth_loss`
  (Eq. 12), :func:`bitwidth_stats` (diagnostics) (``bitwidth.py``).
* :func:`apply_pqt`, :class:`GaussWSLinear`, :func:`assign_pqt_paths` — the NNX side (``layers.py``).

See docs/pqt.md.
"""

from lpt.pqt.bitwidth import (
    DEFAULT_B_INIT,
    DEFAULT_B_TARGET,
    DEFAULT_TIERS,
    PQTBitwidth,
    bitwidth_loss,
    bitwidth_of,
    bitwidth_stats,
    effective_bitwidth,
    init_bitwidth,
    tile_sizes,
)
from lpt.pqt.gaussws import COMPUTE_DTYPES, METHODS, block_grid, diffq, gaussws, pqn_noise, pqn_sample
from lpt.pqt.keys import layer_key, path_id, pqt_key, step_key
from lpt.pqt.layers import GaussWSLinear, apply_pqt, assign_pqt_paths
from lpt.pqt.noise import (
    ROUNDED_NORMAL_PMF,
    ROUNDED_NORMAL_VALUES,
    rounded_normal,
    rounded_normal_from_bits,
    symmetric_uniform,
)

__all__ = [
    "COMPUTE_DTYPES",
    "DEFAULT_B_INIT",
    "DEFAULT_B_TARGET",
    "DEFAULT_TIERS",
    "METHODS",
    "ROUNDED_NORMAL_PMF",
    "ROUNDED_NORMAL_VALUES",
    "GaussWSLinear",
    "PQTBitwidth",
    "apply_pqt",
    "assign_pqt_paths",
    "bitwidth_loss",
    "bitwidth_of",
    "bitwidth_stats",
    "block_grid",
    "diffq",
    "effective_bitwidth",
    "gaussws",
    "init_bitwidth",
    "layer_key",
    "path_id",
    "pqn_noise",
    "pqn_sample",
    "pqt_key",
    "rounded_normal",
    "rounded_normal_from_bits",
    "step_key",
    "symmetric_uniform",
    "tile_sizes",
]
