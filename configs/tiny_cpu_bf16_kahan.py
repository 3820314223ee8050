"""tiny_cpu_bf16_kahan: bf16 params, bf16 compute, Kahan-compensated updates (seed 000, Algorithm 1).

Command:

    python -m lpt.train --config configs/tiny_cpu_bf16_kahan.py --workdir runs/tiny_cpu_bf16_kahan

Expected result (2 CPU cores): validation loss 1.4038 with --config.optim.lr=1e-3, -0.03% vs the float32
run's 1.4043 (bf16+nearest: 1.4372, +2.35%). At the default lr=3e-3 the update rule hardly matters (updates are
many bf16 ulps): 1.4136 vs 1.3955, +1.3%, within the spread of the bf16 recipes (nearest +0.7%, SR -0.5%).
"""

from tiny_cpu import get_config as tiny_cpu_config

EXPECTED = {"eval_loss": 1.4136, "eval_loss_lr1e-3": 1.4038}


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "bfloat16"  # params stored in bf16 (no f32 master copy)
    c.precision.compute_dtype = "bfloat16"  # matmul inputs and activations in bf16
    c.precision.update_rule = "kahan"  # lpt.optim.kahan_adamw: AdamW + Kahan, one fused transform
    return c
