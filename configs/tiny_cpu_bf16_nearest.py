"""tiny_cpu_bf16_nearest: bf16 params updated with plain round-to-nearest (the nearest-rounding floor of Zamirai et
al., Revisiting BFloat16 Training).

Command:

    python -m lpt.train --config configs/tiny_cpu_bf16_nearest.py --workdir runs/tiny_cpu_bf16_nearest

Expected result (2 CPU cores, AMD EPYC Zen 4, 2026-11-23, ``python -m lpt.lab recipes`` at lr 1e-3, seed 0; the last
digits depend on the CPU): with --config.optim.lr=1e-3 validation loss 1.436, +2.24%
vs float32 (1.404) and Kahan (1.403); over the last fifth of the run 76% of the intended element updates are
cancelled (update/cancelled_fraction). At the default lr=3e-3 updates are many bf16 ulps and the rule matters less.
"""

from tiny_cpu import get_config as tiny_cpu_config


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "bfloat16"  # params stored in bf16
    c.precision.compute_dtype = "bfloat16"  # matmul inputs and activations in bf16
    c.precision.update_rule = "nearest"  # lpt.optim.nearest_rounding: what optax.apply_updates does to bf16
    return c
