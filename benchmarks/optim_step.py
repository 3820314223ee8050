"""Benchmark: one optimizer step of bf16 AdamW + Kahan vs optax.adamw with f32 master weights, in one run.

    python benchmarks/optim_step.py [--params 50e6] [--rounds 7] [--side 2048] \
        [--rows base,fused:stochastic,optax_kahan]

Rows (all jitted with the params and optimizer state donated; without donation timings are dominated by allocation):

* ``base``: ``optax.adamw`` on f32 master weights with f32 moments, returning the bf16 compute copy the model
  needs for its forward pass (the honest baseline: 14 bytes/param resident, 28 moved per param in one fused pass).
* ``base_copy_donated``: the same, writing the bf16 copy into the previous step's copy buffer (donated), so no
  fresh 2 bytes/param output buffer is mapped (and page-faulted) every step.
* ``base_nocopy``: the same without producing the bf16 copy (what the update alone costs).
* ``fused:nearest``, ``fused:stochastic``: ``lpt.optim.kahan_adamw`` (one fused transform, ``impl="xla"``) with that
  moment rounding (``fused_parallel:...``: the same with ``sequential_leaves=False``).
* ``fused8:...``: the same with e4m3 moments and block scales (``moment_dtype="float8_e4m3fn"``).
* ``pallas:...``, ``pallas8:...``: ``kahan_adamw(impl="pallas")``, the one-pass kernel, with 16-bit or 8-bit
  moments (GPU or TPU: on a CPU the kernel is interpreted, and its time means nothing). On Hopper both run the
  Mosaic GPU variant.
* ``chain:nearest``, ``chain:stochastic``: ``lpt.optim.adamw(update="kahan")``, the composable chain with the same
  numbers.
* ``optax_kahan``: ``optax.chain(optax.adamw(...), lpt.optim.kahan_summation())``, the chain a user would build from
  optax parts (optax's bf16 moments, rounded to nearest).
* ``copy``: no optimizer: a donated uint32 buffer of 12 bytes per parameter read and written once (its bits
  inverted), 24 bytes per parameter, the traffic of the Pallas kernel's step: what the memory system gives a
  one-pass elementwise program here, the ceiling of a memory-bound optimizer step.

For the rows whose traffic is known (:data:`TRAFFIC`) it also prints the bytes per second that traffic implies and
its ratio to ``copy``'s when ``copy`` ran.

The rows run interleaved (round robin) so that load from other processes hits them alike; it prints medians of wall
and process CPU time (on a shared machine the CPU time is the steadier number), ratios against ``base``, bytes per
parameter resident (params + optimizer state [+ bf16 copy]), and the compiled step's structure on this backend
(loop fusions over whole leaves and copies per leaf). The Pallas kernel (``impl="pallas"``) cannot be timed on a
CPU; its analytic traffic per parameter is printed beside the measured rows.
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lpt.optim as O
from lpt.train.machine import describe, load

LR, WD = 1e-3, 0.1


def make_tree(n_params: float, dtype, seed=0, side=2048):
    n_mats = max(1, round(n_params / side / side))
    keys = jax.random.split(jax.random.key(seed), n_mats)
    return {f"w{i}": (0.02 * jax.random.normal(k, (side, side), jnp.float32)).astype(dtype) for i, k in enumerate(keys)}


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def structure(compiled, n_leaves: int, side: int) -> str:
    """Loop fusions and copies over whole leaves (side x side outputs), per leaf, of the compiled step."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    big = [ln for ln in entry.splitlines() if re.search(rf"= \w+\[{side},{side}\]", ln)]
    fusions = sum(" fusion(" in ln for ln in big)
    copies = sum(" copy(" in ln for ln in big)
    return f"{fusions / n_leaves:.0f} fusions + {copies / n_leaves:.0f} copies per leaf"


def build(row: str, n_params: float, side: int):
    """(step, params, state, resident bytes) of one row; the step maps (params, state, grads) -> (params, state)."""
    if row == "copy":  # 12 bytes per parameter, read and written once

        def step(params, state, grads):
            return jax.tree.map(jnp.invert, params), state

        shapes = make_tree(n_params, jnp.bfloat16, side=side)
        words = jax.tree.map(lambda g: jnp.zeros((3, *g.shape), jnp.uint32), shapes)
        return step, words, (), nbytes(words)
    if row in ("base", "base_nocopy", "base_copy_donated"):
        tx = optax.adamw(LR, weight_decay=WD)

        def step(params, state, grads):
            if row == "base_copy_donated":
                state, _old_copy = state  # the previous step's bf16 copy: its buffer is donated to the new one
            g32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)  # bf16 grads -> f32
            updates, state = tx.update(g32, state, params)
            params = optax.apply_updates(params, updates)
            copy = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)  # f32 -> bf16 compute copy
            if row == "base":  # the model computes with a bf16 copy made every step (a fresh buffer)
                return (params, copy), state
            if row == "base_copy_donated":
                return params, (state, copy)
            return params, state

        params = make_tree(n_params, jnp.float32, side=side)
        state = tx.init(params)
        if row == "base_copy_donated":
            state = (state, jax.tree.map(lambda p: p.astype(jnp.bfloat16), params))  # f32 -> bf16
        extra = nbytes(params) // 2 if row == "base" else 0
        return step, params, state, nbytes(params) + nbytes(state) + extra
    kind, rounding = row.split(":") if ":" in row else (row, None)
    if kind == "optax_kahan":  # the README's chain: optax.adamw (bf16 moments, rounded to nearest) + kahan_summation
        tx = optax.chain(optax.adamw(LR, weight_decay=WD), O.kahan_summation())
    elif kind in ("fused", "fused_parallel"):  # fused_parallel: leaves not sequenced (sequential_leaves=False)
        tx = O.kahan_adamw(LR, weight_decay=WD, moment_rounding=rounding, sequential_leaves=kind == "fused")
    elif kind in ("fused8", "pallas", "pallas8"):  # 8: e4m3 moments with block scales; pallas: the kernel (GPU/TPU)
        eight = {"moment_dtype": "float8_e4m3fn"} if kind.endswith("8") else {}
        impl = "pallas" if kind.startswith("pallas") else "xla"
        tx = O.kahan_adamw(LR, weight_decay=WD, moment_rounding=rounding, impl=impl, **eight)
    else:
        tx = O.adamw(LR, weight_decay=WD, update="kahan", moment_rounding=rounding)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = make_tree(n_params, jnp.bfloat16, side=side)
    state = tx.init(params)
    return step, params, state, nbytes(params) + nbytes(state)


# Analytic HBM traffic of one step on a GPU/TPU (bytes per parameter, reads + writes, one fused pass each):
ANALYTIC = {
    "optax.adamw f32 master (+ bf16 copy)": "read g 2 + p 4 + mu 4 + nu 4, write p 4 + mu 4 + nu 4 + copy 2 = 28",
    "lpt adamw_kahan Pallas kernel": "read g 2 + p 2 + c 2 + mv 4, write p 2 + c 2 + mv 4 = 18 (+ 6 for the "
    "delta that optax.apply_updates adds back: read p, p', write p = 24)",
    "the same with 8-bit moments": "read g 2 + p 2 + c 2 + codes 2 + scales 1/16, write p 2 + c 2 + codes 2 + "
    "scales 1/16 = 14.125 (+ 6 = 20.125)",
}


# Bytes per parameter that one step of a row reads plus writes in one fused pass (:data:`ANALYTIC`; for the XLA
# rows, what one pass would move).
TRAFFIC = {"base": 28, "copy": 24} | {f"{k}:{r}": 24 for k in ("fused", "pallas") for r in ("nearest", "stochastic")}
TRAFFIC |= {f"{k}:{r}": 20.125 for k in ("fused8", "pallas8") for r in ("nearest", "stochastic")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--side", type=int, default=2048, help="each leaf is side x side (larger: fewer kernel calls)")
    ap.add_argument(
        "--rows",
        default="base,base_copy_donated,base_nocopy,fused:nearest,fused:stochastic,chain:nearest,chain:stochastic,"
        "optax_kahan",
    )
    args = ap.parse_args()
    rows = args.rows.split(",")
    grads = make_tree(args.params, jnp.bfloat16, seed=1, side=args.side)
    n = sum(x.size for x in jax.tree.leaves(grads))
    print(f"tree: {len(grads)} x {args.side}x{args.side} = {n / 1e6:.1f}M params")
    print(f"machine: {describe()}")

    runs = {}
    for row in rows:
        step, params, state, resident = build(row, args.params, args.side)
        jitted = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
        shape = structure(jitted, n_leaves=len(grads), side=args.side)
        params, state = jitted(params, state, grads)  # warm up
        params = params[0] if row == "base" else params
        jax.block_until_ready(params)
        runs[row] = dict(jit=jitted, params=params, state=state, wall=[], cpu=[], bytes=resident / n, shape=shape)
    for _ in range(args.rounds):
        for row in rows:
            r = runs[row]
            t, c = time.perf_counter(), time.process_time()
            params, r["state"] = r["jit"](r["params"], r["state"], grads)
            jax.block_until_ready((params, r["state"]))
            r["wall"].append(time.perf_counter() - t)
            r["cpu"].append(time.process_time() - c)
            r["params"] = params[0] if row == "base" else params

    ref = runs[rows[0]]
    ref_wall, ref_cpu = np.median(ref["wall"]), np.median(ref["cpu"])
    head = f"{'row':18s} {'wall ms':>8s} {'cpu ms':>8s} {'wall x':>7s} {'cpu x':>7s} {'B/param':>8s}"
    print(head + "  compiled (this backend)")
    for row in rows:
        r = runs[row]
        w, c = np.median(r["wall"]), np.median(r["cpu"])
        print(
            f"{row:18s} {w * 1e3:8.1f} {c * 1e3:8.1f} {w / ref_wall:7.2f} {c / ref_cpu:7.2f} {r['bytes']:8.1f}  "
            f"{r['shape']}"
        )
    print(f"(ratios against {rows[0]}; medians of {args.rounds} interleaved rounds; load after: {load()})")
    rate = {row: TRAFFIC[row] * n / np.median(runs[row]["wall"]) for row in rows if row in TRAFFIC}
    for row, bps in rate.items():
        vs = f" = {bps / rate['copy']:.2f}x copy" if "copy" in rate else ""
        print(f"{row}: {TRAFFIC[row]:g} B/param moved at {bps / 1e9:.0f} GB/s{vs}")
    print("analytic traffic per parameter, one fused pass (GPU/TPU):")
    for k, v in ANALYTIC.items():
        print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
