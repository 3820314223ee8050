"""GPU benchmark: lpt flash attention (the Pallas Triton kernel and the Mosaic GPU kernel of Hopper, stable and
standard policies; XLA twin) vs jax.nn.

Prints forward and forward+backward TFLOP/s per configuration and the ratio against the first of ``--variants``
measured in the same run (the baseline). The variants:

* ``jax``: ``jax.nn.dot_product_attention`` with its default implementation (XLA on most GPUs);
* ``cudnn``: the same with ``implementation="cudnn"`` (cuDNN's fused attention; reported as failed where cuDNN
  refuses the shapes);
* ``IMPL:POLICY``: ``lpt.attention.dot_product_attention(impl=IMPL, stable=POLICY == "stable")`` for IMPL in
  ``pallas`` (Triton), ``mosaic_gpu`` (the Hopper kernel), ``xla`` (the twin), ``auto``;
* ``mosaic_gpu_ws:POLICY``: the warp-specialized Mosaic GPU forward (:mod:`lpt.kernels.flash_attention.mosaic_gpu_ws`,
  block_k 64 for the stable policy, 128 for the standard one) with the Mosaic GPU backward, in a custom VJP as
  ``lpt.attention`` runs ``impl="mosaic_gpu"`` (the same transposes, residual and δ; no padding: T a multiple of
  128).

    python benchmarks/attention_gpu.py [--batch 4] [--seq 1024 2048] [--heads 16] [--kv-heads 4] [--head-dim 64] \
        [--variants cudnn mosaic_gpu:stable mosaic_gpu:standard]

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

VARIANTS = (
    "jax",
    "cudnn",
    "pallas:stable",
    "pallas:standard",
    "mosaic_gpu:stable",
    "mosaic_gpu:standard",
    "mosaic_gpu_ws:stable",
    "mosaic_gpu_ws:standard",
    "xla:stable",
    "auto:stable",
    "auto:standard",
)


def _mosaic_gpu_ws(causal: bool, stable: bool, interpret: bool):
    """Attention on [B, T, H, D] by the warp-specialized Mosaic GPU forward and the Mosaic GPU backward."""
    from lpt.attention.core import mosaic_gpu_block_k
    from lpt.kernels.flash_attention import math as fm
    from lpt.kernels.flash_attention import mosaic_gpu as mg
    from lpt.kernels.flash_attention import mosaic_gpu_ws as ws
    from lpt.kernels.flash_attention.options import FlashOptions

    policy = fm.default_policy() if stable else fm.standard_policy()
    fwd_block_k = ws.BLOCK_KS[0] if stable else ws.BLOCK_KS[-1]  # registers (stable) and shared memory (f32 O)
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # [B, T, H, D] <-> [B, H, T, D]

    def forward(q, k, v):
        q, k, v = map(heads_first, (q, k, v))
        kw = dict(causal=causal, scale=q.shape[3] ** -0.5, policy=policy, interpret=interpret)
        o32, lse = ws.forward(q, k, v, options=FlashOptions(block_k=fwd_block_k, **kw))
        out, o_res = fm.residual_and_output(o32, q.dtype, policy, None)
        return heads_first(out), (q, k, v, o_res, lse)

    def backward(res, do):
        q, k, v, o_res, lse = res
        do = heads_first(do)
        delta = jnp.sum(do.astype(jnp.float32) * o_res.astype(jnp.float32), axis=-1)  # bf16 / f32 -> f32
        bk = mosaic_gpu_block_k(q.shape[3], q.shape[2], k.shape[2])
        kw = dict(causal=causal, scale=q.shape[3] ** -0.5, interpret=interpret)
        grads = mg.backward(q, k, v, None, None, lse, do, delta, options=FlashOptions(block_k=bk, **kw))
        return tuple(heads_first(g.astype(x.dtype)) for g, x in zip(grads, (q, k, v), strict=True))  # f32 -> bf16

    attend = jax.custom_vjp(lambda q, k, v: forward(q, k, v)[0])
    attend.defvjp(forward, backward)
    return attend


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
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), help="the first is the baseline")
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

    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants {' '.join(unknown)}: unknown; choose from {' '.join(VARIANTS)}")
    variants = {}
    for name in args.variants:
        if name in ("jax", "cudnn"):
            variants[name] = jax_fn(None if name == "jax" else name)
        elif name.startswith("mosaic_gpu_ws:"):
            variants[name] = _mosaic_gpu_ws(causal, name.endswith(":stable"), args.interpret)
        else:  # mosaic_gpu is Hopper only: reported as failed elsewhere
            impl, policy = name.split(":")
            variants[name] = lpt_fn(impl, policy == "stable")
    print(
        f"device {jax.devices()[0].device_kind}; B={b} H={h} Hkv={hkv} D={d} causal={causal} bf16; "
        f"ratios against {args.variants[0]}"
    )
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
                print(f"T={t:6d} {name:20s} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            tf_f, tf_fb = flops / t_f / 1e12, 3.5 * flops / t_fb / 1e12
            if not base:
                base = {"f": tf_f, "fb": tf_fb}
                if name != args.variants[0]:
                    print(f"T={t:6d} the baseline {args.variants[0]} failed: ratios against {name}")
            print(
                f"T={t:6d} {name:20s} fwd {tf_f:7.2f} TFLOP/s ({tf_f / base['f']:5.2f}x)   "
                f"fwd+bwd {tf_fb:7.2f} TFLOP/s ({tf_fb / base['fb']:5.2f}x)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
