"""lpt.pqt: pseudo-quantization training by Gaussian weight sampling (Ahn & Yoo, Gaussian Weight Sampling) and the
DiffQ baseline.

* :func:`rounded_normal` — R ≈ round(N(0,1)/2) of Eq. 10 from random bits with AND / OR, and its exact
  distribution :data:`ROUNDED_NORMAL_PMF`; :func:`symmetric_uniform` — DiffQ's R ~ U(−0.5, 0.5) (``noise.py``).
* :func:`gaussws` / :func:`diffq` — ŵ = w + R ⊙ broadcast(max₃₂ₓ₃₂|w| · 2^(1−b_t)) with a ``custom_vjp`` that
  regenerates R from the key in the backward (Eq. 3, Eq. 4); :func:`block_grid` — the shape of b_t's tile grid
  (``gaussws.py``).
* :func:`pqt_key` / :func:`step_key` / :func:`layer_key` — noise keys from (seed, step, layer path) (``keys.py``).
* :class:`PQTBitwidth`, :func:`init_bitwidth`, :func:`effective_bitwidth` (Eq. 11), :func:`bitwidth_of` (b_t of a
  ``PQTBitwidth``), :func:`bitwidth_loss` (Eq. 12), :func:`bitwidth_stats` (diagnostics) (``bitwidth.py``).
* :func:`apply_pqt`, :class:`GaussWSLinear`, :func:`assign_pqt_paths` — the NNX side (``layers.py``).

Everything else (``pqn_sample``: ``gaussws`` / ``diffq`` with the method as an argument; default values and
constants) is importable from its module. See docs/pqt.md.
"""

from lpt.pqt.bitwidth import (
    PQTBitwidth,
    bitwidth_loss,
    bitwidth_of,
    bitwidth_stats,
    effective_bitwidth,
    init_bitwidth,
)
from lpt.pqt.gaussws import block_grid, diffq, gaussws
from lpt.pqt.keys import layer_key, pqt_key, step_key
from lpt.pqt.layers import GaussWSLinear, apply_pqt, assign_pqt_paths
from lpt.pqt.noise import ROUNDED_NORMAL_PMF, rounded_normal, symmetric_uniform

__all__ = [
    "ROUNDED_NORMAL_PMF",
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
    "pqt_key",
    "rounded_normal",
    "step_key",
    "symmetric_uniform",
]
