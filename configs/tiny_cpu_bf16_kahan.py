"""tiny_cpu_bf16_kahan: bf16 params, bf16 compute, Kahan-compensated updates (Zamirai et al., Algorithm 1).

Command:

    python -m lpt.train --config configs/tiny_cpu_bf16_kahan.py --workdir runs/tiny_cpu_bf16_kahan

Expected result (2 CPU cores, AMD EPYC Zen 4, 2026-11-23, ``python -m lpt.lab recipes`` at lr 1e-3, seed 0; the last
digits depend on the CPU): with --config.optim.lr=1e-3 validation loss 1.403, -0.08%
vs the float32 run's 1.404 (bf16 + nearest: 1.436, +2.24%). At the default lr=3e-3 updates are many bf16 ulps and
the update rule matters less (single bf16 runs scatter by about ±1%). Optimizer: lpt.optim.kahan_adamw (bf16 params,
bf16 moments stored by stochastic rounding, bf16 compensation: 8 bytes/param).
"""

from tiny_cpu import get_config as tiny_cpu_config


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "bfloat16"  # params stored in bf16 (no f32 master copy)
    c.precision.compute_dtype = "bfloat16"  # matmul inputs and activations in bf16
    c.precision.update_rule = "kahan"  # lpt.optim.kahan_adamw: AdamW + Kahan, one fused transform
    return c
