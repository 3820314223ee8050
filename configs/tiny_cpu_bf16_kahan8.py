"""tiny_cpu_bf16_kahan8: bf16 params and compute, Kahan-compensated updates, Adam moments in 8 bits (6 bytes/param).

Command (it writes the files tiny_cpu.py lists, to its --workdir):

    python -m lpt.train --config configs/tiny_cpu_bf16_kahan8.py --workdir runs/tiny_cpu_bf16_kahan8

Optimizer: lpt.optim.kahan_adamw with moment_dtype="float8_e4m3fn": m and sqrt(v) as e4m3 codes with an f32 scale
per 128 elements of a row, requantized by stochastic rounding (lpt.optim.moments8); bf16 compensation.
``python -m lpt.lab states`` compares it over three seeds. Measured: docs/results.md, "Adam moments in 8 bits with a
block scale".
"""

from tiny_cpu_bf16_kahan import get_config as kahan_config


def get_config():
    c = kahan_config()
    c.precision.moment_dtype = "float8_e4m3fn"  # 8-bit Adam moments with a block scale
    return c
