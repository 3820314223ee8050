"""``python -m lpt.lab recipes cost --quick`` on a subset: the trainer's own runs show the
nearest-rounding floor of Zamirai et al."""

import os

import pytest

from lpt.lab import recipes
from lpt.lab.__main__ import main


@pytest.fixture(scope="module")
def recipes_quick(tmp_path_factory):
    """(out dir, results) of ``lab recipes --quick`` on nearest and Kahan. Module-scoped, so this file is one unit
    of work on one xdist worker (tests/conftest.py): test_lab_cost_quick runs after it there and finds the steps it
    compiles (the same model and budget) in the persistent compilation cache."""
    out = tmp_path_factory.mktemp("recipes")
    return out, main(["recipes", "--out", str(out), "--quick", "--recipes", "bf16_nearest,bf16_kahan"])


def test_lab_recipes_quick(recipes_quick):
    tmp_path, res = recipes_quick
    r = res["recipes"]
    # lr 1e-3, 100 steps of a one-layer tiny_cpu (measured: nearest +1.6%, Kahan -0.02% vs the f32 run)
    assert r["bf16_nearest"]["vs_f32"] > 0.008  # most late updates are cancelled: the loss lags
    assert r["bf16_nearest"]["cancelled_late"] > 0.5
    assert abs(r["bf16_kahan"]["vs_f32"]) < 0.004  # compensation recovers the f32 trajectory
    assert r["fp32"]["eval_loss"] < r["unigram"]
    # AdamW state: bf16 params + 2 bf16 moments = 6 bytes/param (+2 for the Kahan compensation); f32: 12
    assert r["bf16_nearest"]["bytes_per_param"] == pytest.approx(6.0, abs=1e-3)
    assert r["bf16_kahan"]["bytes_per_param"] == pytest.approx(8.0, abs=1e-3)
    text = open(res["report"]).read()
    assert "| bf16_kahan |" in text and "recipes_loss.png" in text
    assert os.path.getsize(tmp_path / "recipes_loss.png") > 10_000


def test_lab_cost_quick(tmp_path, recipes_quick):
    # the recipes section's quick model and budget (one layer): the steps test_lab_recipes_quick measures too, which
    # the persistent compilation cache then holds; bytes per parameter and the report do not depend on the size
    sizes = [a for k, v in recipes.QUICK.items() for a in ("--set", f"{k}={v}")]
    c = main(["cost", "--out", str(tmp_path), "--quick", "--recipes", "bf16_kahan", *sizes])["cost"]["tiny"]
    assert c["fp32"]["bytes_per_param"] == pytest.approx(12.0, abs=1e-3)
    assert c["bf16_kahan"]["bytes_per_param"] == pytest.approx(8.0, abs=1e-3)
    assert c["bf16_kahan"]["bytes_per_param"] == recipes_quick[1]["recipes"]["bf16_kahan"]["bytes_per_param"]
    assert c["fp32"]["time_ratio"] == 1.0 and 0.2 < c["bf16_kahan"]["time_ratio"] < 20
    assert c["bf16_kahan"]["temp_mib"] > 0
    assert "XLA temp MiB" in open(tmp_path / "REPORT.md").read()
