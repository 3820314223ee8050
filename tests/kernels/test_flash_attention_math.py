"""The block rules of lpt/kernels/flash_attention/math.py (running max, repeat count across blocks, the
shift rule) that the Pallas kernel and its XLA twin share; both are run through them in interpret mode in
test_flash_attention_reference.py."""

import jax.numpy as jnp
import numpy as np

from lpt.attention import AttentionPolicy
from lpt.kernels.flash_attention import math as fm


def test_repeat_count_runs_across_blocks():
    s = jnp.array([[0.5, 2.0, 1.0, 2.0, -1.0, 2.0 - 2.0**-11, 0.0, 1.9]])
    valid = jnp.ones_like(s, bool)
    m, n = jnp.full((1, 1), -jnp.inf), jnp.zeros((1, 1))
    for blk in range(4):
        m, n = fm.update_max_count(m, n, s[:, 2 * blk : 2 * blk + 2], valid[:, :2], 2.0**-9)
    assert float(m[0, 0]) == 2.0 and float(n[0, 0]) == 3.0  # two exact repeats and one within tie_tol
    c = fm.shift_of(m, n, AttentionPolicy(shift="beta", beta=7.0))
    assert float(c[0, 0]) == 14.0  # β·m for a repeated positive max
    c = fm.shift_of(jnp.full((1, 1), 30.0), n, AttentionPolicy(shift="beta", beta=7.0, max_offset=64.0))
    assert float(c[0, 0]) == 94.0  # underflow guard: offset capped at 64 instead of (β − 1)·30 = 180
    m = jnp.array([[9.2], [9.3], [9.4], [20.05]])
    o = fm.shift_of(m, jnp.full_like(m, 2.0), AttentionPolicy(shift="beta", beta=8.0)) - m
    raw = 7.0 * m  # 64.4, 65.1, 65.8, 140.35: all above the cap
    np.testing.assert_allclose(o, 64.0 - (raw - jnp.floor(raw)), rtol=1e-5)  # dithered in (63, 64], not a constant
    assert len(set(np.asarray(o).ravel().tolist())) == 4
    c = fm.shift_of(jnp.full((1, 1), -3.0), n, AttentionPolicy(shift="beta"))
    assert float(c[0, 0]) == 0.0  # negative repeated max: shift 0
