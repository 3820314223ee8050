"""lpt.optim: optax GradientTransformations for low-precision weight updates.

Each update rule goes **last** in an optax chain and emits the change ``new_param - param`` in the param's dtype
(float32 for 8-bit params: :func:`lpt.numerics.update_dtype`), so that ``optax.apply_updates`` and ``nnx.Optimizer``
reproduce the rounded new parameters bit for bit (unless a weight more than halves or doubles in one step: then
its change is rounded to the param's dtype, :func:`lpt.numerics.change_to`), and optax's wrappers, which build
updates from the gradients, see the gradients' dtype::

    tx = optax.chain(optax.clip_by_global_norm(1.0), lpt.optim.scale_by_adam(), optax.scale_by_learning_rate(3e-4),
                     lpt.optim.kahan_summation())
    params = optax.apply_updates(params, tx.update(grads, state, params)[0])   # params stay bf16

For float8 params use :func:`lpt.optim.apply_updates` (JAX refuses the implicit fp8 + f32 promotion that
``optax.apply_updates`` relies on).

Rules: :func:`kahan_summation` (Zamirai et al., Algorithm 1), :func:`stochastic_rounding` (Zamirai et al.),
:func:`nearest_rounding` (the baseline), :func:`norm_preserving_update` (the norm-preserving update note); the papers
are listed in docs/references.md. Helpers: :func:`check_last` (one update, checked to land on the params' grid:
the rule is last in the chain), diagnostics (:func:`get_diagnostics`), f32-checkpoint conversion
(:func:`compensation_from_f32`, :func:`to_f32`, :func:`find_compensation`, :func:`replace_compensation`), moment
storage conversion (:func:`convert_moments`, e.g. 16-bit to 8-bit moments), and recipes
(:func:`scale_by_adam`, :func:`add_decayed_weights`, :func:`adamw`, :func:`kahan_adamw`: one fused transform with
``impl="xla" | "pallas"`` and state :class:`KahanAdamWState`, :func:`update_rule` of a name in :data:`UPDATE_RULES`).

Per-leaf steps, state classes and the rest stay importable from their modules: :mod:`lpt.optim.accumulation`
(Kahan-compensated micro-batch gradient accumulation), :func:`lpt.optim.kahan.kahan_step`,
:func:`lpt.optim.norm_preserving.norm_preserving_step`, :func:`lpt.optim.fused_adamw.kahan_adamw_moments`,
:class:`lpt.optim.leaves.UpdateDiagnostics`, :class:`lpt.optim.kahan.KahanSummationState` and the other rules'
states.
"""

from lpt.optim.adam import scale_by_adam
from lpt.optim.apply import apply_updates
from lpt.optim.check import check_last
from lpt.optim.diagnostics import convert_moments, find_compensation, get_diagnostics, replace_compensation
from lpt.optim.fused_adamw import KahanAdamWState, kahan_adamw
from lpt.optim.kahan import compensation_from_f32, kahan_summation, to_f32
from lpt.optim.norm_preserving import norm_preserving_update
from lpt.optim.recipes import UPDATE_RULES, adamw, add_decayed_weights, update_rule
from lpt.optim.rounding_rules import nearest_rounding, stochastic_rounding

__all__ = [
    "UPDATE_RULES",
    "KahanAdamWState",
    "add_decayed_weights",
    "adamw",
    "apply_updates",
    "check_last",
    "compensation_from_f32",
    "convert_moments",
    "find_compensation",
    "get_diagnostics",
    "kahan_adamw",
    "kahan_summation",
    "nearest_rounding",
    "norm_preserving_update",
    "replace_compensation",
    "scale_by_adam",
    "stochastic_rounding",
    "to_f32",
    "update_rule",
]
