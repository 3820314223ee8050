"""lpt.targets: compile-only devices of TPU slices (libtpu) and GPU nodes (the CUDA plugin + a shipped target)."""

import pytest
from jax.experimental import topologies

from lpt import targets


def test_tpu_slice_devices_are_libtpus_own():
    devs = targets.devices("v5e:2x2")
    direct = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices
    assert [d.id for d in devs] == [d.id for d in direct] and len(devs) == 4
    assert devs[0].device_kind == "TPU v5 lite" and devs[0].platform == "tpu"


def test_gpu_node_uses_the_shipped_h100_target():
    devs = targets.devices("h100:1x1x8")
    assert len(devs) == 8 and devs[0].device_kind == "NVIDIA H100 80GB HBM3"
    facts = targets.device_facts("h100:1x1x8")
    assert facts.hbm_bytes == 84978434048 and facts.peak_flops == 989e12  # device_memory_size of h100_sxm.txtpb


def test_mesh_and_facts():
    mesh = targets.mesh("v5e:2x2", (2, 2), ("data", "tensor"))
    assert dict(mesh.shape) == {"data": 2, "tensor": 2}
    assert targets.device_facts("v5e:2x2").hbm_bytes == int(15.75 * 2**30)
    assert targets.peak_flops("TPU v5") == 459e12 and targets.peak_flops("cpu") is None


@pytest.mark.parametrize(
    "topology, message",
    [
        ("v9x", "topology 'v9x' is not recognised"),
        ("a100:1x1x8", "topology 'a100:1x1x8' is not recognised"),
    ],
)
def test_unknown_topologies_are_one_line_errors(topology, message):
    with pytest.raises(ValueError, match=message):
        targets.devices(topology)


def test_mesh_that_does_not_cover_the_topology():
    with pytest.raises(ValueError, match=r"mesh shape \(3,\) needs 3 devices; topology v5e:2x2 has 4"):
        targets.mesh("v5e:2x2", (3,), ("data",))
