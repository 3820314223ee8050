"""The trainer calls no deprecated API of jax, flax, optax or orbax on the jax it runs with (both ends of the
supported range run this file: .ci/run): ``python -W error::DeprecationWarning -m lpt.train`` trains 5 steps of
``tiny_cpu`` and exits 0. :data:`OTHERS` lists the warnings of other packages' own code that are ignored, by module;
it is empty: none warns here today. A call of a deprecated API by lpt (``optax.global_norm``, ``State.to_pure_dict``
on flax 0.12.12) turns into an exception and a non-zero exit."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OTHERS: tuple[str, ...] = ()  # e.g. "ignore::DeprecationWarning:tensorboardX.summary"


def test_training_raises_no_deprecation_warning(tmp_path):
    filters = [a for f in ("error::DeprecationWarning", *OTHERS) for a in ("-W", f)]
    cmd = [sys.executable, *filters, "-m", "lpt.train", "--config", "tiny_cpu", "--config.train.steps=5"]
    cmd += ["--config.train.eval_every=5", "--workdir", str(tmp_path / "run")]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    tail = "\n".join(p.stderr.splitlines()[-12:])
    assert p.returncode == 0, tail
    assert "DeprecationWarning" not in p.stderr, tail
