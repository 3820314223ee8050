"""The run's precision recipe: the ``precision`` config section, and the one place it is resolved for the model.

:class:`PrecisionConfig` is the model's numerics (:class:`lpt.models.config.Numerics`: param and compute dtypes,
per-layer matmuls, attention, PQT) plus the optimizer's knobs (``update_rule``, ``moment_rounding``,
``update_impl``, ``moment_dtype``, whose allowed values :mod:`lpt.optim` owns). :func:`model_precision` turns it into
the :class:`lpt.models.PrecisionSpec` the model is built with: ``update_rule="f32_master"`` stores float32 master
weights that the layers view through ``param_dtype``; every other rule rounds each update into parameters stored in
``param_dtype`` itself. :func:`lpt.train.optimizer.make_optimizer` builds the optimizer from the same section.
"""

from __future__ import annotations

import dataclasses

from lpt.models.config import Numerics, PrecisionSpec
from lpt.optim.adam import MOMENT_DTYPES, MOMENT_ROUNDINGS
from lpt.optim.fused_adamw import IMPLS as UPDATE_IMPLS
from lpt.optim.moments8 import MOMENT8
from lpt.optim.recipes import UPDATE_RULES as ROUNDING_RULES
from lpt.options import build, option, section

UPDATE_RULES = ("f32_master", *ROUNDING_RULES)  # f32 master weights, or a rule of lpt.optim that rounds into params


@section("precision")
class PrecisionConfig(Numerics):
    """The ``precision`` section: the layers' numerics and how the optimizer's update reaches the parameters."""

    update_rule: str = option("f32_master", "f32_master | nearest | kahan | stochastic | norm_preserving", UPDATE_RULES)
    moment_rounding: str = option(
        "stochastic", '16-bit Adam moments: "stochastic" (unbiased) | "nearest"', MOMENT_ROUNDINGS
    )
    update_impl: str = option("xla", 'kahan only: the fused step in "xla" or the "pallas" kernel', UPDATE_IMPLS)
    moment_dtype: str = option(
        "auto",
        'Adam moments: "auto" (16-bit params: their dtype; else float32), a 16/32-bit float, or 8 bits with a '
        "block scale (float8_e4m3fn: m and sqrt(v) in e4m3 with an f32 scale per 128; lpt.optim.moments8)",
        ("auto", *MOMENT_DTYPES, *MOMENT8),
    )

    def check(self):
        if self.update_impl == "pallas" and (self.update_rule != "kahan" or self.param_dtype != "bfloat16"):
            raise ValueError(
                f"precision.update_impl='pallas' runs the fused bf16 AdamW + Kahan kernel: it needs "
                f"precision.update_rule='kahan' and precision.param_dtype='bfloat16', got {self.update_rule!r} and "
                f"{self.param_dtype!r} (use precision.update_impl='xla')"
            )
        if self.update_rule != "f32_master" and self.param_dtype == "float32":
            raise ValueError(
                f"precision.update_rule={self.update_rule!r} rounds each update into low-precision params, but "
                f"precision.param_dtype='float32'; set precision.param_dtype=bfloat16 (or float16, float8_*) with it, "
                f"or use precision.update_rule=f32_master for f32 params"
            )
        lpt_adamw = self.update_rule != "f32_master" and not self.param_dtype.startswith("float8")
        if self.moment_dtype not in ("auto", "float32") and not lpt_adamw:
            raise ValueError(
                f"config key precision.moment_dtype={self.moment_dtype!r} needs 16-bit params with a rounding update "
                f"rule; with update_rule={self.update_rule!r} and param_dtype={self.param_dtype!r} the moments are "
                "float32 (use 'auto' or 'float32')"
            )


def model_precision(precision_cfg=None, **changes) -> PrecisionSpec:
    """The model's :class:`~lpt.models.PrecisionSpec` for the ``precision`` section ``precision_cfg`` (a
    ConfigDict, mapping or :class:`PrecisionConfig`), with ``changes`` to its fields (``compute_dtype="bfloat16"``)."""
    p = build(PrecisionConfig, precision_cfg)
    numerics = {f.name: getattr(p, f.name) for f in dataclasses.fields(Numerics)}
    storage = "float32" if p.update_rule == "f32_master" else "param_dtype"
    return PrecisionSpec(**{**numerics, "storage": storage, **changes})
