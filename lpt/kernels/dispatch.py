"""Platform dispatch for every Pallas kernel: one place that decides interpret / Triton / Mosaic.

A kernel module describes its ``pallas_call`` once, as ``build(mode) -> callable``, and runs it with
:func:`platform_call`. The modes:

* ``"interpret"``: the Pallas interpreter (any platform; what runs on CPU),
* ``"triton"``: compiled with Triton on CUDA GPUs,
* ``"mosaic"``: compiled with Mosaic on TPUs,
* ``"mosaic_gpu"``: compiled with Mosaic GPU on Hopper GPUs, for a kernel that has that variant
  (``platform_call(..., mosaic_gpu=True)``; the others run Triton there).

``interpret=True`` forces the interpreter everywhere; ``interpret=None`` picks per platform (interpreter on CPU, Triton
or Mosaic GPU on CUDA, Mosaic on TPU), never by looking at ``jax.default_backend()``: by the devices of the mesh in
effect where one names them (the trainer's ``jax.set_mesh``, :func:`lpt.targets.lowering_for`), and then only that
platform's kernel is traced; else at lowering time with ``jax.lax.platform_dependent``, so one jitted function lowers
correctly for whichever device it is compiled for (its CUDA branch chosen by :func:`target_device`).

The mesh side: a ``pallas_call`` cannot be partitioned by XLA (Mosaic refuses; Triton gets its operands
all-gathered), so a kernel wrapper that runs under a multi-device mesh wraps its per-shard function in
:func:`shard_map`. :func:`kernel_mesh` names that mesh: an explicit ``mesh=`` argument, else the mesh of
``jax.set_mesh`` (``jax.sharding.get_abstract_mesh()``), else none, and then the kernel runs unwrapped.
:func:`as_axes`, :func:`mesh_axis_size` and :func:`check_divisible` help the wrappers validate their specs;
:func:`mesh_platform` says which devices a mesh holds, for a wrapper that must refuse a platform at trace time;
:func:`target_device` and :func:`hopper` say which device a program is lowered for, for a wrapper that picks an
implementation by it (``impl="auto"``).

A kernel that compiles for one platform only and cannot be chosen by ``lax.platform_dependent`` (the Mosaic GPU
kernels: their interpreter, the only CPU branch there could be, carries IO effects that a cond over platforms cannot
lower for CUDA) passes its operands through :func:`require_platform`: they come back unchanged (no HLO op), and
lowering them for another platform raises a one-line ValueError that the caller words, instead of the kernel's own
lowering error.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import math
import re
from collections.abc import Callable, Sequence

import jax
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

_MODES = ("interpret", "triton", "mosaic", "mosaic_gpu")


def kernel(module: str, name: str) -> Callable:
    """The kernel ``name`` of the Pallas module ``module`` (e.g. ``"lpt.kernels.adamw_kahan.kernel"``), imported when a
    wrapper first calls it: a module above ``lpt.kernels`` imports the wrappers at its top and loads Pallas only on
    the code path that runs a kernel (``import lpt.optim`` loads none)."""
    return getattr(importlib.import_module(module), name)


_FRESH_OUTPUTS = contextvars.ContextVar("lpt_kernels_fresh_outputs", default=False)


@contextlib.contextmanager
def fresh_outputs():
    """Inside, kernels that update operands in place through mutable references (the Mosaic GPU kernels on jax >=
    0.11, :func:`lpt.kernels.compat.mgpu_in_place`) write new output buffers instead: for a kernel traced where
    ``jax.new_ref`` cannot be lowered (a ``custom_partitioning`` partition callback: "Cannot lower jaxpr with
    effects"). The same numbers; XLA may copy the outputs into the operands' buffers."""
    token = _FRESH_OUTPUTS.set(True)
    try:
        yield
    finally:
        _FRESH_OUTPUTS.reset(token)


def fresh_outputs_requested() -> bool:
    """Whether :func:`fresh_outputs` is in effect."""
    return _FRESH_OUTPUTS.get()


def check_auto_interpret(interpret) -> None:
    """Raise ValueError unless ``interpret`` is None: ``impl="auto"`` compiles what the platform runs best, and a
    kernel to interpret must be named."""
    if interpret is not None:
        raise ValueError(
            f"interpret={interpret!r}: impl='auto' compiles what the platform runs best; name the kernel to "
            "interpret (impl='pallas' or 'mosaic_gpu')"
        )


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
    # each compiler's Pallas module is imported by the mode that compiles for it, so importing lpt, and every path
    # that traces no such kernel (the XLA twins, the Mosaic GPU kernels), never loads Pallas' deprecated Triton
    # backend (jax >= 0.11)
    if mode == "triton":
        from jax.experimental.pallas import triton as pltriton

        return {"compiler_params": pltriton.CompilerParams(**triton)}
    if mode == "mosaic":
        from jax.experimental.pallas import tpu as pltpu

        sem = tuple(semantics) if semantics is not None else ("parallel",) * grid_rank
        return {"compiler_params": pltpu.CompilerParams(dimension_semantics=sem)}
    raise ValueError(f"mode={mode!r} is not one of {_MODES}")


_MODE_OF_PLATFORM = {"cpu": "interpret", "gpu": "triton", "tpu": "mosaic"}  # a device's platform -> its mode


def _gpu_mode(device, mosaic_gpu: bool) -> str:
    """The CUDA mode for ``device``: Mosaic GPU where the kernel has it and the device runs it (or is not a GPU: a
    program lowered for CUDA from a CPU process), else Triton."""
    if mosaic_gpu and (getattr(device, "platform", None) != "gpu" or hopper(device)):
        return "mosaic_gpu"
    return "triton"


def platform_call(build: Callable[[str], Callable], *args, interpret: bool | None, mosaic_gpu: bool = False):
    """``build(mode)(*args)``: interpreted if ``interpret``; else the mode of the platform that :func:`named_device`
    names (the devices of the mesh in effect), so that only that platform's kernel is traced; else, when no mesh
    names a device, every mode under ``lax.platform_dependent``, picked at lowering time. ``mosaic_gpu``: ``build``
    has a ``"mosaic_gpu"`` variant, which serves Hopper GPUs (:func:`hopper`; Triton serves the others)."""
    check_interpret(interpret)
    if interpret:
        return build("interpret")(*args)
    device = named_device()
    if device is not None:
        mode = _MODE_OF_PLATFORM[device.platform]
        return build(_gpu_mode(device, mosaic_gpu) if mode == "triton" else mode)(*args)
    cuda = build(_gpu_mode(target_device(), mosaic_gpu))
    return lax.platform_dependent(*args, cpu=build("interpret"), cuda=cuda, tpu=build("mosaic"))


def kernel_mesh(mesh=None):
    """The mesh a kernel runs on: ``mesh`` if given, else the mesh of ``jax.set_mesh`` (abstract inside jit) if it is
    not empty, else None (the kernel runs on whole arrays, as on one device)."""
    if mesh is not None:
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    return None if abstract.empty else abstract


def mesh_platform(mesh) -> str | None:
    """The platform of ``mesh``'s devices ("tpu", "cuda", "cpu"): the devices' own, or an abstract mesh's abstract
    device; None when an abstract mesh names no device (``AbstractMesh`` built by hand)."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh.devices.flat[0].platform
    device = mesh.abstract_device
    return None if device is None else device.platform


def named_device(mesh=None):
    """The device a program is lowered for where a mesh names it, as a kernel wrapper sees it at trace time: the
    first device of ``mesh`` (or, when None, of the ``jax.set_mesh`` mesh: an abstract mesh's abstract device, also
    that of an empty abstract mesh that names one, as :func:`lpt.targets.lowering_for` sets); None when no mesh names
    one. It has ``platform`` ("cpu", "gpu", "tpu") and ``device_kind``."""
    mesh = kernel_mesh(mesh)
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh.devices.flat[0]
    abstract = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    return abstract.abstract_device


def target_device(mesh=None):
    """:func:`named_device`, else ``jax.devices()[0]`` (what a program that names no mesh runs on)."""
    device = named_device(mesh)
    return jax.devices()[0] if device is None else device


_HOPPER_KINDS = re.compile(r"\b(GH200|H100|H200|H800|H20)\b")


def hopper(device) -> bool:
    """Whether ``device`` is a Hopper GPU (compute capability 9.0: wgmma, TMA), by its compute capability where the
    device has one, else by its kind (an abstract device, a compile-only target)."""
    if getattr(device, "platform", None) != "gpu":
        return False
    cc = getattr(device, "compute_capability", None)
    if cc is not None:
        return str(cc) == "9.0"
    return bool(_HOPPER_KINDS.search(str(device.device_kind)))


def as_axes(axes) -> tuple[str, ...]:
    """A ``PartitionSpec`` entry (a name, a tuple of names, or None) as a tuple of mesh axis names."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def mesh_axis_size(mesh, axes) -> int:
    """Product of the sizes of mesh ``axes`` (a ``PartitionSpec`` entry; None -> 1)."""
    return math.prod(mesh.shape[a] for a in as_axes(axes))


def check_divisible(what: str, size: int, mesh, axes) -> int:
    """``size // mesh_axis_size(mesh, axes)``; ValueError naming ``what`` if the split is not even."""
    n = mesh_axis_size(mesh, axes)
    if size % n:
        raise ValueError(f"{what}={size} is not divisible by mesh axes {as_axes(axes)} of size {n}")
    return size // n


def shard_map(fn: Callable, mesh, in_specs: Sequence, out_specs):
    """``fn`` run per shard on ``mesh`` (``jax.shard_map`` with ``check_vma=False``), or ``fn`` itself when ``mesh``
    is None or has one device.

    ``check_vma=False`` because ``pallas_call``'s ``out_shape`` carries no varying-manual-axes type; for the same
    reason gradients are not taken through the result: callers wrap the forward and the backward of their
    ``custom_vjp`` each in its own shard_map and write the cross-shard sums (``lax.psum``) themselves.
    """
    if mesh is None or mesh.size == 1:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False)


_require_platform_p = Primitive("lpt_require_platform")
_require_platform_p.multiple_results = True
_require_platform_p.def_abstract_eval(lambda *avals, **_: avals)


@functools.partial(jax.jit, static_argnames=("platforms", "message"))
def _require_platform_jit(*args, platforms, message):  # an eager call: lowered (and so checked) for its device
    return _require_platform_p.bind(*args, platforms=platforms, message=message)


_require_platform_p.def_impl(_require_platform_jit)


def _require_platform_lowering(ctx, *args, platforms, message):
    lowering = tuple(ctx.platforms or ctx.module_context.platforms)
    if any(p not in platforms for p in lowering):
        raise ValueError(message.format(platform=",".join(lowering)))
    return args


mlir.register_lowering(_require_platform_p, _require_platform_lowering)
ad.primitive_jvps[_require_platform_p] = lambda xs, ts, **kw: (_require_platform_p.bind(*xs, **kw), ts)
batching.primitive_batchers[_require_platform_p] = lambda xs, dims, **kw: (_require_platform_p.bind(*xs, **kw), dims)


def require_platform(platforms: Sequence[str], message: str, *args):
    """``args`` unchanged (a tuple); lowering them for a platform not in ``platforms`` ("cuda", "rocm", "cpu",
    "tpu") raises ``ValueError(message)``, ``{platform}`` in it replaced by the platform lowered for. The check runs
    where the platform is known, at lowering (``jit``, ``.lower(...)``, an eager call), never by looking at
    ``jax.default_backend()``; nothing is added to the program."""
    return tuple(_require_platform_p.bind(*args, platforms=tuple(platforms), message=message))
