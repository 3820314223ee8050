"""The Pallas APIs whose spelling changed between the jax versions lpt supports, each written once here.

* ``plgpu.load``: jax 0.10 takes the index as a positional argument; jax 0.11 deprecates passing it (the reference
  is indexed with ``ref.at[...]`` first) and makes it optional; jax 0.12 has no index argument. :func:`mgpu_load`
  loads a whole reference in each.

(``plgpu.transpose_ref(ref, perm)``, deprecated in jax 0.11, is ``ref.transpose(perm)`` in every supported version,
which the kernels call directly.)
"""

from __future__ import annotations

import inspect

from jax.experimental.pallas import mosaic_gpu as plgpu

_LOAD_INDEX = inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_TAKES_INDEX = _LOAD_INDEX is not None and _LOAD_INDEX.default is inspect.Parameter.empty


def mgpu_load(ref, *, layout):
    """``plgpu.load`` of all of ``ref`` into registers of ``layout``."""
    if _LOAD_TAKES_INDEX:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)
