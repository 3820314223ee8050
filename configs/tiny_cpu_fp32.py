"""tiny_cpu_fp32: the float32 baseline the low-precision recipes are compared against (the same run as tiny_cpu.py).

Command (it writes the files tiny_cpu.py lists, to its --workdir):

    python -m lpt.train --config configs/tiny_cpu_fp32.py --workdir runs/tiny_cpu_fp32

The recipes are compared at --config.optim.lr=1e-3 (``python -m lpt.lab recipes``). Measured: docs/results.md,
"Trainer runs and recipes" and "Lab recipes with the fixed-order δ and the guarded optimizer chain".
"""

from tiny_cpu import get_config as tiny_cpu_config


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "float32"  # params stored and viewed in float32
    c.precision.compute_dtype = "float32"  # matmuls and activations in float32
    c.precision.update_rule = "f32_master"  # plain AdamW update added in float32
    return c
