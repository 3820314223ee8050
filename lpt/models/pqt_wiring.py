"""PQT (Ahn & Yoo, Gaussian Weight Sampling) inside the model, built on :mod:`lpt.pqt`: bitwidth parameters, noisy
weights, loss, diagnostics.

Each linear layer of a projection listed in ``precision.pqt.layers`` owns a :class:`lpt.pqt.PQTBitwidth` ``b_i``
(float32, one per 32×32 tile, initialised to 1; ``b_t = b_target + b_i · (b_init − b_target)``, Eq. 11). In training
(a step key is given) the layer uses ``ŵ = lpt.pqt.apply_pqt(w_view, b_i, key, method, path)`` in the compute dtype,
where ``w_view`` is the weight seen through ``param_dtype`` and ``path`` (e.g. "blocks/3/mlp/down") is folded into
the step key, so the noise is a function of (seed, step, layer path) only. In evaluation (``key=None``) the layer
uses ``w`` itself. The loss term (Eq. 12) is ``λ Σ_layers mean_tiles |b_t − b_target|``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lpt import pqt
from lpt.models.config import Precision

BLOCK = 32


def make_bitwidth(shape: tuple[int, int], prec: Precision):
    """A ``PQTBitwidth`` (b_i = 1 per tile, f32, replicated logical axes) for a kernel of ``shape``."""
    grid = pqt.block_grid(shape, BLOCK)
    return pqt.PQTBitwidth(
        jnp.ones(grid, jnp.float32),
        b_init=prec.pqt.b_init,
        b_target=prec.pqt.b_target,
        block=BLOCK,
        kernel_shape=tuple(shape),
        out_sharding=(None,) * len(grid),  # the tile grid rarely divides a mesh axis: replicate
        eager_sharding=False,
        init_const=1.0,
    )


def sample(w_view: jax.Array, bitwidth, key: jax.Array, *, method: str, path: str, prec: Precision) -> jax.Array:
    """ŵ of Ahn & Yoo (GaussWS), Eq. 3 in the compute dtype (:func:`lpt.pqt.apply_pqt`).

    Args:
      w_view: the weight's view in ``prec.view_dtype``.
      bitwidth: the layer's :class:`lpt.pqt.PQTBitwidth`.
      key: the step key.
      method: "gaussws" or "diffq".
      path: the layer path folded into ``key``.
      prec: the model's :class:`lpt.models.config.Precision` (its compute dtype).
    """
    return pqt.apply_pqt(w_view, bitwidth, key, method=method, path=path, compute_dtype=prec.compute)


def aux_loss(model) -> jax.Array:
    """``λ Σ_layers mean_tiles |b_t − b_target|`` (Ahn & Yoo (GaussWS), Eq. 12), float32; 0 without PQT layers."""
    if model.prec.pqt.method == "none":
        return jnp.zeros((), jnp.float32)
    return pqt.bitwidth_loss(model, model.prec.pqt.loss_weight)


_KIND_OF = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "out", "up": "up", "gate": "up", "down": "down"}


def pqt_diagnostics(model) -> dict[str, jax.Array]:
    """``pqt/all/bt_mean``, ``pqt/all/frac_le{5,9,12}`` (from :func:`lpt.pqt.bitwidth_stats`), ``pqt/bt_min``,
    ``pqt/bt_max`` and ``pqt/bt_mean/<projection>`` (unweighted tile mean per projection)."""
    if model.prec.pqt.method == "none":
        return {}
    out = {k: v for k, v in pqt.bitwidth_stats(model).items() if k.startswith("pqt/all/")}
    per_kind: dict[str, list] = {}
    all_bt = []
    for path, var in nnx.to_flat_state(nnx.state(model, pqt.PQTBitwidth)):
        bt = pqt.bitwidth_of(var).reshape(-1)
        all_bt.append(bt)
        per_kind.setdefault(_KIND_OF[str(path[-2])], []).append(bt)
    out["pqt/bt_min"] = jnp.min(jnp.concatenate(all_bt))
    out["pqt/bt_max"] = jnp.max(jnp.concatenate(all_bt))
    for kind, parts in sorted(per_kind.items()):
        out[f"pqt/bt_mean/{kind}"] = jnp.mean(jnp.concatenate(parts))
    return out
