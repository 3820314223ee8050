"""``python -m lpt.lab formats --quick``: the trainer's bf16 and NVFP4 runs of a one-layer tiny LM, and the per-GEMM
quantization error and block-scale health of MXFP8 and NVFP4 on the bf16 run's matmuls."""

import os

from lpt.lab.__main__ import main


def test_lab_formats_quick(tmp_path):
    res = main(["formats", "--out", str(tmp_path), "--quick"])
    f = res["formats"]
    assert f["lm/bf16/vs_bf16"] == 0.0 and f["lm/bf16/spread"] == 0.0  # the baseline against itself
    assert f["lm/nvfp4/eval_loss"][0] < 4.0  # learned (unigram 3.37 + the start's ~5.5 nats): a finite loss
    g = lambda fmt, q, kind="all": f[f"gemm/{kind}/{fmt}/{q}_snr_db"]
    for kind in ("qkv", "out", "up", "down", "all"):
        # e4m3 keeps 3 significand bits, e2m1 1: on the same activations about 6 dB per bit apart
        assert 25 < g("mxfp8", "x", kind) < 36, g("mxfp8", "x", kind)
        assert g("nvfp4", "x", kind) < g("mxfp8", "x", kind) - 8
        assert g("nvfp4", "w", kind) < g("mxfp8", "w", kind) - 8
        # the forward is the same with or without NVFP4's switches; stochastic rounding of dY adds error
        assert g("nvfp4", "x", kind) == g("nvfp4_neither", "x", kind) and g("nvfp4", "y", kind) == g(
            "nvfp4_neither", "y", kind
        )
        assert g("nvfp4", "dy", kind) < g("nvfp4_neither", "dy", kind) - 1
    h = {k.removeprefix("health/"): v for k, v in f.items() if k.startswith("health/")}
    assert h and all(0.0 <= v <= 1.0 for v in h.values())
    for op in ("x", "w", "dy"):
        # finite tensors: no scale can saturate (module docstring of lpt.fp8.microscaling.diagnostics)
        assert h[f"all/mxfp8/{op}_saturated"] == 0.0 and h[f"all/nvfp4/{op}_saturated"] == 0.0
        # NVFP4 clips a block's maximum only under a subnormal block scale; MX's floor rule clips ~1 block in 7
        assert h[f"all/nvfp4/{op}_clipped"] <= h[f"all/nvfp4/{op}_underflow"]
    assert 0.02 < h["all/mxfp8/x_clipped"] < 0.4
    text = open(res["report"]).read()
    assert "| nvfp4 |" in text and "formats_loss.png" in text and "Not testable here" in text
    assert os.path.getsize(tmp_path / "formats_loss.png") > 10_000


def test_findings_judge_differences_against_the_seed_scatter():
    """The findings of a full run (three seeds, every run), on made-up losses: a difference counts only where its
    mean exceeds half its range over the seeds."""
    from lpt.lab import formats

    losses = {
        "bf16": (1.0, 1.0, 1.0),
        "fp8": (1.0, 1.0, 1.0),
        "mxfp8": (1.001, 0.999, 1.0),  # ±0.1%: MXFP8 ≈ bf16
        "nvfp4_neither": (1.02, 1.021, 1.019),
        "nvfp4": (1.03, 1.031, 1.029),  # +0.98% vs neither in every seed: resolved, against NVIDIA
        "nvfp4_hadamard": (1.01, 1.011, 1.009),  # -0.98% in every seed: resolved, as NVIDIA
        "nvfp4_sr": (1.025, 1.01, 1.03),  # +0.49%, -1.08%, +1.08%: inside the scatter
    }
    seeds = (0, 1, 2)
    lm = {(n, s): {"eval_loss": v[i]} for n, v in losses.items() for i, s in enumerate(seeds)}
    e = lambda noise: {"dw": [100.0, noise], "dy": [100.0, noise]}
    table = {("all", "nvfp4_neither"): e(1.0), ("all", "nvfp4_hadamard"): e(0.5), ("all", "nvfp4_sr"): e(2.0)}
    table[("all", "nvfp4")] = e(2.0)
    text = "\n".join(formats.findings(lm, tuple(losses), seeds, table, tuple(formats.GEMM_FORMATS), 460_000, 1.2e6))
    assert "reproduces MXFP8 ≈ bf16" in text
    assert "vs bf16**: +3.00% ± 0.10: above bf16; vs the FP8 run +3.00% ± 0.10: above FP8" in text
    assert "with both vs neither** (validation loss): +0.98% ± 0.00: higher, against" in text
    assert "with Hadamard only vs neither** (validation loss): -0.98% ± 0.00: lower, as in" in text
    assert "with SR only vs neither** (validation loss): +0.16% ± 1.08: inside the seed scatter" in text
    assert "dW's SNR +3.01 dB with it" in text and "dY's SNR -3.01 dB with it" in text
    assert "0.46M parameters, 1.20M tokens" in text and "One seed" not in text
