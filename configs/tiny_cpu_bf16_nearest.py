"""tiny_cpu_bf16_nearest: bf16 params updated with plain round-to-nearest (the failure case of seed 000).

Command:

    python -m lpt.train --config configs/tiny_cpu_bf16_nearest.py --workdir runs/tiny_cpu_bf16_nearest

Expected result: see EXPECTED (2 CPU cores): measurably worse than tiny_cpu_fp32.py / tiny_cpu_bf16_kahan.py, because
updates smaller than half a bf16 ulp of the weight are rounded away (update/cancelled_fraction shows how many).
"""

from tiny_cpu import get_config as tiny_cpu_config

EXPECTED = "filled in after measurement"


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "bfloat16"  # params stored in bf16
    c.precision.compute_dtype = "bfloat16"  # matmul inputs and activations in bf16
    c.precision.update_rule = "nearest"  # lpt.optim.nearest_rounding: what optax.apply_updates does to bf16
    return c
