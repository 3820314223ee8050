"""NNX side of lpt.pqt: Eq. 11 bitwidth, Eq. 12 loss, diagnostics, GaussWSLinear, per-layer keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lpt.pqt as pqt


class TwoLayers(nnx.Module):
    def __init__(self, rngs):
        self.out = pqt.GaussWSLinear(40, 70, use_bias=True, rngs=rngs)
        self.down = pqt.GaussWSLinear(70, 40, method="diffq", rngs=rngs)

    def __call__(self, x, key=None):
        return self.down(self.out(x, key), key)


def test_bitwidth_eq11_and_loss_eq12():
    model = pqt.assign_pqt_paths(TwoLayers(nnx.Rngs(0)))
    bw = model.out.bitwidth
    assert isinstance(bw, pqt.PQTBitwidth) and bw.shape == (2, 3) and (bw.b_init, bw.b_target) == (6.0, 4.0)
    np.testing.assert_array_equal(np.asarray(pqt.bitwidth_of(bw)), np.full((2, 3), 6.0))  # b_i = 1 -> b_init
    b_i = np.array([[1.0, 0.5, -0.25], [2.0, 0.1, 0.75]], np.float32)
    model.out.bitwidth[...] = jnp.asarray(b_i)
    bt = 4.0 + b_i * 2.0  # Eq. 11
    np.testing.assert_allclose(np.asarray(pqt.bitwidth_of(model.out.bitwidth)), bt)
    lam = 1e-2
    # Eq. 12: λ Σ_layers mean_tiles |b_t − b_target|; the untouched layer contributes |6 − 4| = 2
    expected = lam * (np.mean(np.abs(bt - 4.0)) + 2.0)
    loss, grads = nnx.jit(nnx.value_and_grad(lambda m: pqt.bitwidth_loss(m, lam)))(model)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
    g = np.asarray(grads.out.bitwidth[...])
    np.testing.assert_allclose(g, lam * np.sign(bt - 4.0) * 2.0 / 6, rtol=1e-6)  # ∂/∂b_i = λ·sign·(6−4)/m_i


def test_bitwidth_stats_are_parameter_weighted():
    model = pqt.assign_pqt_paths(TwoLayers(nnx.Rngs(0)))
    bt = np.array([[4.0, 5.5, 10.0], [13.0, 9.0, 5.0]], np.float32)
    model.out.bitwidth[...] = jnp.asarray((bt - 4.0) / 2.0)  # invert Eq. 11
    stats = jax.jit(pqt.bitwidth_stats)(model)
    sizes = np.array([[1024, 1024, 192], [256, 256, 48]], np.float64)  # 40×70 kernel: partial edge tiles
    assert np.asarray(pqt.tile_sizes((40, 70), 32)).tolist() == sizes.tolist()
    n = sizes.sum()
    assert n == 40 * 70
    s = {k: float(v) for k, v in stats.items()}
    np.testing.assert_allclose(s["pqt/out/bitwidth/bt_mean"], (bt * sizes).sum() / n, rtol=1e-6)
    assert s["pqt/out/bitwidth/bt_min"] == 4.0 and s["pqt/out/bitwidth/bt_max"] == 13.0
    np.testing.assert_allclose(s["pqt/out/bitwidth/frac_le5"], (1024 + 48) / n, rtol=1e-6)
    np.testing.assert_allclose(s["pqt/out/bitwidth/frac_le9"], (1024 + 48 + 1024 + 256) / n, rtol=1e-6)
    np.testing.assert_allclose(s["pqt/out/bitwidth/frac_le12"], (n - 256) / n, rtol=1e-6)
    # over both layers (the diffq layer sits at b_t = 6 everywhere)
    np.testing.assert_allclose(s["pqt/all/frac_le5"], (1024 + 48) / (2 * n), rtol=1e-6)
    np.testing.assert_allclose(s["pqt/all/frac_le9"], (1024 + 48 + 1024 + 256 + n) / (2 * n), rtol=1e-6)
    np.testing.assert_allclose(s["pqt/all/bt_mean"], ((bt * sizes).sum() + 6 * n) / (2 * n), rtol=1e-6)


def test_linear_layer_forward_backward_and_keys():
    model = pqt.assign_pqt_paths(TwoLayers(nnx.Rngs(0)))
    assert (model.out.pqt_path, model.down.pqt_path) == ("out", "down")
    x = jax.random.normal(jax.random.key(1), (8, 40))
    key = pqt.step_key(jax.random.key(0), 12)

    @nnx.jit
    def run(model, x, key):
        def loss(model):
            return jnp.sum(model.out(x, key).astype(jnp.float32) ** 2)  # bf16 -> f32

        y, g = model.out(x, key), nnx.grad(loss)(model)
        return y, model.out(x, None), g.out.bitwidth[...]

    y, y_eval, g_bi = run(model, x, key)
    kernel, bias = model.out.kernel[...], model.out.bias[...]
    layer_key = pqt.layer_key(key, "out")

    @jax.jit
    def expected(kernel, bias, x, b_i):
        w_hat = pqt.gaussws(kernel, pqt.effective_bitwidth(b_i), layer_key)
        y_f32 = jnp.dot(x.astype(jnp.bfloat16), w_hat, preferred_element_type=jnp.float32) + bias  # f32 -> bf16 x
        w_plain = kernel.astype(jnp.bfloat16)  # f32 -> bf16
        y_plain = jnp.dot(x.astype(jnp.bfloat16), w_plain, preferred_element_type=jnp.float32) + bias
        return y_f32.astype(jnp.bfloat16), y_plain.astype(jnp.bfloat16)  # f32 -> bf16

    b_i = model.out.bitwidth[...]
    y_exp, y_plain = expected(kernel, bias, x, b_i)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_exp, np.float32))
    np.testing.assert_array_equal(np.asarray(y_eval, np.float32), np.asarray(y_plain, np.float32))
    assert np.mean(np.asarray(y, np.float32) != np.asarray(y_plain, np.float32)) > 0.5  # noise changed y
    # chain rule through Eq. 11: ∂L/∂b_i = (b_init − b_target) · ∂L/∂b_t
    g_bt = jax.jit(
        jax.grad(
            lambda bt: jnp.sum(
                (
                    jnp.dot(
                        x.astype(jnp.bfloat16),
                        pqt.gaussws(kernel, bt, layer_key),
                        preferred_element_type=jnp.float32,
                    )
                    + bias
                )
                .astype(jnp.bfloat16)
                .astype(jnp.float32)
                ** 2
            )
        )
    )(pqt.effective_bitwidth(b_i))
    np.testing.assert_allclose(np.asarray(g_bi), 2.0 * np.asarray(g_bt), rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(g_bi) != 0)


def test_layer_errors():
    layer = pqt.GaussWSLinear(64, 64, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="pqt_path is unset"):
        layer(jnp.ones((2, 64)), jax.random.key(0))
    with pytest.raises(ValueError, match="b_target=3.0 conflicts"):
        pqt.apply_pqt(layer.kernel, layer.bitwidth, jax.random.key(0), b_target=3.0)
    with pytest.raises(ValueError, match="kernel shape"):
        pqt.apply_pqt(jnp.ones((64, 32)), layer.bitwidth, jax.random.key(0))
    with pytest.raises(ValueError, match="unknown PQT method"):
        pqt.GaussWSLinear(8, 8, method="uniform", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="b_init != b_target"):
        pqt.init_bitwidth((64, 64), b_init=4.0, b_target=4.0)
