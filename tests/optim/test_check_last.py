"""lpt.optim.check_last: a chain whose last transform is an lpt update rule passes; one where a transform after the
rule rescales its updates (the silent misuse: optax.apply_updates then rounds to nearest) is one error naming the
leaf."""

import jax
import jax.numpy as jnp
import optax
import pytest

import lpt.optim

PARAMS = {
    "w": jax.random.normal(jax.random.key(1), (64, 32), jnp.float32).astype(jnp.bfloat16),
    "b": jnp.zeros((32,), jnp.bfloat16),
    "norm": jnp.ones((32,), jnp.float32),  # an f32 leaf: passed through, not checked
}
RULES = {
    "kahan": lpt.optim.kahan_summation,
    "stochastic": lambda: lpt.optim.stochastic_rounding(seed=3),
    "nearest": lpt.optim.nearest_rounding,
    "norm_preserving": lpt.optim.norm_preserving_update,
}


@pytest.mark.parametrize("rule", RULES)
def test_a_rule_last_passes_and_a_scale_after_it_is_caught(rule):
    good = optax.chain(lpt.optim.scale_by_adam(), optax.scale_by_learning_rate(1e-2), RULES[rule]())
    assert lpt.optim.check_last(good, PARAMS) == 2
    bad = optax.chain(lpt.optim.scale_by_adam(), RULES[rule](), optax.scale_by_learning_rate(1e-2))
    with pytest.raises(ValueError, match=r"^check_last: leaf \['(b|w)'\] \(bfloat16\): \d+ of \d+ updated values"):
        lpt.optim.check_last(bad, PARAMS)


def test_a_chain_without_a_rule_is_caught_and_f32_params_are_refused():
    with pytest.raises(ValueError, match="are not bfloat16 values"):
        lpt.optim.check_last(optax.adam(1e-2), PARAMS)
    with pytest.raises(ValueError, match="no leaf narrower than float32"):
        lpt.optim.check_last(optax.adam(1e-2), {"w": jnp.ones((4,), jnp.float32)})


def test_fused_adamw_passes():
    assert lpt.optim.check_last(lpt.optim.adamw(1e-2, update="kahan"), PARAMS) == 2
