"""Learnable per-tile bitwidth of Ahn & Yoo (Section 3.6): Eq. 11, the optional loss of Eq. 12, diagnostics.

Each ``block × block`` tile of a PQT kernel owns an internal parameter b_i (initialised to 1). The bitwidth used by
:func:`lpt.pqt.gaussws` is the affine map (Eq. 11)

    b_t = b_target + b_i · (b_init − b_target)          (defaults b_init = 6, b_target = 4)

so b_t starts at b_init and weight decay on b_i pulls it toward b_target. Optionally the training loss gets
(Eq. 12)

    L' = L + λ · Σ_layers mean_tiles |b_t − b_target|.

b_i lives in a :class:`PQTBitwidth` variable (an ``nnx.Param`` subclass, f32) whose metadata records b_init,
b_target, the tile size and the kernel shape, so the loss and the diagnostics need nothing but the model.
Optimizer masks can select it by type (``nnx.state(model, PQTBitwidth)``); the paper applies weight decay to b_i.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lpt.pqt.gaussws import block_grid

DEFAULT_B_INIT = 6.0
DEFAULT_B_TARGET = 4.0
_DEFAULT_TIERS = (5.0, 9.0, 12.0)


class PQTBitwidth(nnx.Param):
    """b_i per tile of a PQT kernel (Eq. 11). Metadata: ``b_init``, ``b_target``, ``block``, ``kernel_shape``."""


def init_bitwidth(
    kernel_shape: Sequence[int],
    *,
    b_init: float = DEFAULT_B_INIT,
    b_target: float = DEFAULT_B_TARGET,
    block: int = 32,
    b_i: float = 1.0,
) -> PQTBitwidth:
    """A :class:`PQTBitwidth` of shape ``block_grid(kernel_shape, block)`` filled with ``b_i`` (f32; seed: 1).

    Args:
      kernel_shape: the kernel's shape ``[..., in, out]``.
      b_init, b_target: finite, different; stored as metadata (Eq. 11).
      block: square tile size.
      b_i: the initial value of every b_i.
    """
    kernel_shape = tuple(int(s) for s in kernel_shape)
    grid = block_grid(kernel_shape, block)
    if not (np.isfinite(b_init) and np.isfinite(b_target)) or b_init == b_target:
        raise ValueError(f"need finite b_init != b_target, got b_init={b_init!r}, b_target={b_target!r}")
    return PQTBitwidth(
        jnp.full(grid, b_i, jnp.float32),
        b_init=float(b_init),
        b_target=float(b_target),
        block=int(block),
        kernel_shape=kernel_shape,
    )


def effective_bitwidth(b_i, b_init: float = DEFAULT_B_INIT, b_target: float = DEFAULT_B_TARGET) -> jax.Array:
    """Eq. 11: b_t = b_target + b_i · (b_init − b_target), f32."""
    b_i_f32 = jnp.asarray(b_i).astype(jnp.float32)  # param dtype -> f32
    return jnp.float32(b_target) + b_i_f32 * jnp.float32(b_init - b_target)


def bitwidth_of(var: PQTBitwidth) -> jax.Array:
    """b_t of a :class:`PQTBitwidth` variable, using its own b_init / b_target metadata."""
    if not isinstance(var, PQTBitwidth):
        raise ValueError(f"expected a PQTBitwidth variable, got {type(var).__name__}")
    return effective_bitwidth(var[...], var.b_init, var.b_target)


def _bitwidth_vars(model_or_state) -> list[tuple[str, PQTBitwidth]]:
    if isinstance(model_or_state, nnx.Module):
        state = nnx.state(model_or_state, PQTBitwidth)
    elif isinstance(model_or_state, nnx.State):
        state = model_or_state
    else:
        raise ValueError(f"expected an nnx.Module or nnx.State, got {type(model_or_state).__name__}")
    out = []
    for path, var in nnx.to_flat_state(state):
        if isinstance(var, PQTBitwidth):
            out.append(("/".join(str(p) for p in path), var))
    return out


def bitwidth_loss(model_or_state, lam: float) -> jax.Array:
    """Eq. 12's extra term λ · Σ_layers mean_tiles |b_t − b_target| (f32 scalar; 0 if there are no PQT layers)."""
    total = jnp.zeros((), jnp.float32)
    for _, var in _bitwidth_vars(model_or_state):
        total = total + jnp.mean(jnp.abs(bitwidth_of(var) - jnp.float32(var.b_target)))
    return jnp.float32(lam) * total


def tile_sizes(kernel_shape: Sequence[int], block: int) -> np.ndarray:
    """Number of kernel elements in each tile (edge tiles are partial), shape ``block_grid(kernel_shape, block)``."""
    grid = block_grid(kernel_shape, block)
    m, n = kernel_shape[-2:]
    rows = np.minimum(block, m - block * np.arange(grid[-2]))
    cols = np.minimum(block, n - block * np.arange(grid[-1]))
    return np.broadcast_to(np.outer(rows, cols), grid).astype(np.float32)


def bitwidth_stats(model_or_state, *, tiers: Sequence[float] = _DEFAULT_TIERS, prefix: str = "pqt") -> dict:
    """Loggable b_t diagnostics (f32 scalars, jit-friendly).

    Per layer (key ``f"{prefix}/{path}/..."``): ``bt_mean`` (weighted by parameters per tile), ``bt_min``,
    ``bt_max`` and ``frac_le{t}`` = fraction of the layer's parameters whose tile has b_t ≤ t for each tier
    t (default 5 / 9 / 12, the paper's Figure 5 tiers: FP8_e3m4, FP12_e4m7, FP16_e5m10). The same fractions and
    the mean over all PQT parameters go under ``f"{prefix}/all/..."``.
    """
    stats = {}
    total_n = 0.0
    total_bt = jnp.zeros((), jnp.float32)
    total_le = [jnp.zeros((), jnp.float32) for _ in tiers]
    for path, var in _bitwidth_vars(model_or_state):
        bt = bitwidth_of(var)
        sizes = tile_sizes(var.kernel_shape, var.block)
        n_params = float(sizes.sum())
        sizes_j = jnp.asarray(sizes)
        stats[f"{prefix}/{path}/bt_mean"] = jnp.sum(bt * sizes_j) / n_params
        stats[f"{prefix}/{path}/bt_min"] = jnp.min(bt)
        stats[f"{prefix}/{path}/bt_max"] = jnp.max(bt)
        total_n += n_params
        total_bt = total_bt + jnp.sum(bt * sizes_j)
        for i, t in enumerate(tiers):
            le = jnp.sum(jnp.where(bt <= jnp.float32(t), sizes_j, 0.0))
            stats[f"{prefix}/{path}/frac_le{t:g}"] = le / n_params
            total_le[i] = total_le[i] + le
    if total_n > 0:
        stats[f"{prefix}/all/bt_mean"] = total_bt / total_n
        for t, le in zip(tiers, total_le, strict=True):
            stats[f"{prefix}/all/frac_le{t:g}"] = le / total_n
    return stats


__all__ = [
    "DEFAULT_B_INIT",
    "DEFAULT_B_TARGET",
    "PQTBitwidth",
    "bitwidth_loss",
    "bitwidth_of",
    "bitwidth_stats",
    "effective_bitwidth",
    "init_bitwidth",
    "tile_sizes",
]
