"""tiny_cpu_fp8: blockwise FP8 matmuls (DeepSeek-V3 Technical Report) in every block, float32 master weights.

Command (it writes the files tiny_cpu.py lists, to its --workdir):

    python -m lpt.train --config configs/tiny_cpu_fp8.py --workdir runs/tiny_cpu_fp8

4 KV heads instead of 2 (FP8 blocks need N = 128: a slightly larger model than tiny_cpu). FP8 is emulated on CPU
(float8_e4m3fn with 1x128 / 128x128 block scales, f32 accumulation promoted every 128 of K), so this run is slower
than tiny_cpu.py. The LM head stays bf16 (as in DeepSeek-V3). Measured: docs/results.md, "Lab recipes with the
fixed-order δ and the guarded optimizer chain".
"""

from tiny_cpu import get_config as tiny_cpu_config


def get_config():
    c = tiny_cpu_config()
    c.model.n_kv_heads = 4  # no GQA: k/v projections 128 wide (FP8 blocks need K, N multiples of 128)
    c.precision.compute_dtype = "bfloat16"  # activations between matmuls in bf16
    c.precision.matmul.qkv = "fp8"  # q/k/v projections in blockwise FP8
    c.precision.matmul.out = "fp8"  # attention output projection in FP8
    c.precision.matmul.up = "fp8"  # MLP up/gate in FP8
    c.precision.matmul.down = "fp8"  # MLP down in FP8
    return c
