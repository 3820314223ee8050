"""tiny_cpu_bf16_sr: bf16 params, bf16 compute, stochastic rounding of every update (seed 000).

Command:

    python -m lpt.train --config configs/tiny_cpu_bf16_sr.py --workdir runs/tiny_cpu_bf16_sr

Expected result: see EXPECTED (2 CPU cores): close to the float32 baseline without any extra state (unbiased
rounding keeps small updates alive in expectation); slightly noisier than Kahan.
"""

from tiny_cpu import get_config as tiny_cpu_config

EXPECTED = "filled in after measurement"


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "bfloat16"  # params stored in bf16
    c.precision.compute_dtype = "bfloat16"  # matmul inputs and activations in bf16
    c.precision.update_rule = "stochastic"  # lpt.optim.stochastic_rounding, key = fold_in(seed, step, leaf)
    return c
