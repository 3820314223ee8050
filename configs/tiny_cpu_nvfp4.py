"""tiny_cpu_nvfp4: NVFP4 matmuls (NVIDIA, Pretraining Large Language Models with NVFP4; TransformerEngine's
NVFP4BlockScaling recipe) in every block, float32 master weights, bf16 activations.

Command (it writes the files tiny_cpu.py lists, to its --workdir):

    python -m lpt.train --config configs/tiny_cpu_nvfp4.py --workdir runs/tiny_cpu_nvfp4

e2m1 values with an e4m3 scale per 16 elements and an f32 tensor scale; 16x16 weight tiles; the random Hadamard
transform of dW's inputs and stochastic rounding of dL/dy are on by default (precision.nvfp4_hadamard,
precision.nvfp4_stochastic_grads), as in NVIDIA's recipe; the LM head stays bf16. Emulated on a CPU (dequantized
blocks, f32 accumulation): slower than tiny_cpu.py. Measured: docs/results.md, "MXFP8 and NVFP4 matmuls on the tiny
LM".
"""

from tiny_cpu import get_config as tiny_cpu_config


def get_config():
    c = tiny_cpu_config()
    c.precision.compute_dtype = "bfloat16"  # activations between matmuls in bf16
    c.precision.matmul.qkv = "nvfp4"  # q/k/v projections: forward, dX and dW GEMMs in NVFP4
    c.precision.matmul.out = "nvfp4"  # attention output projection
    c.precision.matmul.up = "nvfp4"  # MLP up/gate
    c.precision.matmul.down = "nvfp4"  # MLP down
    return c
