"""Find the lpt states inside any optax chain state: read their diagnostics, swap their compensation."""

from __future__ import annotations

from typing import Any

import jax

from lpt.optim.fused_adamw import KahanAdamWState
from lpt.optim.kahan import KahanSummationState
from lpt.optim.leaves import UpdateDiagnostics


def _is_state_with_diag(x) -> bool:
    return hasattr(x, "_fields") and "diagnostics" in x._fields and isinstance(x.diagnostics, UpdateDiagnostics)


def get_diagnostics(opt_state: Any) -> dict[str, jax.Array]:
    """Scalars to log from every lpt update rule in ``opt_state`` built with ``diagnostics=True``.

    Returns e.g. ``{"update/cancelled_fraction": ..., "update/intended_norm": ..., "update/applied_norm": ...}``;
    with several lpt rules in one state (e.g. under ``optax.multi_transform``) the keys get a ``/i`` suffix.
    """
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_state_with_diag) if _is_state_with_diag(x)]
    out = {}
    for i, st in enumerate(found):
        suffix = "" if len(found) == 1 else f"/{i}"
        for name, value in st.diagnostics._asdict().items():
            out[f"update/{name}{suffix}"] = value
    return out


def _is_compensated(x) -> bool:
    return isinstance(x, (KahanSummationState, KahanAdamWState))


def replace_compensation(opt_state: Any, compensation: Any) -> Any:
    """Return ``opt_state`` with the compensation of its (single) Kahan state replaced.

    The Kahan state is a :class:`KahanSummationState` (chains) or a :class:`KahanAdamWState` (``kahan_adamw``).

    Used with :func:`lpt.optim.compensation_from_f32` to start from an f32 checkpoint.
    """
    is_k = _is_compensated
    n = sum(1 for x in jax.tree.leaves(opt_state, is_leaf=is_k) if is_k(x))
    if n != 1:
        raise ValueError(f"expected exactly one KahanSummationState or KahanAdamWState in opt_state, found {n}")
    return jax.tree.map(lambda x: x._replace(compensation=compensation) if is_k(x) else x, opt_state, is_leaf=is_k)


def find_compensation(opt_state: Any) -> Any:
    """The compensation tree of the (single) ``KahanSummationState`` or ``KahanAdamWState`` in ``opt_state``."""
    is_k = _is_compensated
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_k) if is_k(x)]
    if len(found) != 1:
        raise ValueError(
            f"expected exactly one KahanSummationState or KahanAdamWState in opt_state, found {len(found)}"
        )
    return found[0].compensation
