"""tiny_cpu_fp32: the float32 baseline the low-precision recipes are compared against.

Command:

    python -m lpt.train --config configs/tiny_cpu_fp32.py --workdir runs/tiny_cpu_fp32

Expected result (2 CPU cores, AMD EPYC Zen 4, 2026-11-22): validation loss 1.3860 at step 600 (unigram baseline
3.367); with --config.optim.lr=1e-3: 1.4043. About 65-100 s on an idle 2-core machine. (The last digits depend on
the CPU's vector extensions: 1.3907 on a CPU without AVX-512.)
"""

from tiny_cpu import get_config as tiny_cpu_config

EXPECTED = {"eval_loss": 1.3860, "eval_loss_lr1e-3": 1.4043}


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "float32"  # params stored and viewed in float32
    c.precision.compute_dtype = "float32"  # matmuls and activations in float32
    c.precision.update_rule = "f32_master"  # plain AdamW update added in float32
    return c
