"""``python -m lpt.lab pqt --quick``: Eq. 10 noise statistics and the learnable bitwidth on a toy."""

from lpt.lab.__main__ import main


def test_lab_pqt_quick(tmp_path):
    p = main(["pqt", "--out", str(tmp_path), "--quick"])["pqt"]
    assert p["noise/chi2"] < 18.5  # 4 dof, p = 0.001 (measured 2.1 over 2^22 samples)
    assert abs(p["noise/p0"] - 0.7166) < 0.002  # Eq. 10, not round(N(0,1)/2) = 0.6827
    for m in ("GaussWS", "DiffQ"):
        assert p[f"toy/{m}/bt_end"] > 6.1  # learned: without Eq. 12's term the loss wants more bits (from b_init 6)
        # Eq. 12's term pulls towards b_target = 4 (measured 200 steps: GaussWS 5.38, DiffQ 4.96)
        assert p[f"toy/{m}, λ=0.01/bt_end"] < 5.7
        assert p[f"toy/{m}/fp6"] > p[f"toy/{m}/clean"]  # FP6 deployment costs something
