"""tiny_cpu_bf16_sr: bf16 params, bf16 compute, stochastic rounding of every update (seed 000).

Command:

    python -m lpt.train --config configs/tiny_cpu_bf16_sr.py --workdir runs/tiny_cpu_bf16_sr

Expected result (2 CPU cores): validation loss 1.3890 at the default lr=3e-3 (float32: 1.3955, -0.5%).
"""

from tiny_cpu import get_config as tiny_cpu_config

EXPECTED = {"eval_loss": 1.3890}


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "bfloat16"  # params stored in bf16
    c.precision.compute_dtype = "bfloat16"  # matmul inputs and activations in bf16
    c.precision.update_rule = "stochastic"  # lpt.optim.stochastic_rounding, key = fold_in(seed, step, leaf)
    return c
