"""tiny_cpu_gaussws: Gaussian weight sampling (Ahn & Yoo), learnable per-block bitwidth, every block matmul.

Command (it writes the files tiny_cpu.py lists, to its --workdir):

    python -m lpt.train --config configs/tiny_cpu_gaussws.py --workdir runs/tiny_cpu_gaussws

Each training forward pass uses w + R * blockmax(|w|) * 2^(1-b_t), R ~ round(N(0,1)/2) from random bits; b_t is
learned from b_init = 6 and pulled towards b_target = 4. Logged: aux_loss, model/pqt/* (model/pqt/bt_mean: the mean
bitwidth). Evaluation uses the noiseless weights. Measured: docs/results.md, "Lab recipes with the fixed-order δ and
the guarded optimizer chain".
"""

from tiny_cpu import get_config as tiny_cpu_config


def get_config():
    c = tiny_cpu_config()  # float32 params and compute (the noise models the low-precision weights)
    c.precision.pqt.method = "gaussws"  # pseudo-quantisation noise by Gaussian weight sampling
    c.precision.pqt.layers = ("qkv", "out", "up", "down")  # every matmul inside the blocks
    c.precision.pqt.loss_weight = 1e-3  # weight of the bitwidth loss
    return c
