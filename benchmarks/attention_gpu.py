"""GPU benchmark: lpt flash attention (Pallas kernel, stable and standard policies; XLA twin; the Mosaic GPU forward
on Hopper) vs jax.nn.

Prints forward and forward+backward TFLOP/s per configuration and the ratio against
``jax.nn.dot_product_attention`` with its default implementation (the baseline) measured in the same run, and
the same call with ``implementation="cudnn"`` (cuDNN's fused attention; reported as failed where cuDNN refuses).

    python benchmarks/attention_gpu.py [--batch 4] [--seq 1024 2048] [--heads 16] [--kv-heads 4] [--head-dim 64]

On a machine without a GPU it says so and exits 0; ``--interpret`` instead runs the Pallas variants in interpret
mode on any backend (a smoke test of this script, e.g. ``--interpret --seq 128 --batch 1 --iters 1``: the numbers
are meaningless there). FLOPs counted: forward 4·B·H·T²·D (halved if causal),
forward+backward 3.5× that (FA2 convention: 2 forward matmuls, 5 backward matmuls).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp


def _time(fn, *args, iters: int) -> float:
    out = fn(*args)
    jax.block_until_ready(out)  # compile + warm up
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode: smoke-test without a GPU")
    args = parser.parse_args()

    if not args.interpret and not any(d.platform == "gpu" for d in jax.devices()):
        print(f"no GPU found (devices: {[d.platform for d in jax.devices()]}); this benchmark needs one. Exiting.")
        return 0

    from lpt.attention import dot_product_attention

    causal = bool(args.causal)
    b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim

    def lpt_fn(impl, stable):
        interpret = True if args.interpret and impl == "pallas" else None  # None: Triton on the GPU
        return lambda q, k, v: dot_product_attention(
            q, k, v, causal=causal, stable=stable, impl=impl, interpret=interpret
        )

    def jax_fn(implementation=None):
        def attend(q, k, v):
            g = h // hkv
            k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)

        return attend

    variants = {
        "jax.nn (baseline)": jax_fn(),
        "jax.nn cudnn": jax_fn("cudnn"),
        "lpt pallas stable": lpt_fn("pallas", True),
        "lpt pallas standard": lpt_fn("pallas", False),
        "lpt xla stable": lpt_fn("xla", True),
    }
    print(f"device {jax.devices()[0].device_kind}; B={b} H={h} Hkv={hkv} D={d} causal={causal} bf16")
    for t in args.seq:
        keys = jax.random.split(jax.random.PRNGKey(t), 3)
        q = jax.random.normal(keys[0], (b, t, h, d), jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, t, hkv, d), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, t, hkv, d), jnp.bfloat16)
        flops = 4.0 * b * h * t * t * d * (0.5 if causal else 1.0)
        base = {}
        for name, fn in variants.items():
            fwd = jax.jit(fn)
            loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32))
            fwdbwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            try:
                t_f = _time(fwd, q, k, v, iters=args.iters)
                t_fb = _time(fwdbwd, q, k, v, iters=args.iters)
            except Exception as e:  # report and continue with the other variants
                print(f"T={t:6d} {name:22s} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            tf_f, tf_fb = flops / t_f / 1e12, 3.5 * flops / t_fb / 1e12
            if not base:
                base = {"f": tf_f, "fb": tf_fb}
            print(
                f"T={t:6d} {name:22s} fwd {tf_f:7.2f} TFLOP/s ({tf_f / base['f']:5.2f}x)   "
                f"fwd+bwd {tf_fb:7.2f} TFLOP/s ({tf_fb / base['fb']:5.2f}x)"
            )
        if base and not args.interpret:
            _mosaic_gpu_forward(q, k, v, causal, flops, base["f"], args.iters, t)
    return 0


def _mosaic_gpu_forward(q, k, v, causal: bool, flops: float, base: float, iters: int, t: int) -> None:
    """Forward rows of the Mosaic GPU kernel (:mod:`lpt.kernels.flash_attention.mosaic_gpu`, Hopper only; no
    backward yet), called on [B, H, T, D] inputs transposed outside the timed call, per policy and key block."""
    from lpt.kernels.flash_attention import math as fm
    from lpt.kernels.flash_attention import mosaic_gpu

    qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    d = q.shape[-1]
    for stable in (True, False):
        policy = fm.default_policy() if stable else fm.standard_policy()
        for block_k in mosaic_gpu.BLOCK_KS:
            name = f"lpt mgpu {'stable' if stable else 'standard'} bk{block_k}"
            fwd = jax.jit(
                lambda q, k, v, policy=policy, block_k=block_k: mosaic_gpu.forward(
                    q, k, v, policy=policy, causal=causal, scale=d**-0.5, block_k=block_k
                )[0]
            )
            try:
                t_f = _time(fwd, qt, kt, vt, iters=iters)
            except Exception as e:  # Hopper only; a head dim or block that does not fit is reported
                print(f"T={t:6d} {name:22s} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            tf_f = flops / t_f / 1e12
            print(f"T={t:6d} {name:22s} fwd {tf_f:7.2f} TFLOP/s ({tf_f / base:5.2f}x)   fwd+bwd (no backward yet)")


if __name__ == "__main__":
    sys.exit(main())
