"""tiny_cpu_fp32: the float32 baseline the low-precision recipes are compared against.

Command:

    python -m lpt.train --config configs/tiny_cpu_fp32.py --workdir runs/tiny_cpu_fp32

Expected result (2 CPU cores): validation loss 1.3955 at step 600 (unigram baseline 3.367); with
--config.optim.lr=1e-3: 1.4043. About 100 s on an idle 2-core machine.
"""

from tiny_cpu import get_config as tiny_cpu_config

EXPECTED = {"eval_loss": 1.3955, "eval_loss_lr1e-3": 1.4043}


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "float32"  # params stored and viewed in float32
    c.precision.compute_dtype = "float32"  # matmuls and activations in float32
    c.precision.update_rule = "f32_master"  # plain AdamW update added in float32
    return c
