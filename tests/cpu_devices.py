"""The environment of a subprocess test that runs on ``n`` CPU devices.

``--xla_force_host_platform_device_count=n`` is added to the caller's ``XLA_FLAGS`` (any earlier device count is
replaced), so a suite run under other XLA:CPU flags (``--xla_cpu_max_isa=SSE4_2``) runs its subprocesses under
them too.
"""

import os

_COUNT = "--xla_force_host_platform_device_count="


def cpu_env(n: int, **extra: str) -> dict[str, str]:
    """``os.environ`` with JAX on the CPU, ``n`` host devices, the caller's other XLA flags, and ``extra``."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_COUNT)]
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join([*flags, f"{_COUNT}{n}"]), **extra)
