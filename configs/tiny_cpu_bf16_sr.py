"""tiny_cpu_bf16_sr: bf16 params, bf16 compute, stochastic rounding of every update (Zamirai et al., Revisiting
BFloat16 Training).

Command (it writes the files tiny_cpu.py lists, to its --workdir):

    python -m lpt.train --config configs/tiny_cpu_bf16_sr.py --workdir runs/tiny_cpu_bf16_sr

Compared with the other recipes at --config.optim.lr=1e-3 (``python -m lpt.lab recipes``). Measured:
docs/results.md, "Lab recipes with the fixed-order δ and the guarded optimizer chain".
"""

from tiny_cpu import get_config as tiny_cpu_config


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "bfloat16"  # params stored in bf16
    c.precision.compute_dtype = "bfloat16"  # matmul inputs and activations in bf16
    c.precision.update_rule = "stochastic"  # lpt.optim.stochastic_rounding, key = fold_in(seed, step, leaf)
    return c
