"""tiny_cpu_bf16_kahan8: bf16 params and compute, Kahan-compensated updates, Adam moments in 8 bits (6 bytes/param).

Command:

    python -m lpt.train --config configs/tiny_cpu_bf16_kahan8.py --workdir runs/tiny_cpu_bf16_kahan8

Expected result (2 CPU cores, Intel Xeon Sapphire Rapids, 2026-11-26; the last digits depend on the CPU): with
--config.optim.lr=1e-3, seed 0, validation loss 1.403 against the float32 run's 1.404 and 1.403 with bf16 moments
(``python -m lpt.lab states`` gives three seeds).
Optimizer: lpt.optim.kahan_adamw with moment_dtype="float8_e4m3fn": m and sqrt(v) as e4m3 codes with an f32 scale
per 128 elements of a row, requantized by stochastic rounding (lpt.optim.moments8); bf16 compensation.
"""

from tiny_cpu_bf16_kahan import get_config as kahan_config


def get_config():
    c = kahan_config()
    c.precision.moment_dtype = "float8_e4m3fn"  # 8-bit Adam moments with a block scale
    return c
