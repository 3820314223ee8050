"""The README's optax example runs as printed and does what it says: bf16 params stay bf16 and move where plain
``optax.apply_updates`` (round to nearest) would cancel the update."""

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax

import lpt.optim

README = Path(__file__).resolve().parents[1] / "README.md"


def _optax_example() -> str:
    text = README.read_text()
    section = text[text.index("## Use the update rules in your own optax chain") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_optax_example_runs_and_keeps_small_updates():
    params = {"w": jnp.full((256,), 1.0, jnp.bfloat16)}
    # Adam's first step is +lr = 3e-4 upwards, less weight decay 3e-4 * 0.1 * w: +2.7e-4, below half an ulp (2^-8)
    grads = {"w": jnp.full((256,), -1e-2, jnp.bfloat16)}
    scope = {"params_bf16": params, "grads": grads}
    exec(compile(_optax_example(), str(README), "exec"), scope)
    p = scope["params_bf16"]["w"]
    assert p.dtype == jnp.bfloat16
    assert np.all(np.asarray(p, np.float32) == 1.0)  # not applied yet
    # ... and not lost: optax's own apply on the same update drops it, the Kahan state keeps it
    plain = optax.apply_updates(params, {"w": jnp.full((256,), 2.7e-4, jnp.float32)})["w"]
    assert np.all(np.asarray(plain, np.float32) == 1.0)
    comp = np.asarray(lpt.optim.find_compensation(scope["state"])["w"], np.float32)  # bf16 -> f32
    np.testing.assert_allclose(-comp, 2.7e-4, rtol=0.02)  # the pending update (SR moments: within 1%)
    assert isinstance(scope["tx"], optax.GradientTransformation)  # the fused variant builds too
