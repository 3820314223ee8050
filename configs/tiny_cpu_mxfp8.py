"""tiny_cpu_mxfp8: MXFP8 matmuls (TransformerEngine's MXFP8BlockScaling recipe: e4m3 with an e8m0 power-of-two scale
per 32 elements along each GEMM's contraction axis) in every block, float32 master weights, bf16 activations.

Command (it writes the files tiny_cpu.py lists, to its --workdir):

    python -m lpt.train --config configs/tiny_cpu_mxfp8.py --workdir runs/tiny_cpu_mxfp8

MXFP8 is emulated on the CPU (lpt.fp8.block_scaled_dot: dequantized blocks, f32 accumulation), so this run is slower
than tiny_cpu.py. The LM head stays bf16. Measured against the same model with bf16 matmuls: docs/results.md, "MXFP8
and NVFP4 matmuls on the tiny LM".
"""

from tiny_cpu import get_config as tiny_cpu_config


def get_config():
    c = tiny_cpu_config()
    c.precision.compute_dtype = "bfloat16"  # activations between matmuls in bf16
    c.precision.matmul.qkv = "mxfp8"  # q/k/v projections: forward, dX and dW GEMMs in MXFP8
    c.precision.matmul.out = "mxfp8"  # attention output projection
    c.precision.matmul.up = "mxfp8"  # MLP up/gate
    c.precision.matmul.down = "mxfp8"  # MLP down
    return c
