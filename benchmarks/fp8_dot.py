"""Benchmark: the XLA path of ``lpt.fp8.blockwise_dot`` on CPU, relative to a plain bf16 ``jnp.dot``.

Run: ``python benchmarks/fp8_dot.py [--m 1024 --k 2048 --n 2048 --reps 5]``. Prints median wall times and ratios
against the bf16 ``jnp.dot`` of the same shape measured in the same run, with quantization (1x128 tiles of x plus
128x128 blocks of w) timed separately from the promoted-accumulation GEMM on already quantized operands. CPU
numbers say nothing about GPU FP8 speed; they bound the cost of using the XLA path for CPU tests and research.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from lpt.fp8 import blockwise_dot, quantize_blocks, quantize_tiles
from lpt.kernels.fp8_blockwise_matmul.kernel import fp8_blockwise_matmul_reference
from lpt.train.machine import describe


def median_time(f, *args, reps: int) -> float:
    jax.block_until_ready(f(*args))  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=1024, help="tokens")
    p.add_argument("--k", type=int, default=2048, help="contracting dim (multiple of 128)")
    p.add_argument("--n", type=int, default=2048, help="output features (multiple of 128)")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((a.m, a.k)).astype(np.float32))
    w = jnp.asarray((rng.standard_normal((a.k, a.n)) / np.sqrt(a.k)).astype(np.float32))
    x_bf, w_bf = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)  # f32 -> bf16 baseline operands

    bf16_dot = jax.jit(lambda x, w: jnp.dot(x, w))
    f32_dot = jax.jit(lambda x, w: jnp.dot(x, w))

    @jax.jit
    def quantize(x, w):
        return quantize_tiles(x), quantize_blocks(w)

    (qx, sx), (qw, sw) = quantize(x, w)
    sw_cols = jnp.repeat(sw, 128, axis=1)
    gemm = jax.jit(fp8_blockwise_matmul_reference)
    fwd = jax.jit(blockwise_dot)
    g = jnp.asarray(rng.standard_normal((a.m, a.n)).astype(np.float32))  # a non-constant output gradient
    g_bf = g.astype(jnp.bfloat16)  # f32 -> bf16

    def fwd_bwd_of(dot):
        def run(x, w, g):
            y, vjp = jax.vjp(dot, x, w)
            return y, vjp(g)

        return jax.jit(run)

    fwd_bwd = fwd_bwd_of(blockwise_dot)
    bf16_fwd_bwd = fwd_bwd_of(jnp.dot)

    t_bf16 = median_time(bf16_dot, x_bf, w_bf, reps=a.reps)
    rows = [
        ("bf16 jnp.dot (baseline)", t_bf16),
        ("f32 jnp.dot", median_time(f32_dot, x, w, reps=a.reps)),
        ("quantize x (1x128) + w (128x128)", median_time(quantize, x, w, reps=a.reps)),
        ("FP8 GEMM only (scan over K/128 chunks)", median_time(gemm, qx, sx, qw, sw_cols, reps=a.reps)),
        ("blockwise_dot forward (quantize + GEMM)", median_time(fwd, x, w, reps=a.reps)),
    ]
    t_bf16_fb = median_time(bf16_fwd_bwd, x_bf, w_bf, g_bf, reps=a.reps)
    t_fb = median_time(fwd_bwd, x, w, g, reps=a.reps)
    print(f"shape x[{a.m}, {a.k}] @ w[{a.k}, {a.n}], backend {jax.default_backend()}, median of {a.reps}")
    print(f"machine: {describe()}")
    print(f"{'what':44s} {'ms':>9s} {'x bf16 dot':>11s}")
    for name, t in rows:
        print(f"{name:44s} {t * 1e3:9.2f} {t / t_bf16:11.2f}")
    print(f"{'bf16 fwd+bwd (baseline for the next row)':44s} {t_bf16_fb * 1e3:9.2f} {t_bf16_fb / t_bf16:11.2f}")
    print(f"{'blockwise_dot fwd+bwd (3 FP8 GEMMs)':44s} {t_fb * 1e3:9.2f} {t_fb / t_bf16:11.2f}")
    print(f"fwd+bwd ratio blockwise / bf16: {t_fb / t_bf16_fb:.2f}")


if __name__ == "__main__":
    main()
