"""tiny_cpu_bf16_sr: bf16 params, bf16 compute, stochastic rounding of every update (Zamirai et al., Revisiting
BFloat16 Training).

Command:

    python -m lpt.train --config configs/tiny_cpu_bf16_sr.py --workdir runs/tiny_cpu_bf16_sr

Expected result (2 CPU cores, AMD EPYC Zen 4, 2026-11-22; the last digits depend on the CPU): validation loss 1.4038
at the default lr=3e-3 (float32: 1.3860, +1.3%, within the ±1% scatter of single bf16 runs); with
--config.optim.lr=1e-3: 1.4050 (float32 1.4043, +0.05%).
"""

from tiny_cpu import get_config as tiny_cpu_config

EXPECTED = {"eval_loss": 1.4038, "eval_loss_lr1e-3": 1.4050}


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "bfloat16"  # params stored in bf16
    c.precision.compute_dtype = "bfloat16"  # matmul inputs and activations in bf16
    c.precision.update_rule = "stochastic"  # lpt.optim.stochastic_rounding, key = fold_in(seed, step, leaf)
    return c
