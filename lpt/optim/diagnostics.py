"""Find the lpt states inside any optax chain state: read their diagnostics, swap their compensation, convert the
storage of their Adam moments."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lpt.numerics import round_nearest
from lpt.optim import moments8 as M8
from lpt.optim.adam import ScaleByAdamState, moment_dtype_of
from lpt.optim.fused_adamw import KahanAdamWState, pack_moments, unpack_moments
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


def convert_moments(opt_state: Any, from_dtype, to_dtype) -> Any:
    """``opt_state`` with the Adam moments of every :class:`KahanAdamWState` and :class:`ScaleByAdamState` in it
    re-stored from ``from_dtype`` into ``to_dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"`` or an 8-bit name of
    :data:`lpt.optim.moments8.MOMENT8`), rounded to nearest: start a run's next phase with 8-bit moments from a
    16- or 32-bit state, or read 8-bit moments back into a wider one. Both dtypes are named because the stored arrays
    do not say which 16-bit float or which 8-bit variant they hold. Build the optimizer with ``moment_dtype=to_dtype``
    to continue from the result. Going wider is exact; going narrower rounds each moment once, as a step would."""
    src = moment_dtype_of(jnp.float32, from_dtype, block_scaled=True)
    dst = moment_dtype_of(jnp.float32, to_dtype, block_scaled=True)

    def narrow(m32, v32):
        """f32 moments -> (first stored array, second stored array or None, scales or None) in ``dst``."""
        if isinstance(dst, M8.Moment8):
            return M8.store(dst, m32, v32)
        m = round_nearest(m32, dst, out_dtype=jnp.float32)  # f32 -> dst's grid (kept as f32)
        return m, round_nearest(v32, dst, out_dtype=jnp.float32), None

    def fused(st: KahanAdamWState) -> KahanAdamWState:
        treedef = jax.tree.structure(st.moments)
        flat_s = treedef.flatten_up_to(st.scales) if st.scales is not None else [None] * treedef.num_leaves
        moments, new_scales = [], []
        for mv, sc in zip(treedef.flatten_up_to(st.moments), flat_s, strict=True):
            if isinstance(src, M8.Moment8):
                m32, v32 = M8.load(src, *M8.unpack_codes(mv), sc)
            else:
                m32, v32 = unpack_moments(mv, src)
            a, b, s = narrow(m32, v32)
            moments.append(M8.pack_codes(a, b) if s is not None else pack_moments(a, b, dst))
            new_scales.append(s)
        out, scales = treedef.unflatten(moments), treedef.unflatten(new_scales)
        return st._replace(moments=out, scales=scales if new_scales and new_scales[0] is not None else None)

    def adam(st: ScaleByAdamState) -> ScaleByAdamState:
        treedef = jax.tree.structure(st.mu)
        flat_s = treedef.flatten_up_to(st.scales) if st.scales is not None else [None] * treedef.num_leaves
        mus, nus, scales = [], [], []
        for m, v, sc in zip(treedef.flatten_up_to(st.mu), treedef.flatten_up_to(st.nu), flat_s, strict=True):
            if isinstance(src, M8.Moment8):
                m32, v32 = M8.load(src, m, v, sc)
            else:
                m32, v32 = m.astype(jnp.float32), v.astype(jnp.float32)  # moment dtype -> f32 (exact)
            a, b, s = narrow(m32, v32)
            if s is None:
                a, b = a.astype(dst), b.astype(dst)  # f32 on dst's grid -> dst (exact)
            mus.append(a)
            nus.append(b)
            scales.append(s)
        unf = treedef.unflatten
        return st._replace(mu=unf(mus), nu=unf(nus), scales=unf(scales) if scales and scales[0] is not None else None)

    is_adam = lambda x: isinstance(x, (KahanAdamWState, ScaleByAdamState))
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x)]
    if not found:
        raise ValueError("convert_moments: no KahanAdamWState or ScaleByAdamState in opt_state")

    def one(x):
        if isinstance(x, KahanAdamWState):
            return fused(x)
        if isinstance(x, ScaleByAdamState):
            return adam(x)
        return x

    return jax.tree.map(one, opt_state, is_leaf=is_adam)
