"""``python -m lpt.lab gemm --quick``: the FP8 accumulation tutorial's accumulator table and the
blockwise-vs-per-tensor comparison."""

from lpt.lab.__main__ import main


def test_lab_gemm_quick(tmp_path):
    res = main(["gemm", "--out", str(tmp_path), "--quick"])
    g = res["gemm"]
    assert g["acc/K=4096/FP8 register (3 bits, sat. 448)"] >= 1e-2
    assert 3e-5 <= g["acc/K=4096/14-bit register"] <= 1e-3  # FP8 accumulation tutorial: ~2-3e-4
    assert g["acc/K=4096/14-bit register"] >= 3 * g["acc/K=4096/14-bit, promote every 128"]
    assert g["promote/None"] > g["promote/128"] > g["promote/16"]  # shorter intervals, smaller error
    block, tensor = g["massive/blockwise"], g["massive/per-tensor"]
    assert tensor[-1] >= 3 * block[-1]  # massive tokens at 1e4: per-tensor scaling loses the bulk
    assert abs(tensor[0] / block[0] - 1) < 0.2  # without massive tokens both are alike
    assert "gemm_promotion.png" in open(res["report"]).read()
