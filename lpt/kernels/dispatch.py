"""Platform dispatch for every Pallas kernel: one place that decides interpret / Triton / Mosaic.

A kernel module describes its ``pallas_call`` once, as ``build(mode) -> callable``, and runs it with
:func:`platform_call`. The modes:

* ``"interpret"``: the Pallas interpreter (any platform; what runs on CPU),
* ``"triton"``: compiled with Triton on CUDA GPUs,
* ``"mosaic"``: compiled with Mosaic on TPUs.

``interpret=True`` forces the interpreter everywhere; ``interpret=None`` picks per platform at lowering time with
``jax.lax.platform_dependent`` (interpreter on CPU, Triton on CUDA, Mosaic on TPU), never by looking at
``jax.default_backend()``, so one jitted function lowers correctly for whichever device it is compiled for.
"""

from __future__ import annotations

from collections.abc import Callable

from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

MODES = ("interpret", "triton", "mosaic")


def check_interpret(interpret) -> None:
    """Raise ValueError unless ``interpret`` is None (choose per platform) or True (always interpret)."""
    if interpret not in (None, True):
        raise ValueError(f"interpret must be None (choose per platform) or True, got {interpret!r}")


def mode_kwargs(mode: str, *, grid_rank: int = 0, semantics: tuple[str, ...] | None = None, **triton) -> dict:
    """``pallas_call`` keyword arguments for ``mode``.

    ``interpret``: ``{"interpret": True}``. ``triton``: Triton compiler params (``num_warps``, ``num_stages`` from
    ``triton``). ``mosaic``: TPU dimension semantics, ``semantics`` if given, else all ``"parallel"`` over a grid of
    rank ``grid_rank``.
    """
    if mode == "interpret":
        return {"interpret": True}
    if mode == "triton":
        return {"compiler_params": pltriton.CompilerParams(**triton)}
    if mode == "mosaic":
        sem = tuple(semantics) if semantics is not None else ("parallel",) * grid_rank
        return {"compiler_params": pltpu.CompilerParams(dimension_semantics=sem)}
    raise ValueError(f"mode={mode!r} is not one of {MODES}")


def platform_call(build: Callable[[str], Callable], *args, interpret: bool | None):
    """``build(mode)(*args)``: interpreted if ``interpret``, else per platform via ``lax.platform_dependent``."""
    check_interpret(interpret)
    if interpret:
        return build("interpret")(*args)
    return lax.platform_dependent(*args, cpu=build("interpret"), cuda=build("triton"), tpu=build("mosaic"))
