"""``python -m lpt.lab updates --quick`` writes a report whose numbers show the effects of
Zamirai et al. and of the norm-preserving update note."""

import os

import numpy as np
import pytest

from lpt.lab.__main__ import main


def test_lab_updates_quick(tmp_path):
    res = main(["updates", "--out", str(tmp_path), "--quick"])
    u = res["updates"]
    assert u["least_squares/bf16 nearest_over_f32"] > 2.0  # the Theorem 1 floor
    assert u["least_squares/bf16 kahan_over_f32"] < 1.01
    assert u["least_squares/bf16 stochastic_over_f32"] < 1.01
    # norm-preserving update note: at lr = 1e-4 nearest loses most of a bf16 update's norm, the search keeps it
    i = 3  # lrs = 1e-7 ... 1e-1, quick: 7 points
    assert u["sweep/bfloat16/nearest"][i] < 0.5
    assert abs(u["sweep/bfloat16/norm_preserving"][i] - 1) < 0.02
    text = open(res["report"]).read()
    assert "| bf16 kahan |" in text and "updates_norm_sweep.png" in text
    assert os.path.getsize(tmp_path / "updates_least_squares.png") > 10_000
    assert np.isfinite(u["sweep/float8_e4m3fn/norm_preserving"]).all()


def test_lab_rejects_unknown_sections(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["nonsense", "--out", str(tmp_path)])
    assert "unknown" in capsys.readouterr().err
