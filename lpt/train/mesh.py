"""Device mesh from the config and logical-axis rules -> shardings.

The mesh has three axes, ``("data", "fsdp", "tensor")``; their sizes come from ``config.train.mesh``, and one of them
may be -1 to take all remaining devices. Parameters and activations carry *logical* axis names ("batch", "embed",
"mlp", ...); ``lpt.sharding.RULES`` maps each logical name to mesh axes: the first rule whose mesh axes are all still
unused in that array wins, otherwise the dim stays replicated (``lpt.sharding.logical_to_mesh``). So activations
``("batch", "length", "embed")`` is sharded over data*fsdp on its first dim and replicated on its last, while a weight
``("embed", "mlp")`` is split over fsdp on rows and tensor on columns (FSDP + Megatron-style tensor parallelism).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from lpt import sharding
from lpt.models.config import PROJECTIONS, Precision
from lpt.sharding import logical_to_mesh
from lpt.train.config import MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")
_BATCH_AXES = ("data", "fsdp")  # mesh axes the global batch is split over


def resolve_mesh_shape(mesh_cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) with a -1 entry filled so that the product equals ``num_devices``."""
    sizes = [int(mesh_cfg.data), int(mesh_cfg.fsdp), int(mesh_cfg.tensor)]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(
                f"train.mesh {dict(zip(MESH_AXES, sizes, strict=True))}: the fixed axes (product {known}) do not "
                f"divide the {num_devices} available devices"
            )
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ValueError(
            f"train.mesh {dict(zip(MESH_AXES, sizes, strict=True))} needs {math.prod(sizes)} devices but "
            f"{num_devices} are available; set one axis to -1 to fill"
        )
    return tuple(sizes)


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The ("data", "fsdp", "tensor") mesh over ``devices`` (default: all devices of all processes)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(mesh_cfg, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def _check_divisible(path: str, shape, spec: PartitionSpec, mesh: Mesh) -> None:
    for dim, axes in zip(shape, spec, strict=False):
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else axes
        n = math.prod(mesh.shape[a] for a in axes)
        if dim % n:
            raise ValueError(
                f"{path}: dimension {dim} of shape {tuple(shape)} cannot be split over mesh axes {axes} "
                f"(size {n}); change train.mesh or the model size"
            )


def tree_shardings(logical_tree, shape_tree, mesh: Mesh, rules=sharding.RULES):
    """Map a tree of logical-axis tuples (None = replicated) and a matching tree of shapes to NamedShardings."""

    def one(path, axes, x):
        spec = PartitionSpec() if axes is None else logical_to_mesh(axes, rules)
        _check_divisible(jax.tree_util.keystr(path), x.shape, spec, mesh)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(
        one, logical_tree, shape_tree, is_leaf=lambda x: x is None or isinstance(x, tuple)
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a [batch, length] token array: batch over data*fsdp, length replicated."""
    return NamedSharding(mesh, PartitionSpec(_BATCH_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def check_batch(global_batch: int, microbatches: int, mesh: Mesh) -> None:
    """Raise ValueError unless each microbatch splits evenly over the batch-sharding mesh axes."""
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = global_batch // microbatches
    if micro % n:
        raise ValueError(
            f"train.global_batch={global_batch} (microbatch {micro} with optim.microbatches={microbatches}) is not "
            f"divisible by mesh data*fsdp = {mesh.shape['data']}*{mesh.shape['fsdp']} = {n}; "
            f"choose a batch that is a multiple of {n} or change train.mesh"
        )


def check_platform(precision: Precision, platform: str) -> None:
    """Raise ValueError when the recipe needs another platform than the mesh's devices' (``"cpu"``, ``"gpu"``,
    ``"tpu"``): ``precision.fp8_impl="mosaic_gpu"`` and ``precision.attention.impl="mosaic_gpu"`` compile for CUDA
    GPUs only."""
    p = precision
    if p.attention.impl == "mosaic_gpu" and platform != "gpu":
        raise ValueError(
            f"config key precision.attention.impl='mosaic_gpu' is the Hopper flash-attention kernel and compiles for "
            f"CUDA GPUs only; this mesh's devices are {platform}: use 'xla' or 'pallas'"
        )
    fp8 = any(p.matmul_for(k) == "fp8" for k in PROJECTIONS)
    if fp8 and p.fp8_impl == "mosaic_gpu" and platform != "gpu":
        raise ValueError(
            f"config key precision.fp8_impl='mosaic_gpu' is the Hopper wgmma kernel and compiles for CUDA GPUs only; "
            f"this mesh's devices are {platform}: use 'xla' or 'pallas'"
        )
