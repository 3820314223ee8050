"""The matmul-format registry (lpt.models.matmul_formats): a format defined and registered here, in the test module
alone, is a config value of ``precision.matmul.<kind>`` that the normal trainer runs: its GEMM is the one the layer
calls (the loss differs from bf16's), its probe is the one the diagnostics pass records, and it is refused again once
unregistered. Unknown names get one line naming the value and every registered name."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpt import numerics
from lpt.models import matmul_formats, probes
from lpt.models.config import Matmul, ModelSpec, Precision, check_matmul_blocks
from lpt.train import config as config_lib
from lpt.train.loop import train

SHORT = {  # tiny_cpu's model and data, three steps
    "train.steps": "3",
    "train.log_every": "1",
    "train.eval_every": "3",
    "train.eval_batches": "1",
    "train.checkpoint_every": "3",
    "train.diagnostics_every": "2",
}


class WeightBits4(matmul_formats.MatmulFormat):
    """f32 GEMM of x and the weight rounded to 4 mantissa bits (straight-through gradient); K and N multiples of 8."""

    name = "test_w4"

    def __init__(self):
        self.calls = 0

    def gemm(self, x, w, *, w_axes, key, path, prec):
        self.calls += 1  # at trace time
        w4 = self._rounded(w)
        return jnp.einsum("...k,kn->...n", x.astype(jnp.float32), w4, preferred_element_type=jnp.float32)  # -> f32

    def block(self, numerics):
        return 8

    def probe(self, name, x, w, y_f32):
        changed = jnp.sum(self._rounded(w) != w.astype(jnp.float32))  # int32 count
        probes.current().add(f"{self.name}/{name}/w_changed_frac", probes.RATIO, changed, w.size)

    @staticmethod
    def _rounded(w):
        w32 = w.astype(jnp.float32)  # compute dtype -> f32 (exact)
        # value: the rounded weight exactly (w32 - w32 = 0); gradient: identity
        return jax.lax.stop_gradient(numerics.round_to_bits(w32, 4)) + (w32 - jax.lax.stop_gradient(w32))


@pytest.fixture
def w4():
    fmt = matmul_formats.register(WeightBits4())
    yield fmt
    matmul_formats.unregister(fmt.name)


def _run(tmp_path, name: str, overrides: dict) -> list[dict]:
    cfg = config_lib.load_config_file("tiny_cpu")
    cfg = config_lib.apply_overrides(cfg, {**SHORT, **overrides})
    train(cfg, tmp_path / name)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_a_registered_format_trains_through_the_trainer(tmp_path, w4):
    toy = _run(tmp_path, "toy", {"precision.matmul.up": w4.name})
    assert w4.calls > 0  # the layers called this module's GEMM
    plain = _run(tmp_path, "bf16", {})
    loss = lambda recs: np.array([r["loss"] for r in recs if "loss" in r])
    assert len(loss(toy)) == len(loss(plain)) == 3
    # 4 mantissa bits move every weight by up to 2^-5 relative: every step's loss differs from bf16's
    assert np.all(np.abs(loss(toy) - loss(plain)) > 1e-5), (loss(toy), loss(plain))
    diag = [r for r in toy if f"model/{w4.name}/up/w_changed_frac" in r]
    assert diag and 0.5 < diag[0][f"model/{w4.name}/up/w_changed_frac"] <= 1.0  # this module's probe ran
    assert not any(k.startswith(f"model/{w4.name}/") for r in plain for k in r)


def test_the_format_owns_its_shape_check(w4):
    spec = ModelSpec(d_model=128, d_ff=388)  # up: 128 x 388, not a multiple of 8
    with pytest.raises(ValueError) as e:
        check_matmul_blocks(spec, _numerics(up=w4.name))
    assert str(e.value) == (
        "precision.matmul.up='test_w4' needs K and N multiples of 8, but the model's up weight is 128x388; change "
        "the model's widths or use another matmul for up"
    )
    check_matmul_blocks(ModelSpec(d_model=128, d_ff=384), _numerics(up=w4.name))  # multiples of 8: accepted


def _numerics(**matmul) -> Precision:
    return Precision(matmul=Matmul(**matmul))


def test_unknown_names_are_one_line_errors_naming_every_registered_format(w4):
    cfg = config_lib.load_config_file("tiny_cpu")
    with pytest.raises(ValueError) as e:
        config_lib.apply_overrides(cfg, {"precision.matmul.up": "nope"})
    assert str(e.value) == (
        "config key precision.matmul.up='nope' is not allowed; valid values: bf16, fp8, mxfp8, nvfp4, test_w4"
    )
    with pytest.raises(ValueError) as e:
        matmul_formats.get("nope")
    assert str(e.value) == "matmul format 'nope' is not registered; allowed: bf16, fp8, mxfp8, nvfp4, test_w4"
    assert "one of: bf16, fp8, mxfp8, nvfp4, test_w4" in config_lib.schema_help(cfg)  # --help lists it


def test_registration_is_checked_and_live():
    fmt = WeightBits4()
    cfg = config_lib.load_config_file("tiny_cpu")
    matmul_formats.register(fmt)
    try:
        assert config_lib.apply_overrides(cfg, {"precision.matmul.down": fmt.name}).precision.matmul.down == fmt.name
        with pytest.raises(ValueError, match="matmul format 'test_w4' is already registered"):
            matmul_formats.register(WeightBits4())
    finally:
        matmul_formats.unregister(fmt.name)
    with pytest.raises(ValueError, match="precision.matmul.down='test_w4' is not allowed; valid values: bf16, fp8, "):
        config_lib.apply_overrides(cfg, {"precision.matmul.down": fmt.name})
    with pytest.raises(ValueError, match="matmul format 'fp8' is built in"):
        matmul_formats.unregister("fp8")
    bad = WeightBits4()
    bad.name = "a/b"
    with pytest.raises(ValueError, match="matmul format name 'a/b' must be an identifier"):
        matmul_formats.register(bad)
