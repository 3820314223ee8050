"""tiny_cpu_bf16_sr: bf16 params, bf16 compute, stochastic rounding of every update (Zamirai et al., Revisiting
BFloat16 Training).

Command:

    python -m lpt.train --config configs/tiny_cpu_bf16_sr.py --workdir runs/tiny_cpu_bf16_sr

Expected result (2 CPU cores, AMD EPYC Zen 4, 2026-11-23, ``python -m lpt.lab recipes`` at lr 1e-3, seed 0; the last
digits depend on the CPU): with --config.optim.lr=1e-3 validation loss 1.414, +0.70%
vs float32 (1.404), inside the ±1% scatter of single bf16 runs (bf16 + nearest: 1.436, +2.24%).
"""

from tiny_cpu import get_config as tiny_cpu_config


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "bfloat16"  # params stored in bf16
    c.precision.compute_dtype = "bfloat16"  # matmul inputs and activations in bf16
    c.precision.update_rule = "stochastic"  # lpt.optim.stochastic_rounding, key = fold_in(seed, step, leaf)
    return c
