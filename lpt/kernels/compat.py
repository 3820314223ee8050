"""The Pallas APIs whose spelling changed between the jax versions lpt supports, each written once here.

* ``plgpu.load``: jax 0.10 takes the index as a positional argument; jax 0.11 deprecates passing it (the reference
  is indexed with ``ref.at[...]`` first) and makes it optional; jax 0.12 has no index argument. :func:`mgpu_load`
  loads a whole reference in each.
* A Mosaic GPU kernel that updates operands in place: jax >= 0.11 passes them to ``plgpu.kernel`` as mutable
  references (``jax.new_ref``, aliased in and out of the kernel); jax 0.10 cannot trace that, and there the kernel is
  a ``pallas_call`` with ``input_output_aliases`` (which jax 0.11.2 no longer lowers for Mosaic GPU on a GPU).
  :func:`mgpu_in_place` runs one kernel body either way.
* FP8 wgmma with two formats (e4m3 x e5m2): Mosaic GPU lowers it from jax 0.11 (:data:`WGMMA_MIXES_FP8`); jax 0.10
  takes one format for both operands.
* ``lax.sqrt`` in a Mosaic GPU kernel: jax 0.10 has no lowering rule for it (jax >= 0.11 lowers it to MLIR's
  ``math.sqrt``, IEEE-rounded); :func:`ensure_mgpu_math` registers that rule where it is missing. (Mosaic GPU lowers
  no ``floor`` in any of them: lpt's kernels take integer parts by conversions.)

(``plgpu.transpose_ref(ref, perm)``, deprecated in jax 0.11, is ``ref.transpose(perm)`` in every supported version,
which the kernels call directly.)
"""

from __future__ import annotations

import functools
import inspect

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lpt.kernels import dispatch

_REFS_INTO_KERNELS = jax.__version_info__ >= (0, 11)  # plgpu.kernel takes jax.new_ref operands (0.10 cannot trace)
WGMMA_MIXES_FP8 = jax.__version_info__ >= (0, 11)  # a Mosaic GPU wgmma of an e4m3 and an e5m2 operand
_LOAD_INDEX = inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_TAKES_INDEX = _LOAD_INDEX is not None and _LOAD_INDEX.default is inspect.Parameter.empty


def mgpu_load(ref, *, layout):
    """``plgpu.load`` of all of ``ref`` into registers of ``layout``."""
    if _LOAD_TAKES_INDEX:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


@functools.cache
def ensure_mgpu_math() -> None:
    """Give ``lax.sqrt_p`` Mosaic GPU lowerings (lane and warpgroup semantics) where jax has none (jax 0.10): MLIR's
    ``math.sqrt`` elementwise, as jax >= 0.11 lowers it with ``approx_math=False`` (IEEE square root)."""
    from jax._src.lib.mlir.dialects import math as mlir_math
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu import lowering
    from jax.experimental.mosaic import gpu as mgpu

    for primitive, op in ((lax.sqrt_p, mlir_math.sqrt),):
        for semantics in (mgpu.LoweringSemantics.Lane, mgpu.LoweringSemantics.Warpgroup):
            if primitive in lowering.mosaic_lowering_rules[(semantics, gpu_core.PrimitiveSemantics.Warpgroup)]:
                continue

            def rule(ctx, x, accuracy=None, op=op, semantics=semantics, name=primitive.name):
                if accuracy is not None:
                    raise NotImplementedError(f"lax.{name} with accuracy={accuracy!r} in a Mosaic GPU kernel")
                [aval] = ctx.avals_in
                if semantics == mgpu.LoweringSemantics.Lane:
                    return lowering._ensure_fa(x, aval.dtype)._pointwise(op)
                return op(lowering._ensure_ir_value(x, aval.dtype))

            lowering.register_lowering_rule(primitive, semantics)(rule)


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # not re-exported in jax 0.10

    return InterpretGPUParams()


def mgpu_in_place(kernel, *operands, n_in_place: int, grid, grid_names, name: str, interpret: bool = False):
    """Run ``kernel(cta, *operand_refs, *out_refs)`` on every CTA of ``grid`` (``cta``: its index along each of
    ``grid_names``), where the last ``n_in_place`` operands are updated in place; returns their new values.

    ``out_refs`` are where the kernel writes those operands' new values: the operands' own references (jax >= 0.11),
    or output buffers aliased to them (``pallas_call``), so that a CTA must read each block before it writes it, and
    no other CTA may read it. ``interpret=True`` runs the Mosaic GPU interpreter (on jax 0.10 with separate output
    buffers: the interpreter gives every point of a ``pallas_call`` grid program id 0; and under
    :func:`lpt.kernels.dispatch.fresh_outputs`).

    Args:
      kernel: the body, ``kernel(cta, *operand_refs, *out_refs)``, run once per CTA.
      *operands: the kernel's operands (GMEM), the last ``n_in_place`` of them updated.
      n_in_place: how many of the last operands the kernel updates.
      grid, grid_names: the CTA grid and the names of its axes.
      name: the kernel's name in the compiled program.
      interpret: True runs the Mosaic GPU interpreter (CPU tests).
    """
    params = _interpret_params() if interpret else None
    kept, updated = operands[:-n_in_place], operands[-n_in_place:]
    axes = lambda: tuple(lax.axis_index(n) for n in grid_names)
    if _REFS_INTO_KERNELS and not dispatch.fresh_outputs_requested():
        refs = [jax.new_ref(x) for x in updated]

        def body(*op_refs):
            kernel(axes(), *op_refs, *op_refs[-n_in_place:])

        launch = plgpu.kernel(body, out_type=(), grid=grid, grid_names=grid_names, interpret=params, kernel_name=name)
        launch(*kept, *refs)
        return tuple(r[...] for r in refs)
    out_type = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in updated]
    if interpret or _REFS_INTO_KERNELS:  # fresh output buffers
        body = lambda *refs: kernel(axes(), *refs)
        launch = plgpu.kernel(
            body, out_type=out_type, grid=grid, grid_names=grid_names, interpret=params, kernel_name=name
        )
        return tuple(launch(*operands))
    gmem = pl.BlockSpec(memory_space=plgpu.GMEM)
    first = len(kept)
    return tuple(
        pl.pallas_call(
            lambda *refs: kernel(tuple(pl.program_id(i) for i in range(len(grid))), *refs),
            out_shape=out_type,
            grid=grid,
            in_specs=[gmem] * len(operands),
            out_specs=[gmem] * n_in_place,
            input_output_aliases={first + i: i for i in range(n_in_place)},
            compiler_params=plgpu.CompilerParams(),
            name=name,
        )(*operands)
    )
