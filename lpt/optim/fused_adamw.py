"""AdamW + Kahan-compensated update in ONE GradientTransformation: :func:`kahan_adamw`.

Same math as the composable chain ``scale_by_adam -> add_decayed_weights -> scale_by_learning_rate ->
kahan_summation`` (bit for bit, tested), see :mod:`lpt.kernels.adamw_kahan.kernel`. What differs is how XLA sees it:

* **Packed moments.** Both Adam moments of an element live in one integer (16-bit moments: one ``uint32``, m's bits
  high; f32 moments: one ``complex64``, m real, v imaginary). XLA:CPU has no multi-output
  fusion, so every output array costs one pass over memory: one moments array instead of two saves a pass.
  Same 4 bytes/param, same shape as the param (the state still shards like the params).
* **One materialized intermediate.** ``t = p + (u − c)`` feeds both outputs ``p' = Q(t)`` and ``c' = Q(p' − t)``.
  XLA duplicates cheap producers into each consumer but never an "expensive" one, so ``t`` is divided by a
  runtime 1.0 (``_runtime_one``; exact, ``x / 1 = x``) to make its last op a division: XLA then writes ``t`` once
  and both outputs read it, instead of recomputing the Adam step twice and copying the donated ``p`` and ``c``
  (which the two in-place outputs would otherwise overwrite under each other's feet).

Per low-precision leaf the compiled step (XLA:CPU) is 4 loop fusions and no copies: moments (reads g, mv; writes
mv), ``t`` (reads mv, p, c), ``p'`` (inside ``optax.apply_updates``: reads t, p) and ``c'`` (reads t).
``impl="pallas"`` runs :func:`lpt.kernels.adamw_kahan.kernel.adamw_kahan` instead: one pass for GPU/TPU, through
:func:`lpt.kernels.adamw_kahan.sharded.adamw_kahan_partitioned`, so that inside a jit over several devices each
device updates its own shard of every leaf (whatever the params' sharding; nothing is gathered) and draws the same
stochastic-rounding bits as one device would (they hash the element's global flat index).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from lpt import sharding
from lpt.kernels.adamw_kahan import math as K
from lpt.kernels.adamw_kahan import sharded
from lpt.kernels.adamw_kahan.options import LANES, StepOptions
from lpt.kernels.dispatch import kernel_mesh
from lpt.kernels.dispatch import mesh_platform as kernel_platform
from lpt.numerics import change_to, round_nearest, round_stochastic
from lpt.numerics.random import key_words, path_id
from lpt.optim import moments8 as M8
from lpt.optim.adam import MOMENT_ROUNDINGS, check_hyperparams, moment_dtype_of
from lpt.optim.leaves import (
    UpdateDiagnostics,
    check_trees,
    decay_mask,
    leaf_name,
    map_leaves,
    needs_rounding,
    zeros_like_rounded,
)

IMPLS = ("xla", "pallas")


class KahanAdamWState(NamedTuple):
    """State of :func:`kahan_adamw`; every tree mirrors the params (same shapes)."""

    count: jax.Array  # int32 step count
    moments: Any  # (m, v) packed per element: uint32 for 16-bit moments, complex64 for f32, uint16 for 8-bit codes
    compensation: Any  # Kahan compensation in the compensation dtype (f32 scalar placeholder for f32 leaves)
    diagnostics: UpdateDiagnostics | None
    scales: Any = None  # 8-bit moments: per block of the last axis, m's and v's f32 scales as complex64


def _uint(bits: int):
    return {16: jnp.uint16, 32: jnp.uint32}[bits]


def _packed_dtype(moment_dtype):
    """The dtype of one packed (m, v) pair: uint32 for 16-bit moments, complex64 for f32 moments."""
    size = np.dtype(moment_dtype).itemsize
    if size not in (2, 4):
        raise ValueError(f"kahan_adamw packs 16- or 32-bit moments, not {np.dtype(moment_dtype).name}")
    return jnp.dtype(jnp.complex64 if size == 4 else jnp.uint32)


def pack_moments(m32, v32, moment_dtype):
    """f32 moments already on ``moment_dtype``'s grid -> one packed array (exact)."""
    mdt = jnp.dtype(moment_dtype)
    if mdt == jnp.bfloat16:
        return K.pack_bf16_pair(m32, v32)
    bits = 8 * mdt.itemsize
    if bits == 32:
        return lax.complex(m32.astype(jnp.float32), v32.astype(jnp.float32))  # f32 -> complex64 (m + i·v)
    wide = _uint(2 * bits)
    m_b = lax.bitcast_convert_type(m32.astype(mdt), _uint(bits)).astype(wide)  # f32 -> mdt exact; bits widened
    v_b = lax.bitcast_convert_type(v32.astype(mdt), _uint(bits)).astype(wide)
    return (m_b << wide(bits)) | v_b


def unpack_moments(mv, moment_dtype):
    """Inverse of :func:`pack_moments`: packed array -> ``(m, v)`` as f32 (exact)."""
    mdt = jnp.dtype(moment_dtype)
    if mdt == jnp.bfloat16:
        return K.unpack_bf16_pair(mv)
    bits = 8 * mdt.itemsize
    if bits == 32:
        return jnp.real(mv), jnp.imag(mv)  # complex64 -> f32 parts
    narrow = _uint(bits)
    m = lax.bitcast_convert_type((mv >> mv.dtype.type(bits)).astype(narrow), mdt)  # high half -> mdt
    v = lax.bitcast_convert_type(mv.astype(narrow), mdt)  # low half (truncating convert) -> mdt
    return m.astype(jnp.float32), v.astype(jnp.float32)  # mdt -> f32, exact


def _runtime_one(p32, dep):
    """An all-ones f32 array XLA cannot constant-fold (``(bits | 1 | dep) != 0`` is always true).

    Dividing ``t`` by it is exact and makes ``t``'s root an expensive op, so XLA materializes ``t`` once instead of
    duplicating the AdamW math into the two outputs (a division by a broadcast scalar would be rewritten into a
    cheap multiplication and duplicated again). LLVM sees the constant and drops the division, so it costs nothing.
    ``dep`` (a u32 scalar taken from the previous leaf's new compensation) orders the leaves one after another, so
    the f32 ``t`` buffers are reused: the transient memory is that of <= 3 leaves' ``t`` (4 bytes/param of the
    largest leaves), not of the whole tree."""
    nonzero = (lax.bitcast_convert_type(p32, jnp.uint32) | jnp.uint32(1) | dep) != jnp.uint32(0)
    return nonzero.astype(jnp.float32)  # bool -> f32


def _narrow_exact(x32, dtype):
    """f32 values already on ``dtype``'s grid -> ``dtype``. For bf16 the top 16 bits (a shift: the values need no
    rounding, which XLA's generic convert would still compute); other dtypes use ``astype`` (exact here too)."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        bits = (lax.bitcast_convert_type(x32, jnp.uint32) >> jnp.uint32(16)).astype(jnp.uint16)  # f32 bits -> high half
        return lax.bitcast_convert_type(bits, jnp.bfloat16)  # u16 -> bf16
    return x32.astype(dtype)  # f32 -> dtype, exact on the grid


def _leaf_keys(step_key, names):
    """``split(fold_in(step_key, path_id(name, bits=31)))`` for every leaf, computed as one batched (vmapped)
    threefry call instead of one small call per leaf: the same keys, fewer tiny ops for XLA to run every step."""
    if not names:
        return []
    ids = jnp.asarray([path_id(n, bits=31) for n in names], jnp.uint32)
    pairs = jax.vmap(lambda i: jax.random.split(jax.random.fold_in(step_key, i)))(ids)  # [n, 2] keys
    return [(pairs[i, 0], pairs[i, 1]) for i in range(len(names))]


def kahan_adamw(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask=None,
    weight_decay_mask=None,
    grad_clip: float | None = None,
    moment_dtype=None,
    moment_rounding: str = "stochastic",
    compensation_dtype=None,
    seed: int = 0,
    diagnostics: bool = False,
    impl: str = "xla",
    interpret: bool | None = None,
    sequential_leaves: bool = True,
    param_specs=None,
) -> optax.GradientTransformation:
    """bf16 AdamW + Kahan in one fused transform: bf16 params, moments and compensation, 8 bytes/param.

    ``impl="xla"`` gives the same numbers as ``adamw(..., update="kahan")`` with the same arguments, bit for bit in
    params, compensation and moments, for a constant learning rate or a schedule (both keep every product that feeds
    an add out of FMAs; tested over 120 steps), computed in fewer passes over memory (module doc); its state is a
    :class:`KahanAdamWState` with the two moments packed per element. Like every lpt update rule it emits
    the change ``new_p − p`` in the param's dtype (:mod:`lpt.optim.leaves`); f32/f64 leaves get plain AdamW in f32.

    ``mask`` (``weight_decay_mask`` is an alias): None (decay every leaf), a tree of bools like the params, or a
    callable ``params -> tree of bools`` (as optax's): False leaves get no decay. With ``grad_clip`` the result is
    ``optax.chain(clip_by_global_norm(grad_clip), <fused>)``.

    ``impl="pallas"`` runs the fused Pallas kernel (GPU/TPU) on the rounded leaves, which must then have bf16 params,
    moments and compensation, or bf16 params and compensation with 8-bit moments (``moment_dtype`` of
    :data:`lpt.optim.moments8.MOMENT8`) on leaves whose last axis is a multiple of 128 (ValueError naming the leaf
    otherwise; the same numbers as ``impl="xla"``, bit for bit in interpret mode); ``interpret`` is passed to the
    kernel (None: per platform, True: the Pallas interpreter everywhere). ``param_specs`` (``impl="pallas"``): a
    tree like the params of their PartitionSpecs or NamedShardings; each leaf's kernel then runs per shard in a
    ``shard_map`` over the mesh in context (8-bit moments: the scales split like the param, a shard holding whole
    blocks of 128) (:func:`lpt.kernels.adamw_kahan.sharded.adamw_kahan_on_shards`). Without it, on a mesh with
    Explicit axes (the default of ``jax.make_mesh``) each leaf runs per shard of the sharding in its type; otherwise
    ``custom_partitioning`` follows whatever sharding the partitioner picks
    (:func:`~lpt.kernels.adamw_kahan.sharded.adamw_kahan_partitioned`) on GPUs and CPUs; XLA:TPU cannot partition that
    call, so on a TPU mesh with Auto axes and no ``param_specs`` it is a ValueError that says to pass them.

    ``sequential_leaves`` (XLA path) chains the leaves through one element of each leaf's new compensation so the
    f32 temporaries of <= 3 leaves exist at a time (see ``_runtime_one``); on a multi-device mesh that element costs
    one scalar all-reduce + all-gather per leaf and step: pass False there to avoid them (the transient is then 4
    bytes/param of the whole tree) or use ``impl="pallas"``.

    Args:
      learning_rate: a float or an optax schedule of the step count.
      b1, b2, eps: Adam's decay rates and epsilon, as :func:`lpt.optim.scale_by_adam`; Python numbers with
        ``impl="pallas"``.
      weight_decay: decoupled weight decay; a Python number with ``impl="pallas"``.
      mask, weight_decay_mask: the decay mask (above); give at most one.
      grad_clip: global-norm clip applied first; None: no clipping.
      moment_dtype: as :func:`lpt.optim.scale_by_adam`; None: the param dtype.
      moment_rounding: "stochastic" or "nearest".
      compensation_dtype: dtype of the Kahan compensation; None: the param's own (as
        :func:`lpt.optim.kahan_summation`).
      seed: seed of the stochastic rounding keys.
      diagnostics: keep an :class:`lpt.optim.leaves.UpdateDiagnostics` of the last step in the state.
      impl: "xla" or "pallas".
      interpret: ``impl="pallas"`` only (above).
      sequential_leaves: the XLA path's leaf chaining (above).
      param_specs: ``impl="pallas"`` only: a tree like the params of PartitionSpecs or NamedShardings (above).
    """
    weight_decay_mask = decay_mask(mask, weight_decay_mask)
    if moment_rounding not in MOMENT_ROUNDINGS:
        raise ValueError(f"moment_rounding must be one of {MOMENT_ROUNDINGS}, got {moment_rounding!r}")
    check_hyperparams("kahan_adamw", b1=b1, b2=b2, eps=eps)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    stochastic = moment_rounding == "stochastic"
    if impl == "pallas" and not all(isinstance(h, (int, float)) for h in (b1, b2, eps, weight_decay)):
        raise ValueError(
            "kahan_adamw(impl='pallas') compiles b1, b2, eps and weight_decay into the kernel: they must be Python "
            "numbers (with optax.inject_hyperparams, inject only the learning rate: static_args=('b1', 'b2', 'eps', "
            "'weight_decay', ...))"
        )

    def mdt_of(pdt):
        return moment_dtype_of(pdt, moment_dtype, block_scaled=True)

    eight_bit = isinstance(mdt_of(jnp.bfloat16), M8.Moment8)

    def cdt_of(pdt):
        return jnp.dtype(pdt if compensation_dtype is None else compensation_dtype)

    def init_fn(params):
        def moments(p):
            p = jnp.asarray(p)
            needs_rounding(p.dtype)  # raises for unsupported dtypes
            mdt = mdt_of(p.dtype)
            if isinstance(mdt, M8.Moment8):
                return jnp.zeros(p.shape, jnp.uint16)  # both moments' 8-bit codes (M8.pack_codes)
            return jnp.zeros(p.shape, _packed_dtype(mdt))

        scales = None
        if eight_bit:
            scales = jax.tree.map(lambda p: M8.zeros(mdt_of(jnp.asarray(p).dtype), jnp.shape(p))[1], params)
        return KahanAdamWState(
            count=jnp.zeros((), jnp.int32),
            moments=jax.tree.map(moments, params),
            compensation=zeros_like_rounded(params, cdt_of),
            diagnostics=UpdateDiagnostics(*(jnp.zeros((), jnp.float32),) * 3) if diagnostics else None,
            scales=scales,
        )

    def update_fn(updates, state, params=None):
        check_trees("kahan_adamw", updates, params)
        count = optax.safe_int32_increment(state.count)
        t_f = count.astype(jnp.float32)  # int32 -> f32
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        sc = _Scalars(
            inv_c1=1.0 / (1.0 - K.f32(b1) ** t_f),  # as lpt.optim.scale_by_adam
            inv_c2=1.0 / (1.0 - K.f32(b2) ** t_f),
            neg_lr=jnp.asarray(-1 * lr).astype(jnp.float32),  # schedule value -> f32 (as optax's scale_by_schedule)
            zero=K.runtime_zero(count),
        )
        step_key = jax.random.fold_in(jax.random.key(seed), count)
        flat_p, treedef = jax.tree_util.tree_flatten_with_path(params)
        specs = treedef.unflatten([None] * len(flat_p)) if param_specs is None else param_specs
        decays = treedef.unflatten(_decay_flags(weight_decay_mask, params, treedef))
        keys = treedef.unflatten(_leaf_keys(step_key, [leaf_name(path) for path, _ in flat_p]))
        dep = jnp.uint32(0)

        def leaf(name, p, g, mv, c, *rest):
            nonlocal dep
            scl, (decay, spec, leaf_keys) = (rest[0], rest[1:]) if eight_bit else (None, rest)
            hp = dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay if decay else 0.0)
            mdt, cdt = mdt_of(p.dtype), cdt_of(p.dtype)
            if impl == "pallas" and needs_rounding(p.dtype):
                _check_pallas_leaf(name, p, mdt, cdt)
                moments8 = (mdt.m_format, mdt.v_format, mdt.v_sqrt) if isinstance(mdt, M8.Moment8) else None
                options = StepOptions(**hp, stochastic=stochastic, moments8=moments8, interpret=interpret)
                delta, (new_mv, scl), new_c, u = _pallas_leaf(g, p, c, (mv, scl), sc, leaf_keys, options, mdt, spec)
            else:
                delta, (new_mv, scl), new_c, u, dep = _xla_leaf(
                    g, p, c, (mv, scl), sc, leaf_keys, hp, mdt, cdt, dep, stochastic, sequential_leaves
                )
            return delta, (new_mv, new_c) + ((scl,) if eight_bit else ()), u

        extra = (state.scales,) if eight_bit else ()
        deltas, (moments, compensation, *scales), diag = map_leaves(
            "kahan_adamw",
            leaf,
            updates,
            params,
            state.moments,
            state.compensation,
            *extra,
            inputs=(decays, specs, keys),
            diagnostics=diagnostics,
        )
        return deltas, KahanAdamWState(count, moments, compensation, diag, scales[0] if eight_bit else None)

    fused = optax.GradientTransformation(init_fn, update_fn)
    return fused if grad_clip is None else optax.chain(optax.clip_by_global_norm(grad_clip), fused)


class _Scalars(NamedTuple):
    """The step's f32 scalars shared by every leaf."""

    inv_c1: jax.Array  # 1 / (1 − b1^t)
    inv_c2: jax.Array  # 1 / (1 − b2^t)
    neg_lr: jax.Array  # −learning rate
    zero: jax.Array  # a runtime 0.0 (keeps XLA from folding products into FMAs, see lpt.kernels.adamw_kahan.math)


def _round_moment(x32, mdt, key, stochastic: bool):
    if mdt.itemsize >= 4:
        return x32.astype(mdt).astype(jnp.float32)  # f32 moments: no rounding (f64 -> f32 view)
    if stochastic:
        return round_stochastic(x32, mdt, key, out_dtype=jnp.float32)
    return round_nearest(x32, mdt, out_dtype=jnp.float32)


def _check_pallas_leaf(name, p, mdt, cdt) -> None:
    """ValueError unless the kernel takes this rounded leaf: bf16 param and compensation, and bf16 moments or 8-bit
    ones (blocks of 128) on a last axis that is a multiple of 128."""
    eight = isinstance(mdt, M8.Moment8)
    if not (p.dtype == cdt == jnp.bfloat16 and ((eight and mdt.block == LANES) or mdt == jnp.bfloat16)):
        raise ValueError(
            f"kahan_adamw(impl='pallas') needs bf16 params, moments and compensation (or 8-bit moments in blocks "
            f"of 128); {name} has param {p.dtype}, moments {mdt}, compensation {cdt} (use impl='xla')"
        )
    if eight and (p.ndim == 0 or p.shape[-1] % LANES):
        raise ValueError(
            f"kahan_adamw(impl='pallas') with 8-bit moments needs a last axis that is a multiple of {LANES}; "
            f"{name} has shape {p.shape} (use impl='xla')"
        )


def _pallas_leaf(g, p, c, mv, sc: _Scalars, keys, options: StepOptions, mdt, spec):
    """One bf16 leaf through the fused kernel: ``(update, (moments', scales'), compensation', intended update
    thunk)``; ``mv`` is ``(moments, scales)`` (scales None for 16-bit moments)."""

    mv, scl = mv
    eight = isinstance(mdt, M8.Moment8)
    if eight:  # m's and v's key words: the bits M8.store draws with keys (km, kv)
        words = jnp.concatenate([key_words(keys[0])[:2], key_words(keys[1])[:2]])
    else:  # one hash word per element for both moments (K.round_moments)
        words = key_words(keys[0])
    scalars = jnp.stack([sc.inv_c1, sc.inv_c2, sc.neg_lr, lax.bitcast_convert_type(sc.zero, jnp.float32)])
    mesh = kernel_mesh(None)
    if mesh is not None and mesh.size > 1 and sharding.explicit(mesh):
        # typed shardings: the leaf's own split (unless param_specs names one), its gradient and state laid out like it
        if spec is None:
            spec = sharding.operand_spec(p, (None,) * p.ndim, mesh, "kahan_adamw(impl='pallas')")
        spec = jax.sharding.PartitionSpec(*getattr(spec, "spec", spec))
        if eight:  # the scales split like the param (checked: a shard holds whole blocks)
            sharded.check_whole_blocks(p.shape, spec, mesh)
            scl = jax.sharding.reshard(scl, spec)
        g, p, c, mv = (jax.sharding.reshard(x, spec) for x in (g, p, c, mv))
    if spec is None:
        if mesh is not None and mesh.size > 1 and kernel_platform(mesh) == "tpu":
            raise ValueError(
                "kahan_adamw(impl='pallas') on a TPU mesh with Auto axes needs param_specs (a tree like the params of "
                "their PartitionSpecs or NamedShardings) or Explicit mesh axes: XLA:TPU cannot run the "
                "custom_partitioning call that finds each leaf's split otherwise"
            )
        out = sharded.adamw_kahan_partitioned(g, p, c, mv, scalars, words, scl, options=options)
    else:
        out = sharded.adamw_kahan_on_shards(g, p, c, mv, scalars, words, scl, options=options, spec=spec)
    new_p, new_c, new_mv = out[:3]
    new_scl = out[3] if eight else None
    p32 = p.astype(jnp.float32)  # bf16 -> f32 (exact)
    delta = change_to(p32, new_p.astype(jnp.float32), p.dtype)  # bf16 -> f32 (exact)

    def intended():
        if eight:
            mq, vq = M8.load(mdt, *M8.unpack_codes(new_mv), new_scl)
            vq = K.v_floor(mq, vq, b1=options.b1, b2=options.b2)
        else:
            mq, vq = K.unpack_bf16_pair(new_mv)
        dhp = dict(eps=options.eps, weight_decay=options.weight_decay)
        return sc.neg_lr * K.adamw_direction(mq, vq, p32, sc.inv_c1, sc.inv_c2, sc.zero, **dhp)

    return delta, (new_mv, new_scl), new_c, intended


def _direction_hp(hp: dict) -> dict:
    return {k: hp[k] for k in ("eps", "weight_decay")}


def _xla_leaf(g, p, c, mv, sc: _Scalars, keys, hp: dict, mdt, cdt, dep, stochastic: bool, sequential: bool):
    """One leaf in XLA: ``(update, moments', compensation', intended update thunk, dep')``.

    Rounded leaves take the Kahan step; f32/f64 leaves plain AdamW with no compensation. With ``sequential`` the
    next leaf's target waits for this leaf's compensation through ``dep`` (see :func:`_runtime_one`)."""
    km, kv = keys
    g32 = g.astype(jnp.float32)  # grad dtype -> f32
    p32 = p.astype(jnp.float32)  # param dtype -> f32 (exact)
    mv, scl = mv
    if isinstance(mdt, M8.Moment8):  # 8-bit codes with block scales
        m_old, v_old = M8.load(mdt, *M8.unpack_codes(mv), scl)
        m_new, v_new = K.moment_update(g32, m_old, v_old, sc.zero, b1=hp["b1"], b2=hp["b2"])
        mc, vc, scl = M8.store(mdt, m_new, v_new, **(dict(km=km, kv=kv) if stochastic else {}))
        mv_new = M8.pack_codes(mc, vc)
        mq, vq = M8.load(mdt, mc, vc, scl)  # the stored moments
        vq = K.v_floor(mq, vq, b1=hp["b1"], b2=hp["b2"])  # an underflowed v read at Adam's bound
    else:
        m_new, v_new = K.moment_update(g32, *unpack_moments(mv, mdt), sc.zero, b1=hp["b1"], b2=hp["b2"])
        if mdt == jnp.bfloat16:  # one hash word per element for both moments (K.round_moments)
            mq, vq = K.round_moments(m_new, v_new, stochastic=stochastic, key_words=key_words(km))
        else:
            mq, vq = _round_moment(m_new, mdt, km, stochastic), _round_moment(v_new, mdt, kv, stochastic)
        mv_new = pack_moments(mq, vq, mdt)
        mq, vq = unpack_moments(mv_new, mdt)  # read back the stored moments: XLA reuses their pass
    mv_new = (mv_new, scl)
    dhp = _direction_hp(hp)
    intended = lambda: sc.neg_lr * K.adamw_direction(mq, vq, p32, sc.inv_c1, sc.inv_c2, sc.zero, **dhp)
    if not needs_rounding(p.dtype):  # f32/f64 leaf: plain AdamW, no compensation
        u = intended()  # f32 (as the chain's update)
        return u, mv_new, c, lambda: u, dep
    c32 = c.astype(jnp.float32)  # compensation dtype -> f32 (exact)
    direction = K.adamw_direction(mq, vq, p32, sc.inv_c1, sc.inv_c2, sc.zero, **dhp)
    t = K.kahan_target(direction, p32, c32, sc.neg_lr, sc.zero) / _runtime_one(p32, dep)
    s32, c_new32 = K.kahan_round(t, p.dtype, cdt)
    if sequential and c_new32.size:  # next leaf's t waits for this c': t's buffer is reused
        dep = lax.bitcast_convert_type(c_new32.reshape(-1)[0], jnp.uint32)  # f32 -> u32 bits
    delta = change_to(p32, s32, p.dtype)
    return delta, mv_new, _narrow_exact(c_new32, cdt), intended, dep  # f32 -> compensation dtype (exact)


def _decay_flags(mask, params, treedef) -> list[bool]:
    """One Python bool per leaf: does decoupled weight decay apply (optax-style ``mask``: None, tree, callable)."""
    if mask is None:
        return [True] * treedef.num_leaves
    tree = mask(params) if callable(mask) else mask
    try:
        flags = treedef.flatten_up_to(tree)
    except ValueError as e:
        raise ValueError(f"weight_decay_mask must have the params' tree structure {treedef}: {e}") from None
    for f in flags:
        if not isinstance(f, (bool, np.bool_)):
            raise ValueError(f"weight_decay_mask leaves must be Python bools (static), got {type(f).__name__}")
    return [bool(f) for f in flags]


def kahan_adamw_moments(state: KahanAdamWState, moment_dtype=jnp.bfloat16) -> tuple[Any, Any]:
    """The first and second moments of a :class:`KahanAdamWState` as f32 trees (for logging and inspection).

    ``moment_dtype`` names the 16-bit float the integer-packed leaves hold (complex64 leaves are f32 moments)."""

    def one(mv, which):
        mdt = jnp.float32 if jnp.iscomplexobj(mv) else moment_dtype
        return unpack_moments(mv, mdt)[which]

    return jax.tree.map(lambda mv: one(mv, 0), state.moments), jax.tree.map(lambda mv: one(mv, 1), state.moments)
