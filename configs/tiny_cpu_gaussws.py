"""tiny_cpu_gaussws: Gaussian weight sampling (Ahn & Yoo), learnable per-block bitwidth, every block matmul.

Command:

    python -m lpt.train --config configs/tiny_cpu_gaussws.py --workdir runs/tiny_cpu_gaussws

Expected result (2 CPU cores, AMD EPYC Zen 4, 2026-11-23, ``python -m lpt.lab recipes`` at lr 1e-3, seed 0; the last
digits depend on the CPU): with --config.optim.lr=1e-3 validation loss 1.416, +0.83% vs float32 (1.404), at 1.11x
the float32 step time. The learned bitwidths fall from b_init = 6 towards b_target = 4
(logged as model/pqt/bt_mean).

Each training forward pass uses w + R * blockmax(|w|) * 2^(1-b_t), R ~ round(N(0,1)/2) from random bits; b_t is
learned and pulled towards b_target. Logged: aux_loss, model/pqt/*. Evaluation uses the noiseless weights.
"""

from tiny_cpu import get_config as tiny_cpu_config


def get_config():
    c = tiny_cpu_config()  # float32 params and compute (the noise models the low-precision weights)
    c.precision.pqt.method = "gaussws"  # pseudo-quantisation noise by Gaussian weight sampling
    c.precision.pqt.layers = ("qkv", "out", "up", "down")  # every matmul inside the blocks
    c.precision.pqt.loss_weight = 1e-3  # weight of the bitwidth loss
    return c
