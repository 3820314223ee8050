"""tiny_cpu_bf16_kahan: bf16 params, bf16 compute, Kahan-compensated updates (seed 000, Algorithm 1).

Command:

    python -m lpt.train --config configs/tiny_cpu_bf16_kahan.py --workdir runs/tiny_cpu_bf16_kahan

Expected result: see EXPECTED (2 CPU cores): validation loss within 1% of tiny_cpu_fp32.py's, while storing 8 bytes per
parameter (bf16 param, Adam moments and compensation) instead of 16. The compensation buffer carries the part of each
update that bf16 rounding would lose; diagnostics update/cancelled_fraction etc. are logged.
"""

from tiny_cpu import get_config as tiny_cpu_config

EXPECTED = "filled in after measurement"


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "bfloat16"  # params stored in bf16 (no f32 master copy)
    c.precision.compute_dtype = "bfloat16"  # matmul inputs and activations in bf16
    c.precision.update_rule = "kahan"  # lpt.optim.kahan_summation last in the optax chain
    return c
