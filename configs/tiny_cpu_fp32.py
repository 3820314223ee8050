"""tiny_cpu_fp32: the float32 baseline the low-precision recipes are compared against.

Command:

    python -m lpt.train --config configs/tiny_cpu_fp32.py --workdir runs/tiny_cpu_fp32

Expected result (2 CPU cores, AMD EPYC Zen 4): the same run as configs/tiny_cpu.py, validation loss 1.3834 at step
600 (unigram baseline 3.367); with --config.optim.lr=1e-3, where the low-precision recipes are compared
(``python -m lpt.lab recipes``): 1.404. About 65-100 s on an idle 2-core machine; the last digits depend on the CPU's
vector extensions.
"""

from tiny_cpu import get_config as tiny_cpu_config


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "float32"  # params stored and viewed in float32
    c.precision.compute_dtype = "float32"  # matmuls and activations in float32
    c.precision.update_rule = "f32_master"  # plain AdamW update added in float32
    return c
