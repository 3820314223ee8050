"""NNX side of lpt.pqt: Eq. 11 bitwidth, Eq. 12 loss, diagnostics, GaussWSLinear, per-layer keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lpt.pqt as pqt
from lpt.pqt.bitwidth import tile_sizes


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
    np.testing.assert_array_equal(np.asarray(bw[...]), np.ones((2, 3)))  # b_i = 1 at init: b_t = b_init
    b_i = np.array([[1.0, 0.5, -0.25], [2.0, 0.1, 0.75]], np.float32)
    model.out.bitwidth[...] = jnp.asarray(b_i)
    bt = 4.0 + b_i * 2.0  # Eq. 11
    lam = 1e-2

    @nnx.jit
    def run(model):
        loss, grads = nnx.value_and_grad(lambda m: pqt.bitwidth_loss(m, lam))(model)
        return pqt.bitwidth_of(model.out.bitwidth), pqt.bitwidth_of(model.down.bitwidth), loss, grads

    bt_out, bt_down, loss, grads = run(model)
    np.testing.assert_allclose(np.asarray(bt_out), bt, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(bt_down), np.full((3, 2), 6.0))
    # Eq. 12: λ Σ_layers mean_tiles |b_t − b_target|; the untouched layer contributes |6 − 4| = 2
    np.testing.assert_allclose(float(loss), lam * (np.mean(np.abs(bt - 4.0)) + 2.0), rtol=1e-6)
    g = np.asarray(grads.out.bitwidth[...])
    np.testing.assert_allclose(g, lam * np.sign(bt - 4.0) * 2.0 / 6, rtol=1e-6)  # ∂/∂b_i = λ·sign·(6−4)/m_i


def test_bitwidth_stats_are_parameter_weighted():
    model = pqt.assign_pqt_paths(TwoLayers(nnx.Rngs(0)))
    bt = np.array([[4.0, 5.5, 10.0], [13.0, 9.0, 5.0]], np.float32)
    model.out.bitwidth[...] = jnp.asarray((bt - 4.0) / 2.0)  # invert Eq. 11
    stats = jax.jit(pqt.bitwidth_stats)(model)
    sizes = np.array([[1024, 1024, 192], [256, 256, 48]], np.float64)  # 40×70 kernel: partial edge tiles
    assert np.asarray(tile_sizes((40, 70), 32)).tolist() == sizes.tolist()
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
    x = np.random.default_rng(1).standard_normal((8, 40)).astype(np.float32)

    @nnx.jit
    def run(model, x):
        key = pqt.step_key(jax.random.key(0), 12)
        layer = model.out

        def loss(layer):
            return jnp.sum(layer(x, key).astype(jnp.float32) ** 2)  # bf16 -> f32

        got = (layer(x, key), layer(x, None), nnx.grad(loss)(layer).bitwidth[...])
        # the same by hand: ŵ from gaussws with the layer's key, bf16 GEMM, f32 accumulation, + bias
        kernel, bias, b_i = layer.kernel[...], layer.bias[...], layer.bitwidth[...]
        lkey = pqt.layer_key(key, "out")
        x_c = x.astype(jnp.bfloat16)  # f32 -> bf16

        def by_hand(bt):
            y_f32 = jnp.dot(x_c, pqt.gaussws(kernel, bt, lkey), preferred_element_type=jnp.float32) + bias
            return y_f32.astype(jnp.bfloat16)  # f32 -> bf16

        y_plain = (jnp.dot(x_c, kernel.astype(jnp.bfloat16), preferred_element_type=jnp.float32) + bias).astype(
            jnp.bfloat16
        )  # f32 -> bf16 kernel, f32 -> bf16 output
        bt = pqt.effective_bitwidth(b_i)
        g_bt = jax.grad(lambda bt: jnp.sum(by_hand(bt).astype(jnp.float32) ** 2))(bt)  # bf16 -> f32
        return got, (by_hand(bt), y_plain, g_bt)

    (y, y_eval, g_bi), (y_exp, y_plain, g_bt) = run(model, x)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_exp, np.float32))
    np.testing.assert_array_equal(np.asarray(y_eval, np.float32), np.asarray(y_plain, np.float32))
    assert np.mean(np.asarray(y, np.float32) != np.asarray(y_plain, np.float32)) > 0.5  # noise changed y
    # chain rule through Eq. 11: ∂L/∂b_i = (b_init − b_target) · ∂L/∂b_t
    np.testing.assert_allclose(np.asarray(g_bi), 2.0 * np.asarray(g_bt), rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(g_bi) != 0)


def test_layer_errors():
    layer = pqt.GaussWSLinear(40, 70, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="pqt_path is unset"):
        layer(np.ones((2, 40), np.float32), jax.random.key(0))
    with pytest.raises(ValueError, match="b_target=3.0 conflicts"):
        pqt.apply_pqt(layer.kernel, layer.bitwidth, jax.random.key(0), b_target=3.0)
    with pytest.raises(ValueError, match="kernel shape"):
        pqt.apply_pqt(jnp.ones((64, 32)), layer.bitwidth, jax.random.key(0))
    with pytest.raises(ValueError, match="unknown PQT method"):
        pqt.GaussWSLinear(8, 8, method="uniform", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="b_init != b_target"):
        pqt.init_bitwidth((64, 64), b_init=4.0, b_target=4.0)
