"""The numerics policy of flash attention and the per-block softmax rules shared by kernel and XLA reference.

Online softmax (FA2) keeps, per query row, a running maximum ``M`` of the (masked, scaled, f32) logits ``s``, a
count ``n`` of logits within ``tie_tol`` of ``M`` (the entries whose ``P̄`` would round to exactly 1), a shift ``c``,
the denominator ``ℓ`` and the unnormalized output ``acc``. For every key block::

    M' = max(M, rowmax(s))
    n' = (0 if M' - tie_tol > M else n) + #{s >= M' - tie_tol}           (conservative across blocks)
    c' = shift(M', n')                                                   (the shift rule, below)
    α  = exp(c - c')                                                     (1 while the row has seen no key)
    P̄  = exp(s - c') on unmasked entries, 0 on masked ones               (f32)
    P̃  = round(P̄, pv_dtype)                                              (the matmul input)
    ℓ' = α ℓ + rowsum(P̃ if denominator == "rounded" else P̄)              (f32)
    acc' = α acc + P̃ V          (f32 accumulate; with accumulator == "pv" both terms and the sum are rounded
                                 to pv_dtype, emulating the all-bf16 arithmetic of the Qiu & Yao paper code;
                                 with accumulator == "split" P̃ V = P̃_big V + P̃_small V, below)

and finally ``O = acc / ℓ`` (0 for a row without any unmasked key) and ``lse = c + log ℓ`` (−inf there).

Shift rules. ``"max"``: ``c = M`` (standard). ``"beta"`` (Qiu & Yao, Algorithm 1, intent): if the row max is repeated
(``n > 1``) the largest exponent is moved below zero by an offset ``o`` so that no ``P̄`` equals 1::

    o = (β − 1)·M if M > 0;   −M if M < 0 (the paper's shift 0);   0 if M = 0
    o = max_offset − w·frac(o) if o > max_offset;   min_offset + o if o < min_offset;   c = M + o
                                            (w = min(1, max_offset − min_offset); unrepeated rows: c = M)

``max_offset`` is the underflow guard (``exp(−64)`` is far from f32/bf16 underflow, while the paper's ``β·M`` with
``M = 20, β = 7`` would flush every ``P̄`` to zero and divide by zero). ``min_offset`` keeps ``exp(−o)`` below 1 after
rounding to bf16 even when ``|M|`` is tiny (the paper leaves ``M = 0`` rows unchanged). Both guards keep the offset
dynamic (a function of M) instead of clipping it to a constant: with a constant, every guarded row shares one bf16
rounding of ``exp(−o)`` (``exp(−64)`` rounds down by 0.15%), which is the fixed offset that Qiu & Yao's Appendix C
rules out (measured at β = 8 with ℓ summed from f32 P̄: docs/results.md).

Deviations from the paper's Algorithm 1: it detects repeats only inside one block and its line 10 overwrites the
shifted maximum; here the count runs over all blocks seen so far, so a block maximum equal to the running maximum
counts as a repeat.

Split accumulation (``accumulator="split"``). Inside one f32 matmul a dominant product (a maximum's P̃ times its
v) swamps the tiny same-signed products of the far logits: each is rounded against the ulp of the large partial sum,
and the ones below half an ulp are lost, so the sum is biased towards zero (Qiu & Yao's mechanism one level down,
in f32; measured in docs/results.md). The split sums the weights within ``2**-split_bits`` of the row's largest
weight and the others in two matmuls and adds the two f32 results once::

    big = s >= M' − split_bits·ln 2;   P̃V = (P̃ ∘ big) V + (P̃ ∘ ¬big) V

(and ℓ the same way), so the small products are summed among themselves and meet the large sum in one rounding.
In exact arithmetic it changes nothing; it costs a second P̃V matmul per key block.

Nothing here imports Flax; the functions are pure jnp on arrays whose last axis is the key axis and so run both
inside a Pallas kernel body (rows = a query block) and in the batched XLA reference.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lpt.numerics import round_nearest, round_stochastic

_SHIFTS = ("max", "beta")
_DENOMINATORS = ("f32", "rounded")
_ACCUMULATORS = ("f32", "pv", "split")
_RESIDUALS = ("input", "f32", "stochastic")
_PV_DTYPES = (None, "bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class AttentionPolicy:
    """How the flash loop rounds. Hashable (a static argument under ``jit``).

    Attributes:
      shift: "max" (standard row max) or "beta" (the Qiu & Yao rule for repeated maxima, with guards; module docstring).
      beta: β of the "beta" rule (> 1; the paper uses 7, its code 2).
      tie_tol: logits within this distance of the running max count as repeats. Default 2**-9: exp(−x) for
        x < 2**-9 rounds to 1 in bf16, so such entries behave exactly like repeated maxima.
      min_offset, max_offset: clip of the "beta" offset (keeps max P̄ < 1 after rounding; underflow guard).
      denominator: "f32" sums ℓ from the f32 P̄ (what every JAX flash kernel does); "rounded" sums ℓ from the
        rounded P̃ that feeds the P̃V matmul, so numerator and denominator see the same weights.
      pv_dtype: dtype name of the P̃V matmul inputs; None = the dtype of V.
      accumulator: "f32" (FA2: one f32 P̃V matmul per block), "split" (two matmuls, large and small weights, summed
        once: no f32 swamping bias; module docstring) or "pv" (the running output is rounded to pv_dtype each
        block: all-bf16 emulation).
      split_bits: "split" puts weights within 2**-split_bits of the row's largest weight in the large part.
      residual: the O kept for the backward's δ = rowsum(dO ∘ O): "input" (O rounded to nearest in the input dtype,
        the returned output), "f32" (the f32 O; the returned output is still rounded to nearest), "stochastic"
        (O stochastically rounded to the input dtype, used as both output and residual; needs a key).
    """

    shift: str = "beta"
    beta: float = 7.0
    tie_tol: float = 2.0**-9
    min_offset: float = 2.0**-6
    max_offset: float = 64.0
    denominator: str = "rounded"
    pv_dtype: str | None = None
    accumulator: str = "split"
    split_bits: float = 8.0
    residual: str = "f32"

    def __post_init__(self):
        for name, value, allowed in (
            ("shift", self.shift, _SHIFTS),
            ("denominator", self.denominator, _DENOMINATORS),
            ("accumulator", self.accumulator, _ACCUMULATORS),
            ("residual", self.residual, _RESIDUALS),
            ("pv_dtype", self.pv_dtype, _PV_DTYPES),
        ):
            if value not in allowed:
                raise ValueError(f"AttentionPolicy.{name}={value!r} is not allowed; choose one of {allowed}")
        if not self.beta > 1.0:
            raise ValueError(f"AttentionPolicy.beta must be > 1, got {self.beta!r}")
        if not 0.0 <= self.tie_tol < 1.0:
            raise ValueError(f"AttentionPolicy.tie_tol must be in [0, 1), got {self.tie_tol!r}")
        if not 0.0 < self.split_bits <= 64.0:
            raise ValueError(f"AttentionPolicy.split_bits must be in (0, 64], got {self.split_bits!r}")
        if not 0.0 < self.min_offset <= self.max_offset <= 80.0:
            raise ValueError(
                f"need 0 < min_offset <= max_offset <= 80, got min_offset={self.min_offset!r}, "
                f"max_offset={self.max_offset!r}"
            )

    def pv(self, v_dtype) -> jnp.dtype:
        """The dtype of the P̃V matmul inputs for values of dtype ``v_dtype``."""
        return jnp.dtype(v_dtype if self.pv_dtype is None else self.pv_dtype)


def standard_policy(**overrides) -> AttentionPolicy:
    """The standard FA2 kernel: row-max shift, ℓ from f32 P̄, one f32 P̃V matmul, O stored in the input dtype."""
    return AttentionPolicy(
        **{"shift": "max", "denominator": "f32", "accumulator": "f32", "residual": "input", **overrides}
    )


def default_policy(beta: float = 7.0, **overrides) -> AttentionPolicy:
    """The bias-free default (``stable=True``): β shift, ℓ from the rounded P̃, split P̃V accumulation, f32 O
    residual for δ."""
    return AttentionPolicy(**{"shift": "beta", "beta": beta, **overrides})


def round_to(x: jax.Array, dtype, native: bool = False) -> jax.Array:
    """Round-to-nearest-even of f32 ``x`` into ``dtype`` (returns ``dtype``).

    Default: lpt.numerics' bit-exact rounding (survives XLA's excess precision). ``native=True`` uses the plain
    conversion, for Mosaic TPU kernels: there it is a hardware RNE convert (no XLA pass can skip it), and the
    bit version's ``copysign`` cannot be lowered for TPU on a machine without a TPU.
    """
    if jnp.dtype(dtype) == jnp.float32:
        return x.astype(jnp.float32)  # f32 -> f32 (no-op)
    if native:
        return x.astype(dtype)  # f32 -> dtype, RNE convert inside a compiled kernel
    return round_nearest(x, dtype)


def _round_grid_f32(x: jax.Array, dtype, native: bool = False) -> jax.Array:
    """Round f32 ``x`` to the grid of ``dtype`` but keep it f32 (see :func:`round_to` for ``native``)."""
    if jnp.dtype(dtype) == jnp.float32:
        return x
    if native:
        return x.astype(dtype).astype(jnp.float32)  # f32 -> dtype (RNE) -> f32 (exact)
    return round_nearest(x, dtype, out_dtype=jnp.float32)


def position_mask(q_pos, k_pos, causal: bool, window: int = 0):
    """Which keys a query sees by position (int32 positions that broadcast against each other): ``k_pos <= q_pos``
    if ``causal`` and, with a sliding window of ``window`` > 0 keys, ``q_pos − window < k_pos`` (the query's own key
    and the ``window − 1`` before it: the convention of Jiang et al., "Mistral 7B", and transformers). A Python
    ``True`` when neither applies. ValueError for a window < 0 or a window without ``causal``."""
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"sliding window={window!r} must be an int >= 0 (0: no window)")
    if window and not causal:
        raise ValueError(f"sliding window={window} needs causal attention (it bounds how far back a query sees)")
    ok = True
    if causal:
        ok = k_pos <= q_pos
    if window:
        ok = ok & (k_pos > q_pos - window)
    return ok


def wide(x, like):
    """A row statistic ``x`` against a tile ``like`` [..., n]: as it is when it is a [..., 1] column (broadcasting
    does the rest), broadcast to ``like``'s shape when it is a [...] row vector (Mosaic GPU holds row statistics so:
    it has no [64, 1] layout)."""
    if x.ndim == like.ndim:
        return x
    return jax.lax.broadcast_in_dim(x, like.shape, tuple(range(x.ndim)))


def rowsum(t, like):
    """The sum of tile ``t`` [..., n] over its last axis, laid out like the row statistic ``like``."""
    return jnp.sum(t, axis=-1, keepdims=like.ndim == t.ndim)


def update_max_count(m, n, s, valid, tie_tol: float):
    """One block of the running (max, near-max count).

    Args:
      m, n: the running max and near-max count: [..., 1] columns or [...] rows, f32 (:func:`wide`).
      s: [..., bk] f32 logits of the block.
      valid: bool like s, or True (nothing masked).
      tie_tol: logits within this of the new max count as near-max.
    """
    s_masked = s if valid is True else jnp.where(valid, s, -jnp.inf)  # Mosaic GPU selects on no scalar predicate
    m_new = jnp.maximum(m, jnp.max(s_masked, axis=-1, keepdims=m.ndim == s.ndim))
    near = valid & (s_masked >= wide(m_new - jnp.float32(tie_tol), s))
    block_n = rowsum(jnp.where(near, 1.0, 0.0), m)  # count as f32
    n_new = jnp.where(m_new - jnp.float32(tie_tol) > m, 0.0, n) + block_n
    return m_new, n_new


def shift_of(m, n, policy: AttentionPolicy):
    """The shift c for running max m and near-max count n (f32, elementwise); finite even for m = −inf. The β
    rule's ``floor`` of the offset is a truncation through int32, exact for the offset's range [0, 2**20] (Mosaic GPU
    lowers the conversion, not ``floor``)."""
    if policy.shift == "max":
        c = m
    else:
        raw = jnp.where(m > 0, jnp.float32(policy.beta - 1.0) * m, -m)  # >= 0; m = 0 gives 0
        raw = jnp.minimum(raw, jnp.float32(2.0**20))  # finite (m = −inf gives inf; that row's c is 0 below)
        lo, hi = jnp.float32(policy.min_offset), jnp.float32(policy.max_offset)
        width = jnp.float32(min(1.0, policy.max_offset - policy.min_offset))  # dither of the upper guard
        floor = raw.astype(jnp.int32).astype(jnp.float32)  # f32 -> int32 (truncates; raw >= 0) -> f32 (exact)
        offset = jnp.where(raw > hi, hi - width * (raw - floor), jnp.where(raw < lo, lo + raw, raw))
        c = jnp.where(n > 1.5, m + offset, m)
    return jnp.where(m == -jnp.inf, 0.0, c)


def rescale(c_old, c_new, m_old, policy: AttentionPolicy, pv_dtype, native: bool = False):
    """α = exp(c_old − c_new), or 1 while the row has seen no unmasked key (acc = ℓ = 0 then).

    Under the "beta" rule α is rounded to the P̃ grid: when a repeat switches the shift from M to M + o, the
    earlier maximum (which entered with P̃ = 1) is then weighted round(exp(−o)), exactly the P̃ of the later
    copies; with an f32 α the copies would get different weights. Rounding α perturbs the weights of the earlier
    blocks' entries (by < 2**-9 relative, like P̃'s own rounding); acc and ℓ share it, so O stays a weighted mean.

    Args:
      c_old, c_new: the shift before and after this block (f32 row statistics).
      m_old: the running max before this block (−inf: no unmasked key seen yet).
      policy: the :class:`AttentionPolicy` (its ``shift``).
      pv_dtype: the P̃ grid that α is rounded to under the "beta" rule.
      native: round with the plain conversion (:func:`round_to`).
    """
    alpha = jnp.exp(c_old - c_new)
    if policy.shift == "beta":
        alpha = _round_grid_f32(alpha, pv_dtype, native)
    return jnp.where(m_old == -jnp.inf, 1.0, alpha)


def _probs(s, valid, c):
    """P̄ = exp(min(s − c, 0)) on valid entries, 0 elsewhere and where c = −inf (f32).

    The clamp only matters when XLA recomputes s with a different last bit in another fusion (|s| > ~1e7).
    """
    c = wide(c, s)
    ok = valid & (c != -jnp.inf)
    return jnp.where(ok, jnp.exp(jnp.where(ok, jnp.minimum(s - c, 0.0), -jnp.inf)), 0.0)


def _split_weights(p, s, m, policy: AttentionPolicy):
    """(P̃ ∘ big, P̃ ∘ ¬big) with big = s >= m − split_bits·ln 2 (``accumulator="split"``); p in any dtype.

    m is the running max after this block (a row statistic, :func:`wide`); masked entries have p = 0 and may land in
    either part.
    """
    big = s >= wide(m - jnp.float32(policy.split_bits * 0.6931471805599453), s)  # ln 2
    zero = jnp.zeros_like(p)
    return jnp.where(big, p, zero), jnp.where(big, zero, p)


def forward_step(carry, s, valid, matmul, policy: AttentionPolicy, pv_dtype, native: bool = False):
    """One key block of the online softmax (module docstring): the rules every flash forward applies per block.
    Returns the new carry.

    Args:
      carry: (M, n, c, ℓ, acc) with M, n, c, ℓ f32 row statistics ([..., 1] columns, or [...] rows: :func:`wide`)
        and acc [..., D] f32.
      s: [..., bk] f32 logits.
      valid: bool like s.
      matmul: ``matmul(w)`` returns w V for weights w [..., bk] in pv_dtype (the caller holds V, already rounded to
        pv_dtype) as f32.
      policy: the :class:`AttentionPolicy`.
      pv_dtype: dtype of the P̃V matmul inputs (:meth:`AttentionPolicy.pv`).
      native: round with the plain conversion (:func:`round_to`).
    """
    m, n, c, l, acc = carry
    m_new, n_new = update_max_count(m, n, s, valid, policy.tie_tol)
    c_new = shift_of(m_new, n_new, policy)
    alpha = rescale(c, c_new, m, policy, pv_dtype, native)
    p = _probs(s, valid, c_new)
    p_pv = round_to(p, pv_dtype, native)  # f32 -> pv dtype (RNE)
    p_sum = p_pv.astype(jnp.float32) if policy.denominator == "rounded" else p  # pv dtype -> f32, exact
    # the row sums before the matmuls: a kernel that runs these ops in program order (Mosaic GPU) then holds no f32
    # weight tile in registers beside the matmuls' accumulators
    if policy.accumulator == "split":  # large and small weights in separate matmuls, summed once
        sum_big, sum_small = _split_weights(p_sum, s, m_new, policy)
        p_rowsum = rowsum(sum_big, m) + rowsum(sum_small, m)
        p_big, p_small = _split_weights(p_pv, s, m_new, policy)
        pv = matmul(p_big) + matmul(p_small)
    else:
        p_rowsum = rowsum(p_sum, m)
        pv = matmul(p_pv)
    l_new = alpha * l + p_rowsum
    alpha_d = wide(alpha, acc)
    if policy.accumulator == "pv":
        acc_new = _round_grid_f32(
            _round_grid_f32(alpha_d * acc, pv_dtype, native) + _round_grid_f32(pv, pv_dtype, native), pv_dtype, native
        )
    else:
        acc_new = alpha_d * acc + pv
    return m_new, n_new, c_new, l_new, acc_new


def backward_weights(s, valid, lse, dp, delta, in_dtype, native: bool = False):
    """FA2 backward weights of one block: (round(P), round(dS)) in ``in_dtype`` with P = exp(s − lse) (masked),
    dS = P ∘ (dP − δ). They feed dV = round(P)ᵀ dO, dQ = round(dS) K, dK = round(dS)ᵀ Q (f32 accumulation).

    Args:
      s, dp: [..., bk] f32 logits and dO Vᵀ of the block.
      valid: bool like s.
      lse, delta: f32 row statistics (:func:`wide`).
      in_dtype: the input dtype that P and dS are rounded to.
      native: round with the plain conversion (:func:`round_to`).
    """
    p = _probs(s, valid, lse)
    ds = p * (dp - wide(delta, dp))
    return round_to(p, in_dtype, native), round_to(ds, in_dtype, native)  # f32 -> input dtype (RNE)


def finalize(acc, l, c):
    """O = acc / ℓ (0 where ℓ = 0) and lse = c + log ℓ (−inf where ℓ = 0), lse laid out like ℓ and c."""
    safe_l = jnp.where(l > 0, l, 1.0)
    o = jnp.where(wide(l, acc) > 0, acc / wide(safe_l, acc), 0.0)
    lse = jnp.where(l > 0, c + jnp.log(safe_l), -jnp.inf)
    return o, lse


def residual_and_output(o_f32, in_dtype, policy: AttentionPolicy, key):
    """(output returned to the caller, O kept for δ) from the f32 O, per ``policy.residual``."""
    if policy.residual == "stochastic":
        if key is None:
            raise ValueError("AttentionPolicy.residual='stochastic' needs a PRNG key: pass key=...")
        out = (
            o_f32.astype(in_dtype)  # f32 -> f32 (no rounding needed)
            if jnp.dtype(in_dtype) == jnp.float32
            else round_stochastic(o_f32, in_dtype, key)
        )
        return out, out
    out = round_to(o_f32, in_dtype)
    return out, (o_f32 if policy.residual == "f32" else out)
