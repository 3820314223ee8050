"""GPU benchmark: the blockwise FP8 GEMM kernels against a bf16 GEMM measured in the same run.

    python benchmarks/fp8_gpu.py [--sizes 4096 8192] [--iters 20]

Per square size M = K = N, TFLOP/s (2·M·K·N per GEMM) and the ratio against ``jnp.dot`` of bf16 operands with f32
accumulation (cuBLAS) of:

* ``fp8 per-tensor``: ``jnp.dot`` of e4m3 operands (XLA's cuBLAS FP8 GEMM, no block scales): the ceiling of an FP8
  GEMM on this GPU;
* ``twin``: ``fp8_blockwise_matmul_reference``, the XLA program of the promoted blockwise sum;
* ``triton``: the Pallas kernel ``fp8_blockwise_matmul`` (Triton);
* ``mosaic_gpu``: the Hopper kernel ``fp8_blockwise_matmul_mgpu`` (TMA + wgmma), on compute capability 9.0 only;

all on already quantized operands (1×128 tiles of a, 128×128 blocks of b); and the whole differentiable layer
(``blockwise_dot``: quantization, forward, dX and dW) per impl against ``jnp.dot`` in bf16 forward + backward,
``default`` being what the trainer's FP8 recipe runs (``precision.fp8_impl="auto"``), each row naming its GEMM
implementation and its output gradients' format.
Each time is the median of ``--iters`` calls after a warm-up call (compilation). On a machine without a GPU it says
so and exits 0.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from fp8_dot import median_time  # benchmarks/ is the script's directory, first on sys.path

from lpt.fp8 import blockwise_dot, quantize_blocks, quantize_tiles
from lpt.fp8.blockwise import wgmma_takes
from lpt.kernels.fp8_blockwise_matmul.kernel import fp8_blockwise_matmul, fp8_blockwise_matmul_reference
from lpt.kernels.fp8_blockwise_matmul.mosaic_gpu import fp8_blockwise_matmul_mgpu
from lpt.models.config import Precision


def _row(name, seconds, flops, base):
    ratio = "" if base is None else f"{base / seconds:7.2f}x"
    print(f"  {name:44s} {seconds * 1e3:9.3f} ms {flops / seconds / 1e12:8.1f} TFLOP/s {ratio}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        print(f"no GPU found (devices: {[d.platform for d in jax.devices()]}); this benchmark needs one. Exiting.")
        return 0
    hopper = float(getattr(dev, "compute_capability", "0")) >= 9.0
    print(f"device: {dev.device_kind}; jax {jax.__version__}; speed-up columns: bf16 time / row time")
    for s in args.sizes:
        kx, kw, kg = jax.random.split(jax.random.key(s), 3)
        x = jax.random.normal(kx, (s, s), jnp.float32)
        w = jax.random.normal(kw, (s, s), jnp.float32) / 64
        g = jax.random.normal(kg, (s, s), jnp.float32)
        xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)  # f32 -> bf16
        a, sa = jax.jit(quantize_tiles)(x)
        b, sb = jax.jit(quantize_blocks)(w)
        sb_cols = jnp.repeat(sb, 128, axis=1)  # [K/128, N/128] -> [K/128, N]: the kernels' per-column scales
        flops = 2.0 * s**3
        print(f"M = K = N = {s}: one GEMM")
        bf16 = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
        base = median_time(bf16, xb, wb, reps=args.iters)
        _row("bf16 jnp.dot", base, flops, None)
        fp8 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        _row("fp8 per-tensor jnp.dot", median_time(fp8, a, b.astype(jnp.float8_e4m3fn), reps=args.iters), flops, base)
        kernels = {"twin (XLA)": fp8_blockwise_matmul_reference, "triton": fp8_blockwise_matmul}
        if hopper:
            kernels["mosaic_gpu"] = fp8_blockwise_matmul_mgpu
        for name, kernel in kernels.items():
            try:
                _row(name, median_time(jax.jit(kernel), a, sa, b, sb_cols, reps=args.iters), flops, base)
            except Exception as e:  # noqa: BLE001 - one failing kernel must not hide the others' numbers
                print(f"  {name:28s} failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        print(f"M = K = N = {s}: forward + dX + dW (3 GEMMs)")

        def layer(dot, x, w, g):  # g an argument: a constant cotangent would be quantized by constant folding
            y, vjp = jax.vjp(dot, x, w)
            return y, vjp(g.astype(y.dtype))

        plain = jax.jit(functools.partial(layer, lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)))
        base3 = median_time(plain, xb, wb, g, reps=args.iters)
        _row("bf16 jnp.dot", base3, 3 * flops, None)
        impls = {"default": Precision().fp8_options(), "xla": {"impl": "xla"}, "pallas": {"impl": "pallas"}}
        if hopper:  # e4m3 gradients where the installed jax's wgmma cannot mix e4m3 and e5m2
            mix = wgmma_takes(jnp.float8_e4m3fn, jnp.float8_e5m2)
            impls["mosaic_gpu"] = {"impl": "mosaic_gpu", **({} if mix else {"grad_dtype": jnp.float8_e4m3fn})}
        for impl, options in impls.items():
            dot = functools.partial(blockwise_dot, **options)
            named = f"{impl} ({options['impl']}, {jnp.dtype(options.get('grad_dtype', jnp.float8_e5m2)).name})"
            try:
                _row(
                    f"blockwise_dot {named}",
                    median_time(jax.jit(functools.partial(layer, dot)), x, w, g, reps=args.iters),
                    3 * flops,
                    base3,
                )
            except Exception as e:  # noqa: BLE001
                print(f"  blockwise_dot {named} failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
