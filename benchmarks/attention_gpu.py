"""GPU benchmark: lpt flash attention (the Pallas Triton kernel and the Mosaic GPU kernel of Hopper, stable and
standard policies; XLA twin) vs jax.nn.

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
        interpret = True if args.interpret and impl in ("pallas", "mosaic_gpu") else None  # None: compiled
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
        "lpt mosaic_gpu stable": lpt_fn("mosaic_gpu", True),  # Hopper only: reported as failed elsewhere
        "lpt mosaic_gpu standard": lpt_fn("mosaic_gpu", False),
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
