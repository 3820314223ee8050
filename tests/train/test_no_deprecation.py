"""The trainer calls no deprecated API of jax, flax, optax or orbax on the jax it runs with (both ends of the
supported range run this file: .ci/run): ``python -W error::DeprecationWarning -m lpt.train --config tiny_cpu``
trains and exits 0. It trains the suite's small ``tiny_cpu`` (:data:`tiny_run.TRAIN_FLAGS`, 6 steps: checkpoints,
logging every step, validation), the run of test_train_faults, test_object_storage and test_console, so that its
programs come from the run's shared compilation cache; the sizes change no API call the trainer makes.
:data:`OTHERS` lists the warnings of other packages' own code that are ignored, by module; it is empty: none warns
here today. A call of a deprecated API by lpt (``optax.global_norm``, ``State.to_pure_dict`` on flax 0.12.12) turns
into an exception and a non-zero exit."""

import os
import subprocess
import sys
from pathlib import Path

from tiny_run import TRAIN_FLAGS

ROOT = Path(__file__).resolve().parents[2]
OTHERS: tuple[str, ...] = ()  # e.g. "ignore::DeprecationWarning:tensorboardX.summary"


def test_training_raises_no_deprecation_warning(tmp_path):
    filters = [a for f in ("error::DeprecationWarning", *OTHERS) for a in ("-W", f)]
    cmd = [sys.executable, *filters, "-m", "lpt.train", "--config", "tiny_cpu", *TRAIN_FLAGS, "--config.train.steps=6"]
    cmd += ["--config.train.eval_every=6", "--workdir", str(tmp_path / "run")]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    tail = "\n".join(p.stderr.splitlines()[-12:])
    assert p.returncode == 0, tail
    assert "DeprecationWarning" not in p.stderr, tail
