"""One line naming the machine a result was measured on: in every run's summary.json, every benchmark's output and the
lab's timed sections.

Ratios against a baseline measured in the same run cancel most of a machine's speed, but not its balance of memory
bandwidth against arithmetic: the fused bf16 AdamW step, for example, moves less memory than the f32 baseline but does
more integer and rounding work, so its ratio differs between CPUs (see docs/results.md). A ratio is only reproducible
together with the CPU model, the vector extensions XLA may use, the core count and the load it ran under; and the
last digits of a training loss depend on the vector extensions too (f32 round-off).
"""

from __future__ import annotations

import os
import platform

import jax

# vector extensions that change what XLA:CPU emits for the f32/bf16/u32 element loops the benchmarks time
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "sve")


def parse_cpuinfo(text: str) -> tuple[str, list[str]]:
    """(model name, the :data:`_ISA_FLAGS` present) from the text of /proc/cpuinfo (x86 or Arm layout)."""
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, [f for f in _ISA_FLAGS if f in flags]


def _cpuinfo() -> tuple[str, list[str]]:
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpuinfo(f.read())
    except OSError:  # no /proc (macOS, Windows)
        return "", []


def load() -> str:
    """The 1- and 5-minute load averages, e.g. ``"0.6/0.2"`` (``"n/a"`` where the OS has none)."""
    return "/".join(f"{x:.1f}" for x in os.getloadavg()[:2]) if hasattr(os, "getloadavg") else "n/a"


def describe() -> str:
    """E.g. ``"AMD EPYC (x86_64; avx2 fma avx512f avx512_bf16), 2 cores, load 0.6/0.2, jax 0.10.2 on cpu"``; on an
    accelerator the backend names the device and the XLA flags that change results, e.g. ``"... jax 0.11.2 on gpu
    (NVIDIA H200; --xla_gpu_deterministic_ops=true)"``."""
    model, isa = _cpuinfo()
    model = model or platform.processor() or "unknown CPU"
    isa_text = f"; {' '.join(isa)}" if isa else ""
    backend = jax.default_backend()
    if backend != "cpu":
        deterministic = [f for f in os.environ.get("XLA_FLAGS", "").split() if "deterministic" in f]
        backend += f" ({'; '.join([jax.devices()[0].device_kind, *deterministic])})"
    return (
        f"{model} ({platform.machine()}{isa_text}), {os.cpu_count()} cores, load {load()} (1/5 min), "
        f"jax {jax.__version__} on {backend}"
    )
