"""The layering of docs/design.md holds at import time: what a user imports pulls in nothing above it.

``import lpt.optim`` (optax transforms) and ``import lpt.numerics`` must not load Pallas or Flax; the Pallas kernels
are imported only by the code paths that run them.
"""

import subprocess
import sys

import pytest

CHECK = (
    "import sys, importlib; importlib.import_module({mod!r}); "
    "print(sorted({{m.split('.')[0] + '.' + m.split('.')[2] if m.startswith('jax.experimental.pallas') "
    "else m.split('.')[0] for m in sys.modules if m.startswith(('jax.experimental.pallas', 'flax'))}}))"
)


@pytest.mark.parametrize("mod", ["lpt.numerics", "lpt.optim", "lpt.kernels.adamw_kahan_math"])
def test_import_pulls_in_no_pallas_and_no_flax(mod):
    out = subprocess.run([sys.executable, "-c", CHECK.format(mod=mod)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"{mod} imports {out.stdout.strip()}"


def test_the_check_can_see_pallas():
    out = subprocess.run(
        [sys.executable, "-c", CHECK.format(mod="lpt.kernels.adamw_kahan")], capture_output=True, text=True, timeout=120
    )
    assert "pallas" in out.stdout, out.stdout + out.stderr[-500:]
