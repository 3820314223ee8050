"""Adam moments stored in 16 bits, computed in f32, with rounding that survives ``jit``.

``optax.scale_by_adam`` keeps its moments in the param dtype (bf16 for bf16 params) and computes in that dtype, so
``ν ← b2·ν + (1 − b2)·g²`` is rounded to nearest every step: with b2 = 0.999 a change below half an ulp (2^-9
relative) is lost, and ν cannot decay. Here the moments are read as f32, updated in f32, and stored back through
:func:`lpt.numerics.round_nearest` or, by default, :func:`lpt.numerics.round_stochastic` (unbiased, so the EMA decays
in expectation like its f32 twin).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpt.kernels.adamw_kahan.math import f32, moment_update, round_moments, runtime_zero, v_floor
from lpt.numerics import round_nearest, round_stochastic
from lpt.numerics.random import key_words, path_id
from lpt.optim import moments8
from lpt.optim.leaves import leaf_name
from lpt.optim.moments8 import MOMENT8, Moment8

MOMENT_ROUNDINGS = ("stochastic", "nearest")
MOMENT_DTYPES = ("float32", "bfloat16", "float16")  # one number per element; 8-bit moments (MOMENT8) are block-scaled


def check_hyperparams(transform: str, **values) -> None:
    """ValueError if one of Adam's constants (``b1``, ``b2``, ``eps``, ``eps_root``) arrives as a float array
    narrower than float32, as ``optax.inject_hyperparams`` makes them for 16-bit params: b2 = 0.999 is 1.0 in
    bfloat16, and Adam's bias correction then divides by zero."""
    for name, v in values.items():
        dtype = getattr(v, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
            raise ValueError(
                f"{transform}: {name} arrived as a {jnp.dtype(dtype).name} array (b2 = 0.999 rounds to 1.0 in "
                f"bfloat16); give Adam's constants in float32: optax.inject_hyperparams(..., "
                f"hyperparam_dtype=jnp.float32), or static_args=('b1', 'b2', 'eps', ...) to keep them Python numbers"
            )


def moment_dtype_of(param_dtype, moment_dtype=None, *, block_scaled: bool = False) -> jnp.dtype | Moment8:
    """The dtype Adam's moments of a ``param_dtype`` parameter are stored in: ``moment_dtype``, else the param's own
    (float64 params keep float64 moments). With ``block_scaled`` (transforms that store them), the 8-bit names of
    :data:`lpt.optim.moments8.MOMENT8` give their :class:`~lpt.optim.moments8.Moment8`. ValueError for any other, e.g.
    an 8-bit dtype without a block scale: scaled into 8 bits as one number per element, the moments lose the loss
    (docs/results.md)."""
    if isinstance(moment_dtype, str) and moment_dtype in MOMENT8 and block_scaled:
        return MOMENT8[moment_dtype]
    allowed = MOMENT_DTYPES + (tuple(MOMENT8) if block_scaled else ())
    try:
        dt = jnp.dtype(param_dtype if moment_dtype is None else moment_dtype)
    except TypeError:
        raise ValueError(f"moment_dtype={moment_dtype!r}: Adam moments are stored in one of {allowed}") from None
    if dt.name in MOMENT_DTYPES or (moment_dtype is None and dt == jnp.float64):
        return dt
    given = (
        f"moment_dtype={dt.name!r}" if moment_dtype is not None else f"{dt.name} params (moments in the param dtype)"
    )
    hint = "" if block_scaled else " (8-bit moments with a block scale: kahan_adamw(moment_dtype='float8_e4m3fn'))"
    raise ValueError(f"{given}: Adam moments are stored in one of {allowed}; pass moment_dtype= one of them{hint}")


class ScaleByAdamState(NamedTuple):
    count: jax.Array  # int32 step count (bias correction, rounding key)
    mu: Any  # first moment, like params, in the moment dtype (8-bit: its uint8 codes)
    nu: Any  # second moment, like params, in the moment dtype (8-bit: its uint8 codes)
    scales: Any = None  # 8-bit moments: per block of the last axis, m's and v's f32 scales as complex64


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype=None,
    *,
    nesterov: bool = False,
    moment_dtype=None,
    rounding: str = "stochastic",
    seed: int = 0,
) -> optax.GradientTransformation:
    """Adam's preconditioning ``m̂ / (sqrt(v̂ + eps_root) + eps)`` with low-precision moments; the signature of
    ``optax.scale_by_adam`` plus keyword-only ``moment_dtype``, ``rounding`` and ``seed``.

    Per leaf, in f32: ``m = Q(b1·m + (1−b1)·g)``, ``v = Q(b2·v + (1−b2)·g²)``, ``m̂ = m·(1/(1−b1^t))``,
    ``v̂ = v·(1/(1−b2^t))`` (from the stored moments), ``u = m̂ / (sqrt(v̂ + eps_root) + eps)``; with ``nesterov``,
    ``m̂ = b1·m·(1/(1−b1^(t+1))) + (1−b1)·g·(1/(1−b1^t))`` (Dozat's NAdam, as optax). ``Q`` rounds into the
    moment's dtype: ``mu_dtype`` for m (as optax) else ``moment_dtype`` else the param dtype, and ``moment_dtype``
    else the param dtype for v (so bf16 params get bf16 moments: 4 bytes/param of state). ``Q`` is stochastic
    rounding keyed by ``(seed, step, leaf path, moment)`` or nearest rounding; bf16 moments share one hash word
    per element (m from its top 16 bits, v from its low 16: :func:`lpt.kernels.adamw_kahan.math.round_moments`).
    The update ``u`` is f32.

    Args:
      b1, b2: decay rates of m and v.
      eps: added to ``sqrt(v̂ + eps_root)``.
      eps_root: added to ``v̂`` inside the square root.
      mu_dtype: dtype of m (as optax); None: ``moment_dtype``'s rule. Not with 8-bit moments.
      nesterov: Nesterov momentum (NAdam).
      moment_dtype: "float32", "bfloat16", "float16" or an 8-bit name of :data:`lpt.optim.moments8.MOMENT8`; None:
        the param dtype (:func:`moment_dtype_of`).
      rounding: "stochastic" or "nearest" (:data:`MOMENT_ROUNDINGS`).
      seed: seed of the stochastic rounding keys.
    """
    if rounding not in MOMENT_ROUNDINGS:
        raise ValueError(f"rounding must be one of {MOMENT_ROUNDINGS}, got {rounding!r}")
    check_hyperparams("scale_by_adam", b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    spec8 = moment_dtype_of(jnp.float32, moment_dtype, block_scaled=True)
    if not isinstance(spec8, Moment8):
        spec8 = None
    elif mu_dtype is not None:
        raise ValueError(f"moment_dtype={moment_dtype!r} stores both moments in 8 bits; leave mu_dtype unset")

    def init_fn(params):
        def zeros(p, first):
            if spec8 is not None:
                return jnp.zeros(jnp.shape(p), jnp.uint8)
            dt = mu_dtype if first and mu_dtype is not None else moment_dtype
            return jnp.zeros(jnp.shape(p), moment_dtype_of(jnp.asarray(p).dtype, dt))

        mu = jax.tree.map(lambda p: zeros(p, True), params)
        scales = None if spec8 is None else jax.tree.map(lambda p: moments8.zeros(spec8, jnp.shape(p))[1], params)
        return ScaleByAdamState(jnp.zeros((), jnp.int32), mu, jax.tree.map(lambda p: zeros(p, False), params), scales)

    def store(x32, like, key):
        if like.dtype in (jnp.float32, jnp.float64):
            return x32.astype(like.dtype)
        if rounding == "stochastic":
            return round_stochastic(x32, like.dtype, key)  # f32 -> moment dtype (unbiased)
        return round_nearest(x32, like.dtype)  # f32 -> moment dtype (RNE)

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_int32_increment(state.count)
        t = count.astype(jnp.float32)  # int32 -> f32
        inv_c1 = 1.0 / (1.0 - f32(b1) ** t)  # bias corrections as reciprocals: the same bits on every
        inv_c2 = 1.0 / (1.0 - f32(b2) ** t)  # backend (XLA rewrites x / scalar into x * (1 / scalar))
        inv_c1_next = 1.0 / (1.0 - f32(b1) ** (t + 1.0))  # Nesterov's look-ahead correction
        step_key = jax.random.fold_in(jax.random.key(seed), count)
        zero = runtime_zero(count)  # keeps products out of FMAs: the same bits in every fusion (see no_fma)
        flat_g, treedef = jax.tree_util.tree_flatten_with_path(updates)
        flat_m, flat_v = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        flat_s = [None] * len(flat_m) if spec8 is None else treedef.flatten_up_to(state.scales)
        out_u, out_m, out_v, out_s = [], [], [], []
        for (path, g), m, v, s in zip(flat_g, flat_m, flat_v, flat_s, strict=True):
            key = jax.random.fold_in(step_key, path_id(leaf_name(path), bits=31))
            g32 = jnp.asarray(g).astype(jnp.float32)  # grad dtype -> f32
            km, kv = jax.random.split(key)
            if spec8 is not None:  # 8-bit codes with block scales
                m32, v32 = moment_update(g32, *moments8.load(spec8, m, v, s), zero, b1=b1, b2=b2)
                keys = dict(km=km, kv=kv) if rounding == "stochastic" else {}
                m_q, v_q, s = moments8.store(spec8, m32, v32, **keys)
                m32, v32 = moments8.load(spec8, m_q, v_q, s)  # the stored moments
                v32 = v_floor(m32, v32, b1=b1, b2=b2)  # an underflowed v read at Adam's bound
                out_s.append(s)
            else:
                m32, v32 = moment_update(g32, m.astype(jnp.float32), v.astype(jnp.float32), zero, b1=b1, b2=b2)
            if spec8 is not None:
                pass
            elif m.dtype == v.dtype == jnp.bfloat16:  # both from one hash word per element (see round_moments)
                mq32, vq32 = round_moments(m32, v32, stochastic=rounding == "stochastic", key_words=key_words(km))
                m_q, v_q = mq32.astype(jnp.bfloat16), vq32.astype(jnp.bfloat16)  # f32 -> bf16 (exact: on the grid)
            else:
                m_q, v_q = store(m32, m, km), store(v32, v, kv)
            if spec8 is None:
                # the update uses the stored (rounded) moments: what the next step will see, and on XLA:CPU it lets
                # the update fusion read the new moments instead of keeping copies of the old ones
                m32, v32 = m_q.astype(jnp.float32), v_q.astype(jnp.float32)  # moment dtype -> f32 (exact)
            m_hat = m32 * inv_c1
            if nesterov:
                m_hat = f32(b1) * (m32 * inv_c1_next) + f32(1.0 - b1) * (g32 * inv_c1)
            v_hat = v32 * inv_c2
            if not (isinstance(eps_root, (int, float)) and eps_root == 0):
                v_hat = v_hat + jnp.asarray(eps_root, jnp.float32)  # hyperparameter -> f32
            out_u.append(m_hat / (jnp.sqrt(v_hat) + f32(eps)))
            out_m.append(m_q)
            out_v.append(v_q)
        unf = treedef.unflatten
        return unf(out_u), ScaleByAdamState(count, unf(out_m), unf(out_v), None if spec8 is None else unf(out_s))

    return optax.GradientTransformation(init_fn, update_fn)
