"""``python -m lpt.lab attention --quick``: Qiu & Yao's bias with repeated maxima, and its removal."""

from lpt.lab.__main__ import main


def test_lab_attention_quick(tmp_path):
    a = main(["attention", "--out", str(tmp_path), "--quick"])["attention"]
    # t over 64 draws (63 dof); the errors are bf16 roundings, the same on every CPU to 1e-4 in t (measured: AVX2
    # and SSE4.2 code). An unbiased error passes |t| < 4 except with probability 1.7e-4 (two-sided)
    assert a["paper all-bf16, standard max shift (1 block)/t"] < -5  # biased (measured t = -9.4)
    assert abs(a["paper all-bf16, β = 7 rule (1 block)/t"]) < 4  # the β rule removes it (measured t = -1.1)
    # β = 8 puts ~12% of the rows above the offset guard (7·M > 64): a constant capped offset gave t = +5.4 here
    assert abs(a["beta_sweep/8.0"]) < 4  # (measured t = -0.4)
    std_rms = a["FA2 kernel, standard (blocks of 16)/rms"]
    assert a["FA2 kernel, lpt default (blocks of 16)/rms"] < 1e-3 * std_rms  # default: f32 round-off only
    assert abs(a["FA2 kernel, lpt default (blocks of 16)/mean"]) < 1e-3 * abs(
        a["paper all-bf16, standard max shift (1 block)/mean"]
    )
