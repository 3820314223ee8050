"""Overhead of GaussWS / DiffQ linear layers vs a plain bf16 linear layer, measured in the same run (CPU).

    .venv/bin/python benchmarks/pqt_overhead.py [--tokens 1024] [--d-in 1024] [--d-out 1024] [--reps 20]

Prints, for one linear layer y = x @ W (bf16 GEMM, f32 accumulation):
  * forward and forward+backward (grads w.r.t. x, W and b_t) time of plain bf16, GaussWS and DiffQ, and the
    ratios to plain bf16;
  * the noise generators alone per element (rounded_normal, symmetric_uniform, jax.random.normal in bf16);
  * whether Ahn & Yoo's packed 4-bit R (8 codes per uint32) would pay here: unpacking a stored R vs regenerating
    it from the key, as the backward does.
Timings are medians over ``--reps`` runs after a warm-up; ratios are what to compare across machines.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import lpt.pqt as pqt
from lpt.pqt.gaussws import pqn_sample
from lpt.train.machine import describe


def timed(f, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0


def bench(f, *args, reps: int) -> float:
    """Median wall time (s) of the jitted ``f(*args)``."""
    jax.block_until_ready(f(*args))
    return statistics.median(timed(f, *args) for _ in range(reps))


def bench_round_robin(fns: dict, args, reps: int) -> dict:
    """Median time per function and median per-round ratio to the first one (robust to load drift)."""
    for f in fns.values():
        jax.block_until_ready(f(*args))
    rounds = [{name: timed(f, *args) for name, f in fns.items()} for _ in range(reps)]
    base = next(iter(fns))
    return {
        name: (statistics.median(r[name] for r in rounds), statistics.median(r[name] / r[base] for r in rounds))
        for name in fns
    }


def linear(x, w_c):
    return jnp.dot(x.astype(jnp.bfloat16), w_c, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def make_steps(method):
    def weight(w, bt, key):
        if method == "bf16":
            return w.astype(jnp.bfloat16)  # f32 -> bf16
        return pqn_sample(w, bt, key, method=method)

    def fwd(x, w, bt, key):
        return linear(x, weight(w, bt, key))

    def loss(x, w, bt, key):
        return jnp.sum(fwd(x, w, bt, key).astype(jnp.float32) ** 2)  # bf16 -> f32

    return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def pack4(r_bf16):
    """Ahn & Yoo's storage: 4-bit sign-magnitude codes (sign << 3 | |R|), 8 per uint32."""
    r = r_bf16.astype(jnp.float32).reshape(-1, 8)  # bf16 -> f32 exact
    code = (jnp.abs(r).astype(jnp.uint32) | jnp.where(r < 0, jnp.uint32(8), jnp.uint32(0))).astype(jnp.uint32)
    shifts = jnp.arange(8, dtype=jnp.uint32) * 4
    return jnp.bitwise_or.reduce(code << shifts, axis=1)


def unpack4(packed, shape):
    shifts = jnp.arange(8, dtype=jnp.uint32) * 4
    code = (packed[:, None] >> shifts) & jnp.uint32(0xF)
    mag = (code & jnp.uint32(7)).astype(jnp.float32)  # uint32 -> f32 exact
    r = jnp.where((code & jnp.uint32(8)) != 0, -mag, mag)
    return r.astype(jnp.bfloat16).reshape(shape)  # f32 -> bf16 exact


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--d-in", type=int, default=1024)
    ap.add_argument("--d-out", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--key-impl", default="threefry2x32", help="PRNG impl: threefry2x32 (JAX default) or rbg")
    args = ap.parse_args()
    t, k, n = args.tokens, args.d_in, args.d_out
    key = jax.random.key(0, impl=args.key_impl)
    kx, kw, kr = jax.random.split(key, 3)
    x = jax.random.normal(kx, (t, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.02
    bt = jnp.full(pqt.block_grid(w.shape), 6.0)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.device_count()}, key {args.key_impl}")
    print(f"machine: {describe()}")
    print(f"linear layer: x[{t}, {k}] @ W[{k}, {n}], bf16 GEMM with f32 accumulation, median of {args.reps}")

    steps = {m: make_steps(m) for m in ("bf16", "gaussws", "diffq")}
    fwd = bench_round_robin({m: s[0] for m, s in steps.items()}, (x, w, bt, kr), args.reps)
    fwd_bwd = bench_round_robin({m: s[1] for m, s in steps.items()}, (x, w, bt, kr), args.reps)
    print("median time and median per-round ratio to plain bf16 (methods interleaved round by round)")
    print(f"{'method':10s} {'fwd ms':>9s} {'ratio':>7s} {'fwd+bwd ms':>11s} {'ratio':>7s}")
    for m in steps:
        print(f"{m:10s} {fwd[m][0] * 1e3:9.3f} {fwd[m][1]:7.3f} {fwd_bwd[m][0] * 1e3:11.3f} {fwd_bwd[m][1]:7.3f}")

    shape = (k, n)
    gens = {
        "rounded_normal (bits, Eq. 10)": jax.jit(lambda kk: pqt.rounded_normal(kk, shape)),
        "symmetric_uniform (DiffQ)": jax.jit(lambda kk: pqt.symmetric_uniform(kk, shape)),
        "jax.random.normal bf16": jax.jit(lambda kk: jax.random.normal(kk, shape, jnp.bfloat16)),
    }
    print(f"noise generation alone, {k * n} elements:")
    for name, f in gens.items():
        tg = bench(f, kr, reps=args.reps)
        print(f"  {name:32s} {tg * 1e9 / (k * n):7.3f} ns/element")

    r = pqt.rounded_normal(kr, shape)
    packed = jax.jit(pack4)(r)
    assert bool(jnp.all(jax.jit(unpack4, static_argnums=1)(packed, shape) == r)), "pack/unpack round trip failed"
    regen = bench(jax.jit(lambda kk: pqt.rounded_normal(kk, shape)), kr, reps=args.reps)
    unpk = bench(jax.jit(unpack4, static_argnums=1), packed, shape, reps=args.reps)
    print(
        f"packed 4-bit R: unpack {unpk * 1e3:.3f} ms vs regenerate {regen * 1e3:.3f} ms "
        f"(ratio {unpk / regen:.2f}); storing it would cost {packed.nbytes / 2**20:.2f} MiB per layer"
    )


if __name__ == "__main__":
    main()
