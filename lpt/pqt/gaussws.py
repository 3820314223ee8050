"""Gaussian weight sampling (Ahn & Yoo, Eq. 3 / Eq. 4) and the DiffQ baseline, as one ``jax.custom_vjp`` op.

Forward (Eq. 3), over square ``block × block`` tiles of the last two axes of ``w[..., m, n]``:

    ŵ = w + R ⊙ broadcast_blk( max_blk(|w|) · 2^(1 − b_t) )

with R = :func:`lpt.pqt.rounded_normal` (GaussWS) or :func:`lpt.pqt.symmetric_uniform` (DiffQ), one b_t per tile.

Backward (Eq. 4, with the paper's approximation ∂max_blk(|w|)/∂w ≈ 0):

    ∂L/∂w   = ∂L/∂ŵ
    ∂L/∂b_t = −ln 2 · max_blk(|w|) · 2^(1 − b_t) · Σ_blk(∂L/∂ŵ ⊙ R)

R is regenerated in the backward from the same key (nothing but the per-tile step and the key is saved), so
forward and backward see the identical R.

Arithmetic and casts (``compute_dtype`` = bf16 by default, the paper's "BF16 operator"):

1. ``w_c = w.astype(compute_dtype)``: f32 → bf16 (RNE); a no-op for bf16 parameters.
2. ``max_blk(|w_c|)``: exact in bf16.
3. ``step = max_blk · 2^(1 − b_t)`` in f32 (b_t is f32), rounded once to bf16 (RNE, monotone, so a step ≥ 2^k
   stays ≥ 2^k: this keeps Lemma 1's guarantee).
4. ``pqn = R · step``: exact in bf16 for GaussWS (R ∈ {0, ±1, ±2}); for DiffQ the f32 product is rounded to bf16
   with :func:`lpt.numerics.round_nearest` so that XLA's excess precision cannot skip the rounding.
5. ``ŵ = w_c + pqn``: one bf16 rounding. ŵ is returned in bf16; ∂L/∂w is returned in ``w.dtype`` (bf16 → f32 exact).
6. Backward: Σ_blk(g ⊙ R) and the step are f32.

Lemma 1: with bf16 (m = 7) and τ = 0 (min |R| = 1), every non-zero GaussWS noise survives the bf16 addition when
b_t < 9 (b_t ≤ 8 with the rounded step). DiffQ's R has τ = −8, so it underflows already for small b_t.

Shapes that are not a multiple of ``block``: the tile grid is ⌈m/block⌉ × ⌈n/block⌉ (as in Eq. 3) and edge tiles
are partial: their max and sums run only over the elements present. Implemented by zero padding ``w`` (zeros
change neither max|w| nor Σ) and slicing ŵ back; R is drawn at the padded shape. Leading axes of ``w`` (e.g.
stacked layers) are batch axes: each has its own tiles and b_t.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from lpt.numerics import round_nearest
from lpt.pqt.noise import rounded_normal, symmetric_uniform

METHODS = ("gaussws", "diffq")
COMPUTE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_LN2 = math.log(2.0)


def block_grid(shape, block: int = 32) -> tuple[int, ...]:
    """Shape of the b_t array for a weight of ``shape``: ``shape[:-2] + (⌈m/block⌉, ⌈n/block⌉)``."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"PQT needs a weight with at least 2 axes [..., m, n], got shape {shape}")
    if not isinstance(block, int | np.integer) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    m, n = shape[-2:]
    return shape[:-2] + (-(-m // block), -(-n // block))


def pqn_noise(key: jax.Array, shape, method: str) -> jax.Array:
    """The R of ``method`` ("gaussws": rounded normal, "diffq": symmetric uniform), bf16, of ``shape``."""
    if method == "gaussws":
        return rounded_normal(key, shape)
    if method == "diffq":
        return symmetric_uniform(key, shape)
    raise ValueError(f"unknown PQT method {method!r}; allowed: {METHODS}")


def _pad_to_blocks(x: jax.Array, block: int) -> jax.Array:
    m, n = x.shape[-2:]
    pm, pn = (-m) % block, (-n) % block
    if pm == 0 and pn == 0:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pm), (0, pn)])  # zeros: neutral for max|.| and Σ


def _to_tiles(x: jax.Array, block: int) -> jax.Array:
    """[..., M, N] (multiples of block) -> [..., M/b, b, N/b, b] (a free reshape)."""
    *lead, m, n = x.shape
    return x.reshape(*lead, m // block, block, n // block, block)


def _from_tiles(x: jax.Array, m: int, n: int) -> jax.Array:
    *lead, mb, b, nb, b2 = x.shape
    return x.reshape(*lead, mb * b, nb * b2)[..., :m, :n]


def _step_f32(w_c: jax.Array, bt_f32: jax.Array, block: int) -> jax.Array:
    """max_blk(|w_c|) · 2^(1 − b_t) per tile, f32."""
    amax = jnp.max(jnp.abs(_to_tiles(_pad_to_blocks(w_c, block), block)), axis=(-3, -1))  # compute dtype, exact
    return amax.astype(jnp.float32) * jnp.exp2(1.0 - bt_f32)  # bf16 -> f32 exact; f32 product


def _sample(w, bt_f32, key, method, block, compute_dtype):
    m, n = w.shape[-2:]
    w_c = w.astype(compute_dtype)  # f32 -> compute dtype (RNE); no-op if already compute dtype
    step_f32 = _step_f32(w_c, bt_f32, block)
    w_t = _to_tiles(_pad_to_blocks(w_c, block), block)
    r_t = _to_tiles(pqn_noise(key, _pad_to_blocks(w_c, block).shape, method), block)
    if method == "gaussws":
        step_c = step_f32.astype(compute_dtype)  # f32 -> compute dtype (RNE, once per tile)
        pqn_t = r_t.astype(compute_dtype) * step_c[..., :, None, :, None]  # bf16 -> compute dtype exact; exact product
    else:
        step_c = step_f32.astype(compute_dtype).astype(jnp.float32)  # f32 -> compute dtype (RNE) -> f32 exact
        prod_f32 = r_t.astype(jnp.float32) * step_c[..., :, None, :, None]  # bf16 -> f32 exact; exact product
        pqn_t = round_nearest(prod_f32, compute_dtype)  # f32 -> compute dtype (RNE, survives jit)
    w_hat_t = w_t + pqn_t  # compute dtype addition: the one rounding of ŵ
    return _from_tiles(w_hat_t, m, n), step_f32


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _pqn_sample(w, bt_f32, key, method, block, compute_dtype, w_dtype):
    del w_dtype
    return _sample(w, bt_f32, key, method, block, compute_dtype)[0]


def _pqn_sample_fwd(w, bt_f32, key, method, block, compute_dtype, w_dtype):
    del w_dtype
    w_hat, step_f32 = _sample(w, bt_f32, key, method, block, compute_dtype)
    return w_hat, (step_f32, key)


def _pqn_sample_bwd(method, block, compute_dtype, w_dtype, res, g):
    step_f32, key = res
    g_t = _to_tiles(_pad_to_blocks(g, block), block)
    r = pqn_noise(key, g.shape[:-2] + (g_t.shape[-4] * block, g_t.shape[-2] * block), method)  # same R as forward
    r_t = _to_tiles(r, block)
    gr_sum = jnp.sum(g_t.astype(jnp.float32) * r_t.astype(jnp.float32), axis=(-3, -1))  # bf16 -> f32 exact; f32 Σ
    g_bt = jnp.float32(-_LN2) * step_f32 * gr_sum  # Eq. 4, f32
    g_w = g.astype(w_dtype)  # ∂L/∂w = ∂L/∂ŵ (compute dtype -> w dtype, exact when widening)
    return g_w, g_bt, None


_pqn_sample.defvjp(_pqn_sample_fwd, _pqn_sample_bwd)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))  # eager callers compile one executable, not one per op
def _pqn_sample_jit(w, bt, key, method, block, compute_dtype, w_dtype):
    grid = block_grid(w.shape, block)
    bt_f32 = jnp.broadcast_to(bt.astype(jnp.float32), grid)  # any float -> f32; autodiff sums a scalar's gradient
    return _pqn_sample(w, bt_f32, key, method, block, compute_dtype, w_dtype)


def pqn_sample(w, bitwidth, key, *, method: str = "gaussws", block: int = 32, compute_dtype=jnp.bfloat16):
    """ŵ of Eq. 3 for ``method`` ∈ {"gaussws", "diffq"}; differentiable in ``w`` and ``bitwidth`` (Eq. 4).

    Args:
      w: float weight ``[..., m, n]`` (f32 master or bf16).
      bitwidth: b_t, f32-castable, shape ``()`` (one b_t for every tile) or ``block_grid(w.shape, block)``.
      key: PRNG key for this layer and step (see :func:`lpt.pqt.pqt_key`); the backward regenerates R from it.
      method: "gaussws" (R = rounded normal) or "diffq" (R = symmetric U(−0.5, 0.5)).
      block: square tile size (32, MX-compliant).
      compute_dtype: dtype of the noise arithmetic and of ŵ: bfloat16 (default, the paper's), float16 or float32.

    Returns:
      ŵ in ``compute_dtype``, shape of ``w``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown PQT method {method!r}; allowed: {METHODS}")
    w = jnp.asarray(w)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"w must be a float array, got dtype {w.dtype}")
    grid = block_grid(w.shape, block)
    cdt = jnp.dtype(compute_dtype)
    if cdt not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {[str(d) for d in COMPUTE_DTYPES]}, got {cdt}")
    bt = jnp.asarray(bitwidth)
    if bt.shape not in ((), grid):
        raise ValueError(
            f"bitwidth shape {bt.shape} does not fit weight shape {w.shape} with block {block}: "
            f"allowed () or {grid} (= w.shape[:-2] + (ceil(m/block), ceil(n/block)))"
        )
    return _pqn_sample_jit(w, bt, key, method, int(block), cdt, jnp.dtype(w.dtype))


def gaussws(w, bitwidth, key, *, block: int = 32, compute_dtype=jnp.bfloat16):
    """Gaussian weight sampling, Ahn & Yoo (GaussWS), Eq. 3: ŵ = w + R ⊙ broadcast(max₃₂ₓ₃₂(|w|) · 2^(1 − b_t)).

    R = :func:`lpt.pqt.rounded_normal`. Gradients (Eq. 4): ∂L/∂w = ∂L/∂ŵ;
    ∂L/∂b_t = −ln2 · max_blk(|w|) · 2^(1−b_t) · Σ_blk(∂L/∂ŵ ⊙ R), with R regenerated from ``key``.
    See :func:`pqn_sample` for the arguments and the module docstring for dtypes and ragged shapes.

    Args:
      w, bitwidth, key, block, compute_dtype: as :func:`pqn_sample`.
    """
    return pqn_sample(w, bitwidth, key, method="gaussws", block=block, compute_dtype=compute_dtype)


def diffq(w, bitwidth, key, *, block: int = 32, compute_dtype=jnp.bfloat16):
    """The DiffQ baseline of Ahn & Yoo: :func:`gaussws` with R ~ U(−0.5, 0.5) in bf16 (:func:`symmetric_uniform`).

    Args:
      w, bitwidth, key, block, compute_dtype: as :func:`pqn_sample`.
    """
    return pqn_sample(w, bitwidth, key, method="diffq", block=block, compute_dtype=compute_dtype)


__all__ = ["COMPUTE_DTYPES", "METHODS", "block_grid", "diffq", "gaussws", "pqn_noise", "pqn_sample"]
