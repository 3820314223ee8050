"""The compile-time options of one fused AdamW + Kahan step (:class:`StepOptions`) and the checks of a leaf's operands
against them (:func:`check_leaf`), shared by the kernels of :mod:`lpt.kernels.adamw_kahan` and their XLA twin."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from lpt.kernels import dispatch
from lpt.kernels.fp8_codes_math import check_fp8_format

__all__ = ["LANES", "StepOptions", "check_leaf"]

LANES = 128  # the last axis of a kernel tile; 8-bit moments keep one scale per block of LANES


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The compile-time options of one fused AdamW + Kahan step: what the step computes and how its kernel runs.
    Every field is a Python value compiled into the kernel, and the object is hashable (the partitioned call's
    static argument). :func:`lpt.kernels.adamw_kahan.kernel.adamw_kahan`, the per-shard wrappers, the Mosaic GPU
    variant and the XLA twin take it; the twin reads only the math fields.

    Args:
      b1, b2: Adam's decay rates of the first and second moment, Python numbers.
      eps: Adam's epsilon, a Python number.
      weight_decay: the decoupled weight decay, a Python number (0 adds no term).
      stochastic: round the stored moments stochastically (True) or to nearest even (False).
      moments8: 8-bit moments: ``(m_format, v_format, v_sqrt)`` of the ``lpt.optim.moments8.Moment8`` that stores
        them (two 8-bit float formats, and whether v is stored as sqrt(v)); None: packed bf16 moments.
      block_rows: rows of 128 lanes per kernel program, a power of two >= 16; None: per platform (see
        :func:`~lpt.kernels.adamw_kahan.kernel.adamw_kahan`).
      interpret: None picks the kernel per platform (:func:`lpt.kernels.dispatch.platform_call`); True runs an
        interpreter on every platform (the Pallas one; in the Mosaic GPU functions, the Mosaic GPU one).

    A field of the wrong kind or value is a one-line ValueError naming it and what is allowed.
    """

    b1: float
    b2: float
    eps: float
    weight_decay: float
    stochastic: bool
    moments8: tuple | None = None
    block_rows: int | None = None
    interpret: bool | None = None

    def __post_init__(self):
        for name in ("b1", "b2", "eps", "weight_decay"):
            h = getattr(self, name)
            if isinstance(h, bool) or not isinstance(h, (int, float)):
                raise ValueError(f"StepOptions: {name} must be a Python number (it is compiled in), got {h!r}")
        if not isinstance(self.stochastic, bool):
            raise ValueError(f"StepOptions: stochastic must be True or False, got {self.stochastic!r}")
        if self.moments8 is not None:
            if len(self.moments8) != 3:
                raise ValueError(f"moments8 must be (m_format, v_format, v_sqrt), got {self.moments8!r}")
            for fmt in self.moments8[:2]:
                check_fp8_format(fmt)
            object.__setattr__(self, "moments8", tuple(self.moments8))  # hashable
        block_rows = self.block_rows
        if block_rows is not None and (block_rows < 16 or block_rows & (block_rows - 1)):
            raise ValueError(f"block_rows must be a power of two >= 16, got {block_rows}")
        dispatch.check_interpret(self.interpret)


def _check_moments8(shape, scales=None, what="adamw_kahan"):
    """ValueError unless a leaf of ``shape`` can take 8-bit moments in the kernel: a last axis of whole blocks of
    128 (one block per tile row), and ``scales`` (if given) complex64 of shape ``shape[:-1] + (shape[-1] // 128,)``
    (the formats are :class:`StepOptions`' to check)."""
    if not shape or shape[-1] % LANES:
        raise ValueError(
            f"{what} with 8-bit moments needs a last axis that is a multiple of {LANES}, got a leaf of shape "
            f"{tuple(shape)}"
        )
    blocks = (*shape[:-1], shape[-1] // LANES)
    if scales is not None and (scales.dtype != jnp.complex64 or scales.shape != blocks):
        raise ValueError(f"{what}: scales must be complex64{list(blocks)}, got {scales.dtype}{list(scales.shape)}")


def check_leaf(g, p, c, mv, scalars, words, scales=None, *, options: StepOptions):
    """ValueError (one line, naming the operand) unless the operands fit :func:`adamw_kahan`.

    Args:
      g, p, c, mv: the gradient (floating point), bf16 param and compensation, and the moments: packed bf16 (u32)
        or, with ``options.moments8``, packed FP8 codes (u16); all of one shape.
      scalars: f32[4].
      words: u32[2] (16-bit moments) or u32[4] (8-bit).
      scales: 8-bit moments' complex64 scales, given exactly when ``options.moments8`` is.
      options: the step's :class:`StepOptions`.
    """
    moments8 = options.moments8
    if p.dtype != jnp.bfloat16 or c.dtype != jnp.bfloat16:
        raise ValueError(f"adamw_kahan needs bf16 params and compensation, got {p.dtype} and {c.dtype}")
    if (scales is None) != (moments8 is None):
        raise ValueError(f"pass scales and moments8 together (8-bit moments), got scales={scales!r} and {moments8=}")
    nw = 2 if moments8 is None else 4
    if moments8 is not None:
        _check_moments8(p.shape, scales)
        if mv.dtype != jnp.uint16:
            raise ValueError(f"adamw_kahan needs the 8-bit moments' codes packed as uint16, got {mv.dtype}")
    elif mv.dtype != jnp.uint32:
        raise ValueError(f"adamw_kahan needs the packed bf16 moments as uint32, got {mv.dtype}")
    if not jnp.issubdtype(g.dtype, jnp.floating):
        raise ValueError(f"adamw_kahan: gradient dtype {g.dtype} is not floating point")
    if not (g.shape == p.shape == c.shape == mv.shape):
        raise ValueError(f"adamw_kahan: shapes differ: g {g.shape}, p {p.shape}, c {c.shape}, mv {mv.shape}")
    if scalars.shape != (4,) or scalars.dtype != jnp.float32:
        raise ValueError(f"scalars must be f32[4] (1/c1, 1/c2, -lr, 0), got {scalars.dtype}{list(scalars.shape)}")
    if words.shape != (nw,) or words.dtype != jnp.uint32:
        raise ValueError(f"words must be uint32[{nw}] (the moments' raw keys), got {words.dtype}{list(words.shape)}")
