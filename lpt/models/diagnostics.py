"""Scalar diagnostics of a model's parameters for logging (jittable: call on a merged model inside the step).

``diagnostics(model)`` returns a dict of float32 scalars:

* PQT (when ``precision.pqt.method != "none"``): ``pqt/all/bt_mean``, ``pqt/all/frac_le{5,9,12}``, ``pqt/bt_min``,
  ``pqt/bt_max``, ``pqt/bt_mean/<projection>`` (see :func:`lpt.models.pqt_wiring.pqt_diagnostics`).
* FP8 weights (when ``param_dtype`` is an fp8 format): ``params/fp8_saturated_frac`` = fraction of matmul-kernel
  entries whose ``param_dtype`` view sits at ±max (saturated), and ``params/fp8_zero_frac`` = fraction that are 0
  (underflowed or dead).

Empty dict for a plain f32/bf16 model.

``activation_diagnostics(model, tokens_BT, *, key=None)`` runs one forward pass with the layers' probes on
(:mod:`lpt.models.probes`) and returns the activation statistics: ``attn/repeated_max_frac``,
``attn/repeated_max_frac_max`` always, and for every projection the statistics its matmul format's probe records
(:mod:`lpt.models.matmul_formats`; "fp8": ``fp8/<projection>/{x,w}_{underflow,subnormal}_frac``,
``fp8/<projection>/x_scale_range_log2`` and ``fp8/<projection>/snr_db``; "mxfp8", "nvfp4": their block-scale health and
``fp8/<projection>/snr_db``). Jittable; costs about one forward pass plus, per attention layer, the logits of a few
sequences and, per FP8 or block-scaled matmul, one extra quantization and a reference GEMM: call it on logging steps
only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lpt import numerics
from lpt.models import probes
from lpt.models.layers import Linear, view_weight
from lpt.models.pqt_wiring import pqt_diagnostics


def _fp8_weight_stats(model) -> dict[str, jax.Array]:
    prec = model.prec
    fmt = numerics.get_format(prec.view_dtype)
    n = 0
    sat = jnp.zeros((), jnp.float32)
    zero = jnp.zeros((), jnp.float32)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Linear):
            w_f32 = view_weight(node.kernel[...], prec, prec.view_dtype).astype(jnp.float32)  # fp8 -> f32 exact
            sat = sat + jnp.sum(jnp.abs(w_f32) >= fmt.max).astype(jnp.float32)
            zero = zero + jnp.sum(w_f32 == 0).astype(jnp.float32)
            n += w_f32.size
    return {"params/fp8_saturated_frac": sat / n, "params/fp8_zero_frac": zero / n}


def diagnostics(model) -> dict[str, jax.Array]:
    """See the module docstring."""
    out = dict(pqt_diagnostics(model))
    if model.prec.param_dtype.startswith("float8"):
        out.update(_fp8_weight_stats(model))
    return out


def activation_diagnostics(model, tokens_BT: jax.Array, *, key: jax.Array | None = None) -> dict[str, jax.Array]:
    """See the module docstring. ``key`` is the step key the training forward used (PQT noise); the logits are
    discarded, so XLA keeps only what the statistics need."""
    with probes.collecting() as c:
        model(tokens_BT, key=key)
    return c.summary()
