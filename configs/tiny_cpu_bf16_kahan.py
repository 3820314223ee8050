"""tiny_cpu_bf16_kahan: bf16 params, bf16 compute, Kahan-compensated updates (Zamirai et al., Algorithm 1).

Command:

    python -m lpt.train --config configs/tiny_cpu_bf16_kahan.py --workdir runs/tiny_cpu_bf16_kahan

Expected result (2 CPU cores, AMD EPYC Zen 4, 2026-11-22; the last digits depend on the CPU): validation loss 1.4024
with --config.optim.lr=1e-3, -0.13% vs the float32 run's 1.4043 (bf16+nearest: 1.4355, +2.23%). At the default
lr=3e-3 the update rule hardly matters (updates are many bf16 ulps): 1.4077 vs 1.3860, +1.6%, within the ±1% scatter
of single bf16 runs (seeds 0-5: 1.3624-1.4077; f32 master weights with bf16 compute: 1.4177). Optimizer:
lpt.optim.kahan_adamw (bf16 params, bf16 moments stored by stochastic rounding, bf16 compensation: 8 bytes/param).
"""

from tiny_cpu import get_config as tiny_cpu_config

EXPECTED = {"eval_loss": 1.4077, "eval_loss_lr1e-3": 1.4024}


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "bfloat16"  # params stored in bf16 (no f32 master copy)
    c.precision.compute_dtype = "bfloat16"  # matmul inputs and activations in bf16
    c.precision.update_rule = "kahan"  # lpt.optim.kahan_adamw: AdamW + Kahan, one fused transform
    return c
