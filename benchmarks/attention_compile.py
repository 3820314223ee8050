"""Deviceless compile sweep of flash attention forward+backward: the largest T that compiles per target.

    python benchmarks/attention_compile.py [--targets v5e h100] [--seq 8192 32768 131072] [--impl pallas]
        [--batch 1 --heads 8 --kv-heads 2 --head-dim 128] [--tile 512]

Compiles ``jax.grad`` of a sum through ``lpt.attention.dot_product_attention`` (bf16) for one chip of each target
with the real compilers (lpt.targets: libtpu's Mosaic for v5e, Triton + ptxas for H100) and prints, per (target, T),
ok or the error's first line, the compile seconds and XLA's HBM temp bytes, then the largest T that compiled.
``--tile N`` overrides the Mosaic tile (N x N) to probe VMEM headroom.
"""

from __future__ import annotations

import argparse
import time

from lpt import targets

TOPOLOGIES = {"v5e": "v5e:2x2", "h100": "h100:1x1x8"}


def compile_grad(target: str, t: int, impl: str, b: int, h: int, hkv: int, d: int):
    import jax
    import jax.numpy as jnp

    from lpt.attention import dot_product_attention

    sharding = jax.sharding.SingleDeviceSharding(targets.devices(TOPOLOGIES[target])[0])
    q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((b, t, hkv, d), jnp.bfloat16, sharding=sharding)

    def loss(q, k, v):
        return jnp.sum(dot_product_attention(q, k, v, impl=impl).astype(jnp.float32))  # bf16 -> f32

    start = time.perf_counter()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    return time.perf_counter() - start, compiled.memory_analysis().temp_size_in_bytes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=sorted(TOPOLOGIES), choices=sorted(TOPOLOGIES))
    parser.add_argument("--seq", nargs="+", type=int, default=[8192, 32768, 65536, 131072])
    parser.add_argument("--impl", default="pallas", choices=("pallas", "xla"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tile", type=int, default=None, help="Mosaic tile override (probe VMEM headroom)")
    args = parser.parse_args(argv)
    targets.compile_only_environment()
    if args.tile is not None:
        from lpt.kernels.flash_attention import tiles

        tiles._mosaic_tile = lambda t, block, cap: min(args.tile, t)

    shape = (args.batch, args.heads, args.kv_heads, args.head_dim)
    print(f"impl={args.impl} B, H, Hkv, D = {shape} bf16, forward+backward, one chip", flush=True)
    for target in args.targets:
        largest = None
        for t in sorted(args.seq):
            try:
                seconds, temp = compile_grad(target, t, args.impl, *shape)
            except Exception as err:  # report the compiler's verdict and go on
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                print(f"{target:5s} T={t:7d} FAIL {type(err).__name__}: {first[:300]}", flush=True)
                continue
            largest = t
            print(f"{target:5s} T={t:7d} ok   {seconds:6.1f} s  HBM temp {temp / 2**20:9.1f} MiB", flush=True)
        print(f"{target:5s} largest T that compiles: {largest}", flush=True)


if __name__ == "__main__":
    main()
