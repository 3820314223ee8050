"""tiny_cpu_fp32: the float32 baseline the low-precision recipes are compared against.

Command:

    python -m lpt.train --config configs/tiny_cpu_fp32.py --workdir runs/tiny_cpu_fp32

Expected result: see EXPECTED (2 CPU cores). Same model, data and schedule as tiny_cpu.py; float32 everywhere.
"""

from tiny_cpu import get_config as tiny_cpu_config

EXPECTED = "filled in after measurement"


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "float32"  # params stored and viewed in float32
    c.precision.compute_dtype = "float32"  # matmuls and activations in float32
    c.precision.update_rule = "f32_master"  # plain AdamW update added in float32
    return c
