"""tiny_cpu_nvfp4: NVFP4 matmuls (NVIDIA, Pretraining Large Language Models with NVFP4; TransformerEngine's
NVFP4BlockScaling recipe) in every block, float32 master weights, bf16 activations.

e2m1 values with an e4m3 scale per 16 elements and an f32 tensor scale; 16x16 weight tiles; a random Hadamard
transform of the weight-gradient GEMM's inputs (precision.nvfp4_hadamard) and stochastic rounding of the output
gradient (precision.nvfp4_stochastic_grads), both on as in NVIDIA's recipe; the LM head stays bf16.

Command:

    python -m lpt.train --config configs/tiny_cpu_nvfp4.py --workdir runs/tiny_cpu_nvfp4

Expected result (2 CPU cores, Intel Xeon with AVX-512, 2026-11-26, seed 0; the last digits depend on the CPU):
validation loss 1.4377 after 600 steps, +1.94% vs the same model with bf16 matmuls (1.4103); over seeds 0-2 +2.85%
on average, and +1.83% with both switches off (--config.precision.nvfp4_hadamard=false
--config.precision.nvfp4_stochastic_grads=false), a difference inside the seed-to-seed scatter at this scale. NVFP4
is emulated on the CPU (lpt.fp8.block_scaled_dot: dequantized blocks, f32 accumulation), so this run is slower than
tiny_cpu.py. See docs/results.md ("MXFP8 and NVFP4 matmuls on the tiny LM").
"""

from tiny_cpu import get_config as tiny_cpu_config


def get_config():
    c = tiny_cpu_config()
    c.precision.compute_dtype = "bfloat16"  # activations between matmuls in bf16
    c.precision.matmul.qkv = "nvfp4"  # q/k/v projections: forward, dX and dW GEMMs in NVFP4
    c.precision.matmul.out = "nvfp4"  # attention output projection
    c.precision.matmul.up = "nvfp4"  # MLP up/gate
    c.precision.matmul.down = "nvfp4"  # MLP down
    c.precision.nvfp4_hadamard = True  # random 16x16 Hadamard transform of dW's inputs along the tokens
    c.precision.nvfp4_stochastic_grads = True  # stochastic rounding of dL/dy in dX and dW
    return c
