"""The machine line printed beside every timing: parsed from /proc/cpuinfo for x86 and Arm layouts."""

import os

from lpt.train import machine

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9454P 48-Core Processor
flags\t\t: fpu sse sse2 avx fma avx2 avx512f avx512_bf16 sha_ni
processor\t: 1
model name\t: AMD EPYC 9454P 48-Core Processor
flags\t\t: fpu sse sse2
"""

ARM = """processor\t: 0
Features\t: fp asimd evtstrm aes sve
CPU implementer\t: 0x41
"""


def test_parse_cpuinfo_x86_takes_the_first_core_and_only_the_listed_isa_flags():
    model, isa = machine.parse_cpuinfo(X86)
    assert model == "AMD EPYC 9454P 48-Core Processor"
    assert isa == ["avx2", "fma", "avx512f", "avx512_bf16"]  # avx, sse, sha_ni are not timing-relevant here


def test_parse_cpuinfo_arm_features_and_missing_model():
    assert machine.parse_cpuinfo(ARM) == ("", ["asimd", "sve"])


def test_describe_names_cores_load_and_backend():
    line = machine.describe()
    assert f"{os.cpu_count()} cores" in line and "load " in line and " on cpu" in line


def test_describe_on_an_accelerator_names_the_device_and_the_deterministic_flag(monkeypatch):
    class Device:
        device_kind = "NVIDIA H200"

    monkeypatch.setattr(machine.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(machine.jax, "devices", lambda: [Device()])
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_gpu_deterministic_ops=true")
    assert machine.describe().endswith(" on gpu (NVIDIA H200; --xla_gpu_deterministic_ops=true)")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert machine.describe().endswith(" on gpu (NVIDIA H200)")
