"""benchmarks/gpu_all.sh, the one command for a machine with a GPU: its parts' time limits add up to at most 7.5
minutes (under 8 with the start), and on a machine without a GPU it says so once per part and exits 0 at once."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_all.sh"


def test_the_limits_fit_eight_minutes():
    limits = dict(re.findall(r"^(?:\w+=\S+ )?part (\w+) (\d+) ", SCRIPT.read_text(), re.M))
    assert set(limits) == {"kernels", "attention", "fp8", "optim", "train_step", "train_1b"}, limits
    assert sum(int(v) for v in limits.values()) <= 450, limits


def test_without_a_gpu_each_part_says_so(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "logs")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["kernels", "attention", "fp8", "optim", "train_step", "train_1b"], (
        lines
    )
    assert all(ln.endswith("skipped, no GPU here (jax finds no CUDA device)") for ln in lines), lines
