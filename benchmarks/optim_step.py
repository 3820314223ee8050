"""Benchmark: one optimizer step of bf16 AdamW + Kahan vs optax.adamw with f32 master weights, in one run.

    python benchmarks/optim_step.py [--params 50e6] [--repeats 10]

Prints the step time of each (wall and process CPU time: on a shared machine the CPU time is the steadier
number), the ratio lpt / baseline, and bytes per parameter (params + optimizer state, plus the
bf16 compute copy the f32-master recipe has to keep). Steps are jitted with donated buffers (without donation
timings are dominated by allocation).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lpt.optim as O


def make_tree(n_params: float, dtype, seed=0):
    side = 2048
    n_mats = max(1, round(n_params / side / side))
    keys = jax.random.split(jax.random.key(seed), n_mats)
    return {f"w{i}": (0.02 * jax.random.normal(k, (side, side), jnp.float32)).astype(dtype) for i, k in enumerate(keys)}


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def time_step(step, params, state, grads, repeats):
    params, state = step(params, state, grads)  # compile + warm up
    jax.block_until_ready(params)
    wall, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        params, state = step(params, state, grads)
        jax.block_until_ready((params, state))
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return (float(np.median(wall)), float(np.median(cpu))), params, state


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--moment-rounding", default="nearest", choices=["nearest", "stochastic"])
    args = ap.parse_args()
    lr, wd = 1e-3, 0.1

    # baseline: f32 master weights + f32 moments; the model computes with a bf16 copy made every step
    base_tx = optax.adamw(lr, weight_decay=wd)

    def base_step(params, state, grads):
        g32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)  # bf16 grads -> f32
        updates, state = base_tx.update(g32, state, params)
        params = optax.apply_updates(params, updates)
        compute_copy = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)  # f32 -> bf16 for the forward
        return (params, compute_copy), state

    lpt_tx = O.kahan_adamw(lr, weight_decay=wd, moment_rounding=args.moment_rounding)

    def lpt_step(params, state, grads):
        updates, state = lpt_tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    grads = make_tree(args.params, jnp.bfloat16, seed=1)
    n = sum(x.size for x in jax.tree.leaves(grads))
    print(f"tree: {len(grads)} x 2048x2048 = {n / 1e6:.1f}M params, backend {jax.default_backend()}")

    p32 = make_tree(args.params, jnp.float32)
    s32 = base_tx.init(p32)
    base_bytes = (nbytes(p32) + nbytes(s32) + n * 2) / n  # + the bf16 compute copy
    step_b = jax.jit(lambda p, s, g: (lambda out, s: (out[0], s))(*base_step(p, s, g)), donate_argnums=(0, 1))
    t_base, p32, s32 = time_step(step_b, p32, s32, grads, args.repeats)
    del p32, s32

    p16 = make_tree(args.params, jnp.bfloat16)
    s16 = lpt_tx.init(p16)
    lpt_bytes = (nbytes(p16) + nbytes(s16)) / n
    step_l = jax.jit(lpt_step, donate_argnums=(0, 1))
    t_lpt, p16, s16 = time_step(step_l, p16, s16, grads, args.repeats)

    row = "{:36s}: {:8.1f} ms wall {:8.1f} ms cpu  {:5.1f} bytes/param"
    print(row.format("optax.adamw, f32 master + bf16 copy", t_base[0] * 1e3, t_base[1] * 1e3, base_bytes))
    print(row.format(f"lpt kahan_adamw ({args.moment_rounding} moments)", t_lpt[0] * 1e3, t_lpt[1] * 1e3, lpt_bytes))
    print(
        f"ratio lpt / baseline                : {t_lpt[0] / t_base[0]:8.2f}x wall {t_lpt[1] / t_base[1]:8.2f}x cpu  "
        f"{lpt_bytes / base_bytes:5.2f}x memory"
    )


if __name__ == "__main__":
    main()
