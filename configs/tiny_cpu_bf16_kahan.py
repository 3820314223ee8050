"""tiny_cpu_bf16_kahan: bf16 params, bf16 compute, Kahan-compensated updates (Zamirai et al., Algorithm 1).

Command (it writes the files tiny_cpu.py lists, to its --workdir):

    python -m lpt.train --config configs/tiny_cpu_bf16_kahan.py --workdir runs/tiny_cpu_bf16_kahan

Optimizer: lpt.optim.kahan_adamw (bf16 params, bf16 moments stored by stochastic rounding, bf16 compensation: 8
bytes/param). At lr 1e-3 (--config.optim.lr=1e-3, ``python -m lpt.lab recipes``) it tracks float32 where round to
nearest falls behind; at the default 3e-3 the update rule matters less. Measured: docs/results.md, "Lab recipes with
the fixed-order δ and the guarded optimizer chain" and "Trainer runs and recipes".
"""

from tiny_cpu import get_config as tiny_cpu_config


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "bfloat16"  # params stored in bf16 (no f32 master copy)
    c.precision.compute_dtype = "bfloat16"  # matmul inputs and activations in bf16
    c.precision.update_rule = "kahan"  # lpt.optim.kahan_adamw: AdamW + Kahan, one fused transform
    return c
