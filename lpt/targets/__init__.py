"""Compile-only accelerator devices on any machine: TPU topologies (libtpu) and GPU targets (the CUDA plugin).

``devices("v5e:2x4")`` returns the 8 compile-only devices of a TPU v5e 2x4 slice; ``devices("h100:1x1x8")`` the 8
devices of one host with eight H100s (``partitions x hosts x devices``; the device facts come from the target config
``h100_sxm.txtpb`` shipped beside this module). A ``jax.jit(f).lower(ShapeDtypeStructs sharded over a Mesh of these
devices).compile()`` then runs the real XLA:TPU + Mosaic or XLA:GPU + Triton + ptxas compilers, with no accelerator.

Needs ``jax[tpu]`` (libtpu) for TPU names and ``jax-cuda12-plugin`` + ``nvidia-cuda-nvcc-cu12`` for GPU names (the
``dev`` extras). Set ``JAX_PLATFORMS=cpu`` before jax initializes a backend (:func:`compile_only_environment`),
so that ordinary computation stays on the CPU and neither plugin probes for real hardware.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import jax

GPU_TARGETS = {"h100": "h100_sxm.txtpb"}  # name -> GpuTargetConfigProto text shipped beside this module
_TPU = re.compile(r"^v(\d+)([a-z]*):(\d+(x\d+)*)$")
_GPU = re.compile(r"^([a-z0-9]+):(\d+)x(\d+)x(\d+)$")


def compile_only_environment() -> None:
    """Set the environment for compile-only targets (call before jax initializes a backend): CPU for computation,
    and libtpu's host probing off."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    if not jax.config.jax_platforms:  # jax read JAX_PLATFORMS at import; its backends start on first use
        jax.config.update("jax_platforms", "cpu")


def gpu_target_config(name: str) -> str:
    """The GpuTargetConfigProto text of GPU ``name`` (one of :data:`GPU_TARGETS`)."""
    if name not in GPU_TARGETS:
        raise ValueError(f"GPU target {name!r} is unknown; allowed: {sorted(GPU_TARGETS)}")
    return (Path(__file__).parent / GPU_TARGETS[name]).read_text()


@functools.cache
def devices(topology: str) -> tuple:
    """Compile-only devices of ``topology``: a TPU slice ``v5e:2x4`` / ``v5p:2x2x1`` / ``v6e:2x2`` (anything libtpu
    accepts) or a GPU node ``h100:1x1x8`` (partitions x hosts x devices)."""
    from jax.experimental import topologies

    if _TPU.match(topology):
        return tuple(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)
    m = _GPU.match(topology)
    if m and m.group(1) in GPU_TARGETS:
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=gpu_target_config(m.group(1)), topology="x".join(m.groups()[1:])
        )
        return tuple(topo.devices)
    raise ValueError(
        f"topology {topology!r} is not recognised; use a TPU slice like 'v5e:2x4' or 'v5p:2x2x1', or a GPU node "
        f"'<gpu>:PxHxD' with <gpu> in {sorted(GPU_TARGETS)} (e.g. 'h100:1x1x8')"
    )


def mesh(topology: str, shape: tuple[int, ...], axis_names: tuple[str, ...]) -> jax.sharding.Mesh:
    """A Mesh of ``shape`` over the devices of ``topology`` (the product must equal the device count)."""
    import math

    import numpy as np

    devs = devices(topology)
    if math.prod(shape) != len(devs):
        raise ValueError(f"mesh shape {shape} needs {math.prod(shape)} devices; topology {topology} has {len(devs)}")
    return jax.sharding.Mesh(np.asarray(devs, dtype=object).reshape(shape), axis_names)
