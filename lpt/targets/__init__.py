"""Compile-only accelerator devices on any machine: TPU topologies (libtpu) and GPU targets (the CUDA plugin).

``devices("v5e:2x4")`` returns the 8 compile-only devices of a TPU v5e 2x4 slice; ``devices("h100:1x1x8")`` the 8
devices of one host with eight H100s (``partitions x hosts x devices``; the device facts come from the target config
``h100_sxm.txtpb`` shipped beside this module). A ``jax.jit(f).lower(ShapeDtypeStructs sharded over a Mesh of these
devices).compile()`` then runs the real XLA:TPU + Mosaic or XLA:GPU + Triton + ptxas compilers, with no accelerator.

Needs ``jax[tpu]`` (libtpu) for TPU names and ``jax-cuda12-plugin`` + ``nvidia-cuda-nvcc-cu12`` for GPU names (the
``dev`` extras). Set ``JAX_PLATFORMS=cpu`` before jax initializes a backend (:func:`compile_only_environment`),
so that ordinary computation stays on the CPU and neither plugin probes for real hardware.

:func:`device_facts` gives the HBM capacity and peak dense bf16 FLOP/s of one device of a topology (the vendors' data
sheets, per chip, divided by the devices per chip when a chip shows up as several devices, e.g. v4 without megacore;
GPU memory from the target config's ``device_memory_size``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from pathlib import Path

import jax

_GPU_TARGETS = {"h100": "h100_sxm.txtpb", "b200": "b200.txtpb"}  # name -> GpuTargetConfigProto text beside this module
_TPU = re.compile(r"^(v\d+[a-z]*|tpu\d+[a-z]*):(\d+(x\d+)*)$")  # v5e:2x4, v5p:2x2x1, tpu7x:2x2x1
_GPU = re.compile(r"^([a-z0-9]+):(\d+)x(\d+)x(\d+)$")
_GIB = 1 << 30

# device_kind -> (HBM bytes per chip that the compiler may use, peak dense bf16 FLOP/s per chip), device_kind exactly as
# jax reports it. TPU HBM: what libtpu's out-of-memory error calls "available HBM" (16/95/32 GiB chips, less what
# libtpu reserves; v4 measured as 15.25 GiB per TensorCore device); H100: the target config's device_memory_size wins.
CHIP_FACTS: dict[str, tuple[int, float]] = {
    "TPU v4": (int(30.5 * _GIB), 275e12),
    "TPU v5 lite": (int(15.75 * _GIB), 197e12),  # v5e
    "TPU v5": (int(95.74 * _GIB), 459e12),  # v5p
    "TPU v6 lite": (int(31.25 * _GIB), 918e12),  # v6e (Trillium)
    "TPU7x": (192 * 10**9, 2307e12),  # Ironwood: 192 GB HBM3e and 4614 TFLOP/s FP8 per chip, half of that in bf16
    "NVIDIA H100 80GB HBM3": (80 * 10**9, 989e12),  # SXM
    "NVIDIA B200": (180 * 10**9, 2250e12),  # HGX B200: the target config's device_memory_size overrides the HBM
}


# device families the trainer may run on but that have no compile-only target: substring -> peak bf16 FLOP/s
_PEAK_BY_FAMILY: tuple[tuple[str, float], ...] = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L4", 121e12))


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device of ``device_kind`` (as jax names it), or None if unknown (e.g. CPU)."""
    if device_kind in CHIP_FACTS:
        return CHIP_FACTS[device_kind][1]
    return next((peak for name, peak in _PEAK_BY_FAMILY if name in device_kind), None)


@dataclasses.dataclass(frozen=True)
class _DeviceFacts:
    """One device of a topology: its kind, platform, HBM bytes and peak dense bf16 FLOP/s."""

    device_kind: str
    platform: str
    hbm_bytes: int
    peak_flops: float


def compile_only_environment() -> None:
    """Set the environment for compile-only targets (call before jax initializes a backend): CPU for computation,
    libtpu's host probing off, and libtpu's one-process lockfile off (compile-only processes share no chip)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: several processes may load libtpu
    if not jax.config.jax_platforms:  # jax read JAX_PLATFORMS at import; its backends start on first use
        jax.config.update("jax_platforms", "cpu")


def gpu_target_config(name: str) -> str:
    """The GpuTargetConfigProto text of GPU ``name`` (one of :data:`_GPU_TARGETS`)."""
    if name not in _GPU_TARGETS:
        raise ValueError(f"GPU target {name!r} is unknown; allowed: {sorted(_GPU_TARGETS)}")
    return (Path(__file__).parent / _GPU_TARGETS[name]).read_text()


@functools.cache
def devices(topology: str) -> tuple:
    """Compile-only devices of ``topology``: a TPU slice ``v5e:2x4`` / ``v5p:2x2x1`` / ``v6e:2x2`` (anything libtpu
    accepts) or a GPU node ``h100:1x1x8`` (partitions x hosts x devices)."""
    from jax.experimental import topologies

    if _TPU.match(topology):
        try:
            return tuple(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)
        except Exception as e:  # noqa: BLE001 -- libtpu rejects unknown chips and shapes with a runtime error
            first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise ValueError(f"topology {topology!r} is not a TPU slice libtpu knows: {first}") from None
    m = _GPU.match(topology)
    if m and m.group(1) in _GPU_TARGETS:
        try:
            topo = topologies.get_topology_desc(
                platform="cuda", target_config=gpu_target_config(m.group(1)), topology="x".join(m.groups()[1:])
            )
        except NotImplementedError as e:  # "topology not implemented for cuda": jax has no CUDA plugin registered
            raise ValueError(
                f"topology {topology!r} needs jax's CUDA plugin, which is not installed ({e}); install lpt's dev "
                "extras (jax-cuda12-plugin, jax-cuda12-pjrt, nvidia-cuda-nvcc-cu12): pip install -e '.[dev]'"
            ) from None
        return tuple(topo.devices)
    raise ValueError(
        f"topology {topology!r} is not recognised; use a TPU slice like 'v5e:2x4' or 'v5p:2x2x1', or a GPU node "
        f"'<gpu>:PxHxD' with <gpu> in {sorted(_GPU_TARGETS)} (e.g. 'h100:1x1x8')"
    )


def mesh(topology: str, shape: tuple[int, ...], axis_names: tuple[str, ...]) -> jax.sharding.Mesh:
    """A Mesh of ``shape`` over the devices of ``topology`` (the product must equal the device count)."""
    import math

    import numpy as np

    devs = devices(topology)
    if math.prod(shape) != len(devs):
        raise ValueError(f"mesh shape {shape} needs {math.prod(shape)} devices; topology {topology} has {len(devs)}")
    return jax.sharding.Mesh(np.asarray(devs, dtype=object).reshape(shape), axis_names)


@contextlib.contextmanager
def lowering_for(target):
    """A context in which programs that name no mesh lower for ``target``, a topology name (its first device) or a
    device (compile-only or real): an empty abstract mesh
    whose abstract device is that device (``jax.sharding.use_abstract_mesh``). jax >= 0.12's Pallas Triton lowering
    reads the GPU to compile for from it (without it, on a machine without that GPU: "No supported GPU devices
    found"), and ``impl="auto"`` picks its kernels by it (:func:`lpt.kernels.dispatch.target_device`); the mesh is
    empty, so the kernels run unsharded. A program jitted over a :func:`mesh` lowers under ``jax.set_mesh`` instead.

        with targets.lowering_for("h100:1x1x1"):
            jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))
    """
    import numpy as np

    one = devices(target)[:1] if isinstance(target, str) else [target]
    device = jax.sharding.Mesh(np.asarray(one, dtype=object), ("_",)).abstract_mesh.abstract_device
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        yield


def device_facts(topology: str) -> _DeviceFacts:
    """HBM capacity and peak bf16 FLOP/s of one device of ``topology`` (see :data:`CHIP_FACTS`)."""
    devs = devices(topology)
    kind, platform = devs[0].device_kind, devs[0].platform
    if kind not in CHIP_FACTS:
        raise ValueError(f"device kind {kind!r} of {topology} has no entry in CHIP_FACTS; known: {sorted(CHIP_FACTS)}")
    hbm, peak = CHIP_FACTS[kind]
    m = _GPU.match(topology)
    if platform != "tpu" and m:
        mem = re.search(r"device_memory_size:\s*(\d+)", gpu_target_config(m.group(1)))
        hbm = int(mem.group(1)) if mem else hbm
    chips = len({tuple(d.coords) for d in devs}) if platform == "tpu" else len(devs)
    per_chip = len(devs) // chips
    return _DeviceFacts(kind, platform, hbm // per_chip, peak / per_chip)
