"""tiny_cpu_bf16_nearest: bf16 params updated with plain round-to-nearest (the nearest-rounding floor of Zamirai et
al., Revisiting BFloat16 Training).

Command (it writes the files tiny_cpu.py lists, to its --workdir):

    python -m lpt.train --config configs/tiny_cpu_bf16_nearest.py --workdir runs/tiny_cpu_bf16_nearest

At lr 1e-3 (--config.optim.lr=1e-3, ``python -m lpt.lab recipes``) most late updates are cancelled (logged as
update/cancelled_fraction) and the run ends above float32 and Kahan; at the default 3e-3 the rule matters less.
Measured: docs/results.md, "Lab recipes with the fixed-order δ and the guarded optimizer chain".
"""

from tiny_cpu import get_config as tiny_cpu_config


def get_config():
    c = tiny_cpu_config()
    c.precision.param_dtype = "bfloat16"  # params stored in bf16
    c.precision.compute_dtype = "bfloat16"  # matmul inputs and activations in bf16
    c.precision.update_rule = "nearest"  # lpt.optim.nearest_rounding: what optax.apply_updates does to bf16
    return c
