"""``dot_product_attention``: stabilized flash attention with a numerics policy, GQA, causal and padding masks.

Math: ``O[b, i, h] = Σ_j softmax_j(scale · q[b, i, h] · k[b, j, h // G]) v[b, j, h // G]`` over the keys j that query
i may attend (same segment id, key not padded, j ≤ i if causal, and i − w < j with a sliding window of w keys),
G = H / Hkv. A query without any such key gets O = 0 and zero gradients. The flash kernel skips the key blocks
outside a sliding window (O(T·w) work); the XLA twin masks them.

The forward runs the online-softmax block loop of :mod:`lpt.kernels.flash_attention.math` (XLA twin or Pallas
kernel); the backward is FA2's, with δ = rowsum(dO ∘ O_residual) where the residual O is chosen by the policy
(the quantity Qiu & Yao trace the loss explosions to).

With ``impl="pallas"`` or ``"mosaic_gpu"`` under a multi-device mesh (``mesh=`` or ``jax.set_mesh``) each kernel
call runs per shard (:func:`lpt.kernels.dispatch.shard_map`): q, dO, O [B, H, T, D] split as P(batch, heads, None,
None), k, v, dk, dv [B, Hkv, T, D] as P(batch, kv_heads, None, None), segments [B, T] as P(batch, None), lse and δ
[B, H, T] as P(batch, heads, None), the logical names resolved by :func:`lpt.sharding.kernel_spec`. Attention is
independent per (batch row, head), so no shard talks to another and nothing is all-gathered.

``impl="cudnn"`` (``"auto"`` on a GPU for the standard policy where cuDNN takes the call) runs
:mod:`lpt.attention.cudnn` on the arrays as given, after this module's checks.

``impl="mosaic_gpu"`` runs the Hopper kernels of :mod:`lpt.kernels.flash_attention.mosaic_gpu` (block_q = 64 query
rows per CTA, block_k of :func:`mosaic_gpu_block_k`). They compile for CUDA only and cannot be chosen per platform
(``lax.platform_dependent``), so ``interpret`` is explicit there: None or False compiles them (lowering for another
platform is a ValueError saying to pass ``interpret=True``), True runs the Mosaic GPU interpreter. They get segment
ids only when some are needed (given segments, a kv mask, or padding): the kernels are cheaper without.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from lpt import sharding
from lpt.attention import cudnn
from lpt.kernels import dispatch
from lpt.kernels.flash_attention import kernel as fk
from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention import mosaic_gpu as mg
from lpt.kernels.flash_attention import reference as fr
from lpt.kernels.flash_attention.options import FlashOptions

_IMPLS = ("auto", "xla", "pallas", "softmax", "mosaic_gpu", "cudnn")
_KERNELS = ("pallas", "mosaic_gpu")  # the impls that run kernels per shard under a mesh
_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class _Options:
    """The options of one public call as given. :func:`_canonical` resolves them: a None policy from stable and beta,
    a None scale from D, None blocks from T; interpret and mesh pass on as given (None: by platform / the
    ``jax.set_mesh`` mesh)."""

    causal: bool = True
    sliding_window: int = 0
    stable: bool = True
    beta: float = 7.0
    policy: fm.AttentionPolicy | None = None  # overrides stable and beta
    impl: str = "auto"
    scale: float | None = None
    block_q: int | None = None
    block_k: int | None = None
    interpret: bool | None = None
    mesh: object = None


@dataclasses.dataclass(frozen=True)
class _Config:
    """The static config of the canonical operands (resolved from :class:`_Options`; the custom VJP's static
    argument)."""

    options: FlashOptions  # what the kernels (and the twin) compute and how; interpret: "mosaic_gpu" True or False
    impl: str
    mesh: object = None  # the kernels' mesh (None: whole arrays)
    specs: tuple | None = None  # PartitionSpecs (q, kv, segments, lse) on ``mesh``


def _kernel_specs(q, k, v, mesh, impl: str) -> tuple | None:
    """PartitionSpecs ``(q, kv, segments, lse)`` of the kernel operands (``[B, H, T, D]`` layout) on ``mesh``, from
    ``q, k, v`` ``[B, T, H, D]`` (:func:`lpt.sharding.operand_spec`: their own shardings on Explicit mesh axes, the
    rules on Auto ones); None without a multi-device mesh.

    Raises ValueError if B, H or Hkv does not divide by the mesh axes it is split over, if a sequence or head_dim is
    split (the kernel needs whole rows), if k and v are split differently, or if the query and kv heads are split
    over different axes (each shard must hold whole GQA groups)."""
    if mesh is None or mesh.size == 1:
        return None
    what = f"dot_product_attention(impl={impl!r})"
    qs = sharding.operand_spec(q, ("batch", None, "heads", None), mesh, what)
    ks = sharding.operand_spec(k, ("batch", None, "kv_heads", None), mesh, what)
    vs = sharding.operand_spec(v, ("batch", None, "kv_heads", None), mesh, what)
    for name, spec in (("q", qs), ("k", ks), ("v", vs)):
        for dim, label in ((1, "sequence"), (3, "head_dim")):
            if spec[dim] is not None:
                raise ValueError(
                    f"{what}: {name}'s {label} (dim {dim}) is split over {dispatch.as_axes(spec[dim])}; the flash "
                    f"kernel needs it whole on each device: split only batch (dim 0) and heads (dim 2)"
                )
    if ks != vs or qs[0] != ks[0]:
        raise ValueError(
            f"{what}: q, k, v must share their batch split and k, v their heads split; got {qs}, {ks}, {vs}"
        )
    b, _, h, _ = q.shape
    hkv = k.shape[2]
    for name, size, axes in (("batch", b, qs[0]), ("heads", h, qs[2]), ("kv_heads", hkv, ks[2])):
        dispatch.check_divisible(name, size, mesh, axes)
    if qs[2] != ks[2]:
        raise ValueError(f"heads are split over {qs[2]} but kv_heads over {ks[2]}; they must match")
    P = jax.sharding.PartitionSpec
    return P(qs[0], qs[2], None, None), P(ks[0], ks[2], None, None), P(qs[0], None), P(qs[0], qs[2], None)


_NOT_CUDA = (
    "dot_product_attention(impl='mosaic_gpu') compiles the Hopper kernels for CUDA only, but this program is lowered "
    "for {platform}: pass interpret=True (the Mosaic GPU interpreter) or run it on a Hopper GPU"
)


def _mosaic_gpu(fn, cfg: _Config, args, in_specs, out_specs):
    """``fn`` (a Mosaic GPU kernel entry) on ``args``, per shard under ``cfg``'s mesh; compiled (``args`` checked to
    be lowered for CUDA) unless ``cfg.options.interpret``. Segment operands that are None (none needed) are left out."""
    kept = [i for i, x in enumerate(args) if x is not None]
    xs = tuple(args[i] for i in kept)
    if not cfg.options.interpret:
        xs = dispatch.require_platform(("cuda",), _NOT_CUDA, *xs)

    def call(*xs):  # the kept operands, the left-out ones None again
        full = [None] * len(args)
        for i, x in zip(kept, xs, strict=True):
            full[i] = x
        return fn(*full, options=cfg.options)

    if cfg.specs is not None:
        call = dispatch.shard_map(call, cfg.mesh, [in_specs[i] for i in kept], out_specs)
    return call(*xs)


def _forward(q, k, v, q_seg, kv_seg, cfg: _Config):
    """(f32 O, lse) of the canonical operands by ``cfg.impl``: a flash kernel (per shard under a mesh) or the XLA
    twin."""
    if cfg.impl == "mosaic_gpu":
        qs, kvs, segs, lses = cfg.specs or (None,) * 4
        return _mosaic_gpu(mg.forward, cfg, (q, k, v, q_seg, kv_seg), (qs, kvs, kvs, segs, segs), (qs, lses))
    if cfg.impl == "pallas":
        run = functools.partial(fk.forward, options=cfg.options)
        if cfg.specs is not None:
            qs, kvs, segs, lses = cfg.specs
            run = dispatch.shard_map(run, cfg.mesh, (qs, kvs, kvs, segs, segs), (qs, lses))
        return run(q, k, v, q_seg, kv_seg)
    return fr.reference_forward(q, k, v, q_seg, kv_seg, options=cfg.options)


def _backward(q, k, v, q_seg, kv_seg, lse, do, delta, cfg: _Config):
    if cfg.impl == "mosaic_gpu":
        qs, kvs, segs, lses = cfg.specs or (None,) * 4
        args = (q, k, v, q_seg, kv_seg, lse, do, delta)
        return _mosaic_gpu(mg.backward, cfg, args, (qs, kvs, kvs, segs, segs, lses, qs, lses), (qs, kvs, kvs))
    if cfg.impl == "pallas":
        run = functools.partial(fk.backward, options=cfg.options)
        if cfg.specs is not None:
            qs, kvs, segs, lses = cfg.specs
            run = dispatch.shard_map(run, cfg.mesh, (qs, kvs, kvs, segs, segs, lses, qs, lses), (qs, kvs, kvs))
        return run(q, k, v, q_seg, kv_seg, lse, do, delta)
    return fr.reference_backward(q, k, v, q_seg, kv_seg, lse, do, delta, options=cfg.options)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, q_seg, kv_seg, key, cfg: _Config):
    return _flash_fwd(q, k, v, q_seg, kv_seg, key, cfg)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, key, cfg: _Config):
    o32, lse = _forward(q, k, v, q_seg, kv_seg, cfg)
    out, o_res = fm.residual_and_output(o32, q.dtype, cfg.options.policy, key)
    return out, (q, k, v, q_seg, kv_seg, o_res, lse)


def _flash_bwd(cfg: _Config, res, do):
    q, k, v, q_seg, kv_seg, o_res, lse = res
    delta = _rowsum(do.astype(jnp.float32) * o_res.astype(jnp.float32))  # dO, O residual -> f32
    dq, dk, dv = _backward(q, k, v, q_seg, kv_seg, lse, do, delta, cfg)
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))  # f32 -> input dtype (RNE)
    return (*grads, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _rowsum(x: jax.Array) -> jax.Array:
    """Sum over the last axis as a fixed pairwise tree (zero-padded to a power of two, halves added elementwise).

    XLA's reduce order depends on the shapes it sees (a per-shard [B/n, H/m, T, D] reduce rounds differently from
    the global one), so δ, and with it every gradient, would depend on the mesh; this order does not."""
    x = _pad_to(x, 1 << (x.shape[-1] - 1).bit_length(), x.ndim - 1, 0)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def _default_block(t: int) -> int:
    """min(128, next power of two >= max(t, 16)): the padding granularity and the block of the XLA twin and the
    interpreter; the compiled kernels grow or split it per platform (:func:`lpt.kernels.flash_attention.tiles.tiles`:
    512 on TPU, 64 or 128 on GPU)."""
    return min(128, 1 << max(4, (t - 1).bit_length()))


def mosaic_gpu_block_k(d: int, tq: int, tk: int) -> int:
    """The Mosaic GPU kernels' block_k for head dim ``d``: 128 where the backward's registers allow it (D · 128 <=
    :data:`lpt.kernels.flash_attention.mosaic_gpu.BACKWARD_TILE_LIMIT`, i.e. D = 64) and it pads Tq and Tk no
    further than 64 does; else 64 (D = 128: the backward spills with 128; D = 192, 256: the forward's shared memory
    and the backward's registers)."""
    big, small = mg.BLOCK_KS[-1], mg.BLOCK_KS[0]
    padded = lambda t, b: -(-t // b) * b
    if d * big <= mg.BACKWARD_TILE_LIMIT and all(padded(t, big) == padded(t, small) for t in (tq, tk)):
        return big
    return small


def _pad_to(x, length: int, axis: int, value):
    extra = length - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def auto_impl(dtype, head_dim: int, mesh=None, *, standard: bool = False, masked: bool = False) -> str:
    """The implementation ``impl="auto"`` runs for q, k, v of ``dtype`` and head width ``head_dim``, lowered for
    :func:`lpt.kernels.dispatch.target_device` of ``mesh``. On a GPU: cuDNN's fused attention ("cudnn") for the
    standard policy (``standard``) of 16-bit inputs with D in :data:`lpt.attention.cudnn.HEAD_DIMS` and no segment
    ids or kv mask (``masked``); else on a Hopper GPU the Mosaic GPU kernels where they train (16-bit inputs, D in
    :data:`lpt.kernels.flash_attention.mosaic_gpu.BACKWARD_HEAD_DIMS`), on another GPU or for other inputs the
    Pallas (Triton) kernel. On a TPU the Pallas (Mosaic TPU) kernel, elsewhere (CPU) the XLA twin.

    Args:
      dtype, head_dim: the dtype of q, k and v, and their head width D.
      mesh: the mesh the program is lowered for (None: the ``jax.set_mesh`` mesh, else the default device).
      standard, masked: the call asks for the standard policy (``stable=False``); it has segment ids or a kv mask.
    """
    device = dispatch.target_device(mesh)
    if device.platform == "tpu":
        return "pallas"
    if device.platform != "gpu":
        return "xla"
    sixteen = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if standard and not masked and sixteen and head_dim in cudnn.HEAD_DIMS:
        return "cudnn"
    if dispatch.hopper(device) and sixteen and head_dim in mg.BACKWARD_HEAD_DIMS:
        return "mosaic_gpu"
    return "pallas"


def _standard(opts: _Options) -> bool:
    """Whether the call asks for the standard policy (``stable=False`` or the policy itself)."""
    policy = opts.policy if opts.policy is not None else None if opts.stable else fm.standard_policy()
    return policy == fm.standard_policy()


def _canonical(q, k, v, opts: _Options, *, kv_mask, segment_ids):
    """Validate a public call's arrays and options; return padded [B, H, T, D] tensors, segments and the static
    config."""
    if opts.impl not in _IMPLS:
        raise ValueError(f"impl={opts.impl!r} is not allowed; choose one of {_IMPLS}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim]; got {q.shape}, {k.shape}, {v.shape}")
    if opts.impl == "auto":
        dispatch.check_auto_interpret(opts.interpret)
        opts = dataclasses.replace(opts, impl=auto_impl(q.dtype, q.shape[3], opts.mesh))
    b, tq, h, d = q.shape
    _, tk, hkv, _ = k.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {k.shape} and v {v.shape} must both be [{b}, Tk, Hkv, {d}]")
    if h % hkv:
        raise ValueError(f"query heads {h} must be a multiple of kv heads {hkv}")
    if not (q.dtype == k.dtype == v.dtype) or jnp.dtype(q.dtype) not in _FLOATS:
        raise ValueError(f"q, k, v must share one dtype among {_FLOATS}; got {q.dtype}, {k.dtype}, {v.dtype}")
    if opts.causal and tq != tk:
        raise ValueError(f"causal attention needs Tq == Tk, got Tq={tq}, Tk={tk}")
    window = opts.sliding_window
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"sliding_window={window!r} must be an int >= 0 (0: no window)")
    if window and not opts.causal:
        raise ValueError(f"sliding_window={window} needs causal=True")
    policy = opts.policy
    if policy is None:
        policy = fm.default_policy(beta=opts.beta) if opts.stable else fm.standard_policy()
    if not isinstance(policy, fm.AttentionPolicy):
        raise ValueError(f"policy must be an AttentionPolicy, got {type(policy).__name__}")
    scale = float(1.0 / math.sqrt(d) if opts.scale is None else opts.scale)

    q_seg = jnp.zeros((b, tq), jnp.int32)
    kv_seg = jnp.zeros((b, tk), jnp.int32)
    if segment_ids is not None:
        if tq != tk or tuple(segment_ids.shape) != (b, tq):
            raise ValueError(f"segment_ids must be [B, T] = {(b, tq)} with Tq == Tk, got {segment_ids.shape}")
        q_seg = kv_seg = segment_ids.astype(jnp.int32)  # int -> int32
    if kv_mask is not None:
        if tuple(kv_mask.shape) != (b, tk) or kv_mask.dtype != jnp.bool_:
            raise ValueError(f"kv_mask must be bool [B, Tk] = {(b, tk)}, got {kv_mask.dtype}{kv_mask.shape}")
        kv_seg = jnp.where(kv_mask, kv_seg, -1)

    interpret = opts.interpret
    if opts.impl == "mosaic_gpu":  # Hopper: 64 query rows per CTA; both kernels' blocks divide Tq and Tk
        if interpret not in (None, False, True):
            raise ValueError(
                f"interpret={interpret!r}: impl='mosaic_gpu' takes None or False (compile for CUDA) or True (the "
                "Mosaic GPU interpreter)"
            )
        interpret = bool(interpret)
        bq = opts.block_q or mg.BLOCK_Q
        bk = opts.block_k or mosaic_gpu_block_k(d, tq, tk)
        unit = math.lcm(bq, bk)  # the dK/dV kernel takes key blocks of bq rows and query steps of bk
        tq_pad, tk_pad = -(-tq // unit) * unit, -(-tk // unit) * unit
    else:
        bq = opts.block_q or _default_block(tq)
        bk = opts.block_k or _default_block(tk)
        tq_pad, tk_pad = -(-tq // bq) * bq, -(-tk // bk) * bk
    if opts.causal:  # keep query and key positions aligned
        tq_pad = tk_pad = max(tq_pad, tk_pad, -(-tq // math.lcm(bq, bk)) * math.lcm(bq, bk))
    q_t = _pad_to(q, tq_pad, 1, 0).transpose(0, 2, 1, 3)  # [B, H, Tq, D]
    k_t = _pad_to(k, tk_pad, 1, 0).transpose(0, 2, 1, 3)
    v_t = _pad_to(v, tk_pad, 1, 0).transpose(0, 2, 1, 3)
    q_seg = _pad_to(q_seg, tq_pad, 1, -2)  # padded queries match no key
    kv_seg = _pad_to(kv_seg, tk_pad, 1, -1)  # padded keys match no query
    masked = segment_ids is not None or kv_mask is not None or (tq_pad, tk_pad) != (tq, tk)
    if opts.impl == "mosaic_gpu" and not masked:  # one segment, nothing padded: the kernels without segment ids
        q_seg = kv_seg = None

    mesh = dispatch.kernel_mesh(opts.mesh) if opts.impl in _KERNELS else None
    specs = _kernel_specs(q, k, v, mesh, opts.impl)
    if specs is not None and sharding.explicit(mesh) and q_seg is not None:  # typed shardings: the segments (made
        seg_sharding = jax.sharding.NamedSharding(mesh, specs[2])  # on the mesh given, set or not
        q_seg, kv_seg = (jax.sharding.reshard(s, seg_sharding) for s in (q_seg, kv_seg))  # here) follow q's batch
    options = FlashOptions(
        causal=bool(opts.causal), scale=scale, policy=policy, window=window, block_q=bq, block_k=bk, interpret=interpret
    )
    cfg = _Config(options, opts.impl, mesh if specs else None, specs)
    return q_t, k_t, v_t, q_seg, kv_seg, cfg


def dot_product_attention(
    q,
    k,
    v,
    *,
    causal: bool = True,
    sliding_window: int = 0,
    stable: bool = True,
    beta: float = 7.0,
    impl: str = "auto",
    kv_mask=None,
    segment_ids=None,
    scale: float | None = None,
    policy: fm.AttentionPolicy | None = None,
    key=None,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool | None = None,
    mesh=None,
):
    """Attention over q [B, Tq, H, D], k and v [B, Tk, Hkv, D] (H % Hkv == 0); returns [B, Tq, H, D] in q.dtype.

    Args:
      q, k, v: the shapes above, sharing one dtype: bfloat16, float16 or float32.
      causal: key j is visible to query i only if j <= i (needs Tq == Tk).
      sliding_window: w > 0 (needs causal): query i sees only the w keys i − w < j <= i (Jiang et al., "Mistral 7B";
        transformers' convention). The flash kernel visits only the key blocks that meet the window, so its work
        and fetches are O(T·w); the XLA twin and "softmax" mask the rest. 0: no window.
      stable: True uses :func:`lpt.kernels.flash_attention.math.default_policy` (β shift, ℓ from the rounded P̃,
        f32 O residual for δ); False the standard FA2 kernel (row-max shift, ℓ from f32 P̄, O residual in the
        input dtype). Ignored when ``policy`` is given.
      beta: β of the Qiu & Yao shift rule (used when ``stable`` and no ``policy``).
      impl: "auto" (the default: per the device the program is lowered for, :func:`auto_impl`: on a GPU cuDNN for
        the standard policy where it takes the call, else the Mosaic GPU kernels on Hopper, the Pallas kernel on
        another GPU or a TPU, the XLA twin on CPU; all compute the same function), "xla" (blockwise XLA twin of the
        kernel), "pallas" (the flash kernel), "mosaic_gpu" (the Hopper flash kernels, CUDA only: bf16 / f16, D in
        64, 128 (forward also 192, 256); see the module doc), "cudnn" (cuDNN's fused attention through
        ``jax.nn.dot_product_attention``, CUDA only: the standard policy of bf16 / f16 inputs without segment ids
        or a kv mask),
        "softmax" (plain f32 softmax attention with autodiff gradients: the truth for tests; ignores the policy).
      kv_mask: optional bool [B, Tk]; False marks padding keys that nobody attends.
      segment_ids: optional int [B, T] (needs Tq == Tk), values >= 0; a query attends only keys of its segment
        (packed sequences).
      scale: logit scale, default 1/sqrt(D).
      policy: an explicit :class:`AttentionPolicy` (overrides stable/beta).
      key: PRNG key, required by ``policy.residual == "stochastic"``.
      block_q, block_k: block sizes (default min(128, pow2 >= T)); T is padded up to a multiple internally. The
        XLA twin and the interpreted kernel use them as given; the compiled kernels use a per-platform tile derived
        from them (:func:`lpt.kernels.flash_attention.tiles.tiles`: on TPU a multiple, up to 512; on GPU a
        power-of-two divisor, up to 128). "mosaic_gpu": block_q 64 and block_k 64 or 128 (default
        :func:`mosaic_gpu_block_k`), used as given; Tq and Tk are padded to a multiple of both.
      interpret: the kernels only (None with "auto"). "pallas": None interprets on CPU and compiles on cuda/tpu
        (``lax.platform_dependent``), True always interprets. "mosaic_gpu": None or False compiles for CUDA
        (ValueError when lowered for another platform), True runs the Mosaic GPU interpreter.
      mesh: the kernels only: the mesh they run on, one shard per device (see the module doc). None: the mesh of
        ``jax.set_mesh`` if one is set, else the kernels see whole arrays.
    """
    opts = _Options(
        causal=causal,
        sliding_window=sliding_window,
        stable=stable,
        beta=beta,
        policy=policy,
        impl=impl,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
        mesh=mesh,
    )
    standard, masked = _standard(opts), kv_mask is not None or segment_ids is not None
    if impl == "auto":
        dispatch.check_auto_interpret(interpret)
        auto = auto_impl(q.dtype, q.shape[-1], mesh, standard=standard, masked=masked)
        opts = dataclasses.replace(opts, impl=auto)
    q_t, k_t, v_t, q_seg, kv_seg, cfg = _canonical(q, k, v, opts, kv_mask=kv_mask, segment_ids=segment_ids)
    if cfg.impl == "cudnn":  # the checks of shapes and options above, then cuDNN on the arrays as given
        kw = {"interpret": interpret, "block_q": block_q, "block_k": block_k}
        cudnn.check(standard=standard, masked=masked, dtype=q.dtype, **kw)
        return cudnn.attention(q, k, v, causal=causal, sliding_window=sliding_window, scale=scale)
    tq = q.shape[1]
    options = cfg.options
    if cfg.impl != "softmax" and options.policy.residual == "stochastic" and key is None:
        raise ValueError("AttentionPolicy.residual='stochastic' needs a PRNG key: pass key=...")
    if cfg.impl == "softmax":
        mask = dict(causal=options.causal, window=options.window, scale=options.scale)
        o = fr.softmax_attention(q_t, k_t, v_t, q_seg, kv_seg, **mask)
        o = o.astype(q.dtype)  # f32 -> input dtype (RNE; differentiable, unlike the bit-exact rounding)
    else:
        if key is not None and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        o = _flash(q_t, k_t, v_t, q_seg, kv_seg, key, cfg)
    return o.transpose(0, 2, 1, 3)[:, :tq]
