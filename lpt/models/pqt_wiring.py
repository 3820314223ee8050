"""PQT (seed 004) inside the model: per-layer bitwidth parameters, noisy weights, the bitwidth loss, diagnostics.

Each selected linear layer owns ``b_i`` (float32, one per 32×32 tile of its weight, initialised to 1) and uses
``b_t = b_target + b_i · (b_init − b_target)`` (seed 004 Eq. 11). In training (a step key is given) the layer's
weight is ``ŵ = lpt.pqt.pqn_sample(w, b_t, fold_in(key, layer_id), method)`` in the compute dtype; in evaluation
(``key=None``) it is ``w`` itself. The loss term (Eq. 12) is ``λ Σ_layers mean_tiles |b_t − b_target|``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lpt.models.config import PrecisionSpec

BLOCK = 32


def _pqt_module():
    try:
        import lpt.pqt.gaussws as g
    except ImportError as e:
        raise NotImplementedError(
            "precision.pqt.method='gaussws'/'diffq' needs lpt.pqt.pqn_sample, which is not available yet"
        ) from e
    return g


class PQTWeight(nnx.Module):
    """Holds ``b_i`` for one weight and applies the PQN sample to it."""

    def __init__(self, method: str, shape: tuple[int, int], prec: PrecisionSpec):
        g = _pqt_module()
        self.method = method
        self.b_init, self.b_target = prec.pqt_b_init, prec.pqt_b_target
        self.compute_dtype = prec.compute
        grid = g.block_grid(shape, BLOCK)
        # b_i: f32 always (see lpt.models.config); tiles are replicated (their grid rarely divides a mesh axis).
        self.b_i = nnx.Param(
            jnp.ones(grid, jnp.float32), out_sharding=(None,) * len(grid), eager_sharding=False, init_const=1.0
        )

    def bitwidth(self) -> jax.Array:
        """``b_t = b_target + b_i · (b_init − b_target)``, float32 per tile."""
        return self.b_target + self.b_i[...] * (self.b_init - self.b_target)

    def __call__(self, w: jax.Array, key: jax.Array | None) -> jax.Array:
        """ŵ in the compute dtype (training) or ``None`` in evaluation (caller uses ``w``)."""
        if key is None:
            return None
        return _pqt_module().pqn_sample(
            w, self.bitwidth(), key, method=self.method, block=BLOCK, compute_dtype=self.compute_dtype
        )


def _pqt_layers(model) -> list[tuple[str, PQTWeight]]:
    out = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, PQTWeight):
            out.append(("/".join(str(p) for p in path), node))
    return out


def aux_loss(model) -> jax.Array:
    """``λ Σ_layers mean_tiles |b_t − b_target|`` (seed 004 Eq. 12), float32; 0 without PQT layers."""
    total = jnp.zeros((), jnp.float32)
    layers = _pqt_layers(model)
    if not layers:
        return total
    for _, layer in layers:
        total = total + jnp.mean(jnp.abs(layer.bitwidth() - layer.b_target))
    return model.prec.pqt_loss_weight * total


def diagnostics(model) -> dict[str, jax.Array]:
    """Bitwidth statistics over all PQT tiles: ``pqt/bitwidth_{mean,min,max}`` and ``pqt/bitwidth_mean/<kind>``."""
    layers = _pqt_layers(model)
    if not layers:
        return {}
    out = {}
    all_bt = jnp.concatenate([layer.bitwidth().reshape(-1) for _, layer in layers])
    out["pqt/bitwidth_mean"] = jnp.mean(all_bt)
    out["pqt/bitwidth_min"] = jnp.min(all_bt)
    out["pqt/bitwidth_max"] = jnp.max(all_bt)
    by_kind: dict[str, list] = {}
    for path, layer in layers:
        kind = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "out", "up": "up", "gate": "up", "down": "down"}[
            path.split("/")[-2]
        ]
        by_kind.setdefault(kind, []).append(layer.bitwidth().reshape(-1))
    for kind, parts in sorted(by_kind.items()):
        out[f"pqt/bitwidth_mean/{kind}"] = jnp.mean(jnp.concatenate(parts))
    return out
